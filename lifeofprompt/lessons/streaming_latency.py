"""Chunked prefill, seen by the users already streaming: the gaps between their tokens while a long
prompt arrives.

A server that is decoding for a few users gives each of them one token per step. When a long prompt
arrives, its prefill has to go into steps too. Without chunking the whole prompt is one step, and
every user already streaming waits that whole step for their next token: a stall of seconds in the
middle of an answer. With chunked prefill the step's token budget (``max_num_batched_tokens``) cuts
the prompt: the decodes take one token each and the prompt gets what is left, so each step carries
the decodes *and* one chunk, and the streams keep getting a token every step, each gap only one
chunk long. The long prompt's own first
token comes a little later (more steps, each with its fixed cost). ``decode_gaps_beside_prefill``
measures both on the real engine, from the engine's own token timestamps (``RequestMetrics``).

``benchmarks/fair_prefill.py`` measures the other side of the same scheduler rule: a *new* short
request's time to first token beside a long prefill.
"""

from __future__ import annotations

import itertools
import statistics
from dataclasses import dataclass, field

from ..engine.sampling_params import SamplingParams
from .serving_study import random_prompts

_ids = itertools.count()


@dataclass
class StreamGaps:
    """What the streams saw while one long prompt prefilled."""

    label: str
    long_len: int
    prefill_chunks: list[int]  # the long prompt's tokens in each step of its prefill
    before_gaps_s: list[float]  # a stream's inter-token gaps before the long prompt arrived
    during_gaps_s: list[float]  # its gaps from the long prompt's arrival to the long's first token
    long_ttft_s: float  # the long prompt's arrival to its first token
    token_times: dict[str, list[float]] = field(default_factory=dict)  # every stream's token times (s, from arrival)
    arrival_s: float = 0.0  # when the long prompt arrived, on the same clock

    @property
    def steady_gap_s(self) -> float:
        return statistics.median(self.before_gaps_s)

    @property
    def worst_gap_s(self) -> float:
        return max(self.during_gaps_s)

    @property
    def median_gap_s(self) -> float:
        """The typical wait while the prompt prefilled (on a shared machine the worst one is also the noisiest)."""
        return statistics.median(self.during_gaps_s)


def unchunked_budget(long_len: int, num_streams: int) -> dict:
    """Engine settings that put the whole prompt in one step beside the decodes (vLLM's
    ``enable_chunked_prefill=False`` in spirit): a budget that holds it, and no fair-chunk limit."""
    return dict(max_num_batched_tokens=long_len + num_streams, long_prefill_token_threshold=0)


def chunked_budget(chunk: int, num_streams: int) -> dict:
    """Engine settings that cut a long prompt into ``chunk``-token pieces beside ``num_streams`` decodes,
    as vLLM does by default: by the step's token budget alone (room for the decodes and one chunk),
    with no extra per-prompt cap."""
    return dict(max_num_batched_tokens=chunk + num_streams, long_prefill_token_threshold=0)


def decode_gaps_beside_prefill(
    engine,
    long_len: int,
    num_streams: int = 4,
    stream_prompt_len: int = 16,
    steady_tokens: int = 4,
    after_tokens: int = 2,
    label: str = "",
    seed: int = 0,
) -> StreamGaps:
    """``num_streams`` requests decode; after ``steady_tokens`` of theirs a ``long_len``-token prompt
    arrives; the streams go on until ``after_tokens`` steps past the long prompt's first token.

    The streams' gaps come from their token timestamps (the end of the step that sampled each
    token), so a gap is exactly what a user watching the stream would wait.
    """
    vocab = engine.model_config.vocab_size
    streams = [f"stream-{next(_ids)}" for _ in range(num_streams)]
    long_id = f"long-{next(_ids)}"
    # enough tokens to outlast a prefill in chunks of 16 or more (the streams are aborted at the end)
    endless = SamplingParams(
        temperature=0, max_tokens=steady_tokens + after_tokens + long_len // 16 + 8, ignore_eos=True
    )
    for rid, prompt in zip(streams, random_prompts(num_streams, stream_prompt_len, vocab, seed)):
        engine.add_request(rid, prompt, endless)
    latest = {}

    def step() -> None:
        for out in engine.step():
            latest[out.request_id] = out

    while min(len(latest[r].outputs[0].token_ids) if r in latest else 0 for r in streams) < steady_tokens:
        step()
    long_prompt = random_prompts(1, long_len, vocab, seed + 1)[0]
    engine.add_request(
        long_id, long_prompt, SamplingParams(temperature=0, max_tokens=after_tokens + 1, ignore_eos=True)
    )
    first_step = len(engine.step_records)
    while long_id not in latest or not latest[long_id].outputs[0].token_ids:
        step()
    prefill_records = list(engine.step_records)[first_step:]
    if any(latest[r].finished for r in streams):
        raise RuntimeError("a stream finished before the long prompt's first token: chunks under 16 tokens?")
    for _ in range(after_tokens):
        step()
    for rid in streams:
        engine.abort(rid)
    engine.run_until_done()
    long_metrics = latest[long_id].metrics
    arrival = long_metrics.arrival_time
    times = latest[streams[0]].metrics.token_times
    t0 = latest[streams[0]].metrics.arrival_time
    before = [b - a for a, b in zip(times, times[1:]) if b <= arrival]
    during = [b - a for a, b in zip(times, times[1:]) if b > arrival and b <= long_metrics.first_token_time]
    chunks = [s.num_tokens for r in prefill_records for s in r.scheduled if s.request_id == long_id]
    return StreamGaps(
        label=label,
        long_len=long_len,
        prefill_chunks=chunks,
        before_gaps_s=before,
        during_gaps_s=during,
        long_ttft_s=long_metrics.first_token_time - arrival,
        token_times={r: [t - t0 for t in latest[r].metrics.token_times] for r in streams},
        arrival_s=arrival - t0,
    )


def gaps_table(results: list[StreamGaps]) -> str:
    """One line per run: prefill steps, a stream's tokens and median and worst gap while the prompt prefilled, its
    steady gap, the long prompt's TTFT."""
    lines = [
        f"{'':14}{'prefill steps':>14}{'tokens meanwhile':>17}{'steady gap':>12}{'median gap':>12}{'worst gap':>11}"
        f"{'long TTFT':>11}"
    ]
    for r in results:
        lines.append(
            f"{r.label:14}{len(r.prefill_chunks):>14}{len(r.during_gaps_s):>17}{r.steady_gap_s * 1e3:>10.0f}ms"
            f"{r.median_gap_s * 1e3:>10.0f}ms{r.worst_gap_s * 1e3:>9.0f}ms{r.long_ttft_s:>10.2f}s"
        )
    return "\n".join(lines)

"""Async scheduling: the next step scheduled and its inputs built while this one's forward runs.

A synchronous engine leaves the model idle while the host works: after each forward it samples,
updates the scheduler, turns tokens into text and outputs, schedules the next step and builds its
inputs, and only then starts the next forward. vLLM's ``async_scheduling`` (its default since
v0.14), SGLang's overlap scheduler and mini-sglang's ``overlap_loop`` hide most of that work behind
the forward. Here, one engine step (``AsyncScheduling.step``) does, in order:

1. step N's forward is already running on the forward thread (it was started by the last call);
2. the scheduler plans step N + 1 as if N were done (``Scheduler.expect`` counted N's rows as
   computed when it started, and each token N will sample holds a ``PLACEHOLDER`` at the end of its
   sequence), and the runner builds N + 1's inputs, the placeholders still in them;
3. wait for N's logits, sample them, and let the scheduler take the tokens: each fills its
   placeholder; a request that stopped on it (EOS, a stop token, ``max_tokens``) finishes and gives
   its blocks back;
4. N's sampled ids go into N + 1's inputs where the placeholders were, and N + 1 starts;
5. the engine turns N's tokens into text and outputs (``output_processor.py``) while N + 1 runs.

**No token past a stop.** A request that stops at step N is already in step N + 1 (scheduled before
N's token was known). Its row there is computed but never read: the scheduler skips a finished
sequence's tokens, so it is never emitted, counted in usage, or registered in the prefix cache. Its
blocks went back at N's end, and a block given to another request is written by a later step, which
runs after N + 1: the discarded row's write cannot reach anyone's cache. A stop string, found in the
text after the step, ends the request at the next call, as without overlap; the output processor
never emits a token after a stop string. The same holds for an abort, and for a request preempted
while its step runs (recompute makes its token again).

**What runs synchronously.** Speculation (a verify's kept tokens decide where the next step starts),
pipeline stages (``pipeline_overlap.py`` overlaps those), tensor-parallel ranks and CUDA graphs (their
static inputs would be written while a replay reads them) turn async scheduling off for the engine,
said in the start-up log. A step in which a request scores its prompt (``prompt_logprobs``) waits for
the step in flight and runs as a plain step. Structured output, ``n > 1``, ``min_tokens``, penalties,
logprobs and preemption work with it on: sampling stays on the engine's thread, after the tokens it
depends on are in place.

On a CPU the forward thread runs the model's C step or torch ops, which release Python's lock, so
the host's work runs on another core meanwhile.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from ..errors import ConfigError
from .sampling_params import SamplingParams
from .sequence import PLACEHOLDER, SequenceStatus


@dataclass
class InFlight:
    """A step whose forward runs: the engine's started step (batch, trace), the forward's future, and the
    times the forward thread took it up and put it down (for the trace's timeline)."""

    started: object  # llm_engine.StartedStep
    future: Future  # -> (logits, launch)
    forward_times: list  # [start, end] of the forward, filled by the forward thread


def why_not(resolved, spec, parallel) -> str | None:
    """Why this engine cannot schedule ahead (None: it can): said in the start-up log."""
    if spec is not None:
        return "speculative decoding (a verify's kept tokens decide where the next step starts)"
    if resolved.pipeline_parallel_size > 1:
        return "pipeline stages (their own overlap keeps a step per stage in flight)"
    if parallel is not None:
        return "tensor-parallel ranks"
    if resolved.cuda_graphs:
        return "CUDA graphs (the next step's inputs would be written while a replay reads them)"
    return None


# Where it can, is it on when not asked? On a GPU the forward's kernels run on the device while the host
# works. On a CPU the forward thread and the host share the cores and Python's lock, and handing a step to
# the forward thread and back costs two thread wake-ups (0.2-0.6 ms each on a 2-core VM): the CPU's speed-ups
# time both ways at start-up and keep the faster (``CpuSpeedups.choose_async_scheduling``; on a 2-core Intel
# Xeon it measured 0.96x-0.97x, benchmarks/NOTES.md). Where nothing is timed (cpu_tuning pinned or off) it
# stays off.
CPU_UNTIMED_WHY = "off: not timed on this CPU (cpu_tuning is pinned or off; async_scheduling=True turns it on)"
TIMING_PROMPT_TOKENS = 16  # the request a start-up timing decodes: its prompt, and the tokens after its first
TIMING_TOKENS = 16


def choose(config, resolved, spec, parallel, timed=lambda: None) -> tuple[bool, str]:
    """Whether the engine schedules ahead, and why (the start-up log's line): as asked where it can
    (``ConfigError`` where it cannot), else on a GPU where it can, and on a CPU as ``timed()`` measured
    (the device's speed-ups; None where they time nothing: off)."""
    asked, cannot = config.async_scheduling, why_not(resolved, spec, parallel)
    if asked and cannot:
        raise ConfigError(f"async_scheduling=True does not work with {cannot}", param="async_scheduling")
    if asked is not None:
        return asked, "on: as asked" if asked else "off: as asked"
    if cannot:
        return False, "off: " + cannot
    if resolved.device.startswith("cuda"):
        return True, "on: a GPU's forward runs while the host prepares the next step"
    measured = timed()
    return measured if measured is not None else (False, CPU_UNTIMED_WHY)


def time_decode(engine, on: bool) -> float:
    """Seconds a token of one request's greedy decode through ``engine.step()`` (the host's work included),
    with async scheduling on or off: what a CPU times at start-up. The request goes through the engine's
    books (its blocks, the prefix cache, the trace), which the engine starts again afterwards."""
    engine.overlap = (
        AsyncScheduling(engine.scheduler, engine.runner, engine._start_step, engine._finish_step) if on else None
    )
    room = engine.max_model_len - 1
    prompt_len = max(1, min(TIMING_PROMPT_TOKENS, room // 3))
    tokens = max(1, min(TIMING_TOKENS, room - prompt_len - 1))
    prompt = [(7 * i + 3) % engine.model_config.vocab_size for i in range(prompt_len)]
    params = SamplingParams(temperature=0, max_tokens=tokens + 1, ignore_eos=True)
    engine.add_request(f"async-scheduling-timing-{len(engine.step_records)}-{on}", prompt, params)
    first = None
    try:
        while engine.has_unfinished_requests():
            outputs = engine.step()
            if first is None and any(o.outputs[0].token_ids for o in outputs):
                first = time.perf_counter()  # the prompt's step is done: from here on, decode steps
        return (time.perf_counter() - first) / tokens
    finally:
        if engine.overlap is not None:
            engine.overlap.shutdown()
        engine.overlap = None


class AsyncScheduling:
    def __init__(self, scheduler, runner, start_step, finish_step, clock=time.monotonic):
        """``start_step``/``finish_step``: the engine's bookkeeping before a step runs and after it ran
        (``LLMEngine._start_step``, ``LLMEngine._finish_step``), the same as for a synchronous step."""
        self.scheduler, self.runner = scheduler, runner
        self.start_step, self.finish_step, self.clock = start_step, finish_step, clock
        self.forward_thread = ThreadPoolExecutor(1, thread_name_prefix="lifeofprompt-forward")
        self.in_flight: InFlight | None = None

    def step(self) -> list:
        """One engine step: schedule and build N + 1 while N runs, then take N's tokens and start N + 1.
        Returns N's new tokens (``NewTokens``), as a synchronous step returns its own."""
        if self.in_flight is None:
            planned = self.clock()
            batch = self.scheduler.schedule()
            if not batch.seqs:
                return []
            batch.trace.scheduled_time = planned
            self.launch(batch, self.runner.prepare(batch.seqs, batch.num_scheduled_tokens))
        planned = self.clock()
        ahead = self.scheduler.schedule()  # around the placeholders of the step in flight
        ahead.trace.scheduled_time = planned
        inputs = self.runner.prepare(ahead.seqs, ahead.num_scheduled_tokens) if ahead.seqs else None
        updates = self.finish()
        if any(seq.status == SequenceStatus.RUNNING for seq in ahead.seqs):
            fill_placeholders(ahead, inputs[0])
            self.launch(ahead, inputs)
        return updates

    def finish(self) -> list:
        """Wait for the step in flight, sample it, and hand it to the engine's bookkeeping."""
        current, self.in_flight = self.in_flight, None
        logits, launch = current.future.result()
        batch = current.started.batch
        logits, samples = live_rows(batch, logits)
        out = self.runner.sample_step(batch.seqs, batch.num_scheduled_tokens, logits, launch, samples)
        current.started.record.forward_times = tuple(current.forward_times)
        return self.finish_step(current.started, out)

    def launch(self, batch, inputs) -> None:
        """Start ``batch``'s forward on the forward thread, then count it as computed (``Scheduler.expect``)."""
        started = self.start_step(batch)
        times: list = []
        future = self.forward_thread.submit(self.forward, inputs, times)
        self.scheduler.expect(batch)
        self.in_flight = InFlight(started, future, times)

    @torch.no_grad()  # grad mode is per thread
    def forward(self, inputs, times: list):
        times.append(self.clock())
        input_ids, positions, meta = inputs
        logits = self.runner.run_model(input_ids, positions, meta)
        launch = self.runner.launch("eager, scheduled ahead", input_ids.shape[0])
        times.append(self.clock())
        return logits, launch

    def drain(self) -> list:
        """Finish the step in flight without starting another (before a step that must run synchronously)."""
        return self.finish() if self.in_flight is not None else []

    def shutdown(self) -> None:
        self.forward_thread.shutdown(wait=True)


def live_rows(batch, logits: torch.Tensor):
    """The logits rows of the sequences still running, and which of them sample: a sequence that ended
    (a stop, an abort) or was preempted while its step ran is not sampled, so its grammar and random
    stream stay where its answer left them."""
    keep, samples, row = [], [], 0
    for seq, samples_here in zip(batch.seqs, batch.samples):
        running = seq.status == SequenceStatus.RUNNING
        samples.append(samples_here and running)
        if samples_here:
            if running:
                keep.append(row)
            row += 1
    return (logits if len(keep) == row else logits[keep]), samples


def fill_placeholders(batch, input_ids: torch.Tensor) -> None:
    """Put each sequence's newest token where its placeholder stood in ``input_ids`` (a placeholder is
    always a sequence's last row). A sequence that ended meanwhile gets its last real token: its row is
    computed and never read."""
    holes = (input_ids == PLACEHOLDER).nonzero().flatten().tolist()
    if not holes:
        return
    owner, row = {}, 0
    for seq, n in zip(batch.seqs, batch.num_scheduled_tokens):
        row += n
        owner[row - 1] = seq
    input_ids[holes] = torch.tensor([owner[r].last_token for r in holes], dtype=input_ids.dtype)

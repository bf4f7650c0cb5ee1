"""The measurements of chapter 13 (the load test): decode steps, the batching curve, load tests at many rates.

Three questions, each answered on the machine at hand:

* how close is one decode step to its floor (weight bytes ÷ bandwidth)? ``time_decode_steps``;
* how does the step time grow with sequences in flight, against the roofline's prediction?
  ``batching_curve`` and ``predicted_curve``;
* what does a user wait at a given load? ``poisson_sweep`` and ``repeat_runs`` run the load
  tester (``lifeofprompt.loadtest.client``) against a server at several rates or seeds.

Every number comes from the engine's own step records or from the load tester's records; this
module only drives them. The plots are in ``lifeofprompt/figures/serving.py``.
"""

from __future__ import annotations

import itertools
import statistics
from dataclasses import dataclass

import numpy as np

from ..engine.sampling_params import SamplingParams
from ..latency import achieved_arrival_rate
from ..loadtest import arrivals
from ..loadtest.client import LoadTestConfig, LoadTestResult, run_loadtest
from . import roofline

_ids = itertools.count()


@dataclass
class BatchPoint:
    """One point of the batching curve: ``batch_size`` sequences decoding together."""

    batch_size: int
    step_s: float  # fastest decode step, seconds (the one least disturbed by other programs)
    context_tokens: int  # tokens in the cache over all sequences, at the middle step
    median_s: float | None = None  # median decode step, seconds

    @property
    def tokens_per_s(self) -> float:
        return self.batch_size / self.step_s


def random_prompts(num_prompts: int, prompt_len: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Distinct random token-id prompts (no shared prefix, so the prefix cache stays out of it)."""
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(100, vocab_size, prompt_len)] for _ in range(num_prompts)]


def time_decode_steps(
    engine, batch_size: int, prompt_len: int = 16, decode_steps: int = 8, seed: int = 0
) -> BatchPoint:
    """Run ``batch_size`` requests together and time the steps where all of them decode.

    Each request asks for ``decode_steps + 1`` tokens with ``ignore_eos``: one from the prefill
    step, then ``decode_steps`` steps of exactly ``batch_size`` decode tokens. Those steps'
    durations come from the engine's ``step_records``. The fastest is the point of the curve,
    as the roofline's bandwidth and matmul rate are best-of measurements too (on a shared
    machine it is the step least disturbed by others); the median comes along.
    """
    params = SamplingParams(temperature=0, max_tokens=decode_steps + 1, ignore_eos=True)
    first_step = len(engine.step_records)
    for prompt in random_prompts(batch_size, prompt_len, engine.model_config.vocab_size, seed):
        engine.add_request(f"batch-{next(_ids)}", prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
    records = list(engine.step_records)[first_step:]
    decodes = [r for r in records if r.num_seqs == batch_size and r.num_batched_tokens == batch_size]
    if not decodes:
        raise RuntimeError(
            f"no step decoded all {batch_size} sequences together: the engine needs max_num_seqs >= {batch_size} "
            f"(it has {engine.scheduler.config.max_num_seqs}) and a step budget that prefills them all at once, "
            f"max_num_batched_tokens >= {batch_size * prompt_len} "
            f"(it has {engine.scheduler.config.max_num_batched_tokens}); "
            "with less, the first requests finish before the last are prefilled"
        )
    middle = prompt_len + 1 + decode_steps // 2
    durations = [r.end_time - r.start_time for r in decodes]
    return BatchPoint(batch_size, min(durations), batch_size * middle, statistics.median(durations))


def batching_curve(
    engine, batch_sizes=(1, 2, 4, 8, 16, 32), prompt_len: int = 16, decode_steps: int = 8
) -> list[BatchPoint]:
    """Decode step time for each batch size (a warm-up run first, not reported)."""
    time_decode_steps(engine, 1, prompt_len, 2)
    return [time_decode_steps(engine, b, prompt_len, decode_steps, seed=b) for b in batch_sizes]


def predicted_curve(machine: roofline.Machine, config, dtype, points: list[BatchPoint]) -> list[float]:
    """The roofline's step time for each measured point (same tokens, same context)."""
    return [
        roofline.predict_step_time(machine, config, dtype, p.batch_size, p.context_tokens, p.batch_size) for p in points
    ]


def bend_batch_size(machine: roofline.Machine, config, dtype, context_per_seq: int, limit: int = 4096) -> int | None:
    """The smallest batch whose decode step the roofline calls compute-bound (operations ÷ rate ≥ bytes ÷ bandwidth).

    Below it, one more sequence adds only its own cache reads to a step that reads all the
    weights anyway; above it, every sequence adds its full share of arithmetic.
    """
    for batch in range(1, limit + 1):
        nbytes, flops = roofline.step_bytes_and_flops(config, dtype, batch, batch * context_per_seq, batch)
        if flops / machine.flops >= nbytes / machine.bandwidth:
            return batch
    return None


# ----------------------------------------------------------------------------- load tests


def rate_offering(target: float, num_requests: int, seed: int) -> float:
    """The rate to set so that seed ``seed``'s Poisson schedule of ``num_requests`` *offers* ``target`` req/s.

    A short schedule's gaps do not average 1/rate: seed 1's 60 gaps run about a tenth long, so a
    point set at 0.95× capacity would offer 0.85×. The seed's pattern only scales with the rate,
    so one division puts the offered rate, counted as the load test's report counts it
    (``metrics.achieved_arrival_rate``), where the sweep means it to be.
    """
    times = arrivals.poisson(num_requests, 1.0, seed).send_times()
    return target / achieved_arrival_rate([{"arrival_time": t} for t in times])


def poisson_sweep(url: str, rates, seed: int = 0, **workload) -> list[LoadTestResult]:
    """One Poisson load test per rate (requests per second), same workload and seed."""
    return [
        run_loadtest(LoadTestConfig(url=url, arrival="poisson", rate=float(rate), seed=seed, **workload))
        for rate in rates
    ]


def repeat_runs(url: str, rate: float, seeds, **workload) -> list[LoadTestResult]:
    """The same Poisson load test with different seeds: how far p99 moves from run to run."""
    return [
        run_loadtest(LoadTestConfig(url=url, arrival="poisson", rate=float(rate), seed=seed, **workload))
        for seed in seeds
    ]


def sweep_table(results: list[LoadTestResult]) -> str:
    """Set rate, achieved arrival rate, completed rate, TTFT p50/p99, TPOT p50 and output throughput, a line per run.

    The achieved arrival rate stands beside every percentile, since a short Poisson schedule
    offers more or less than the rate it was set to; "done req/s" counts the completed requests
    over the run, from the first send to the last answer.
    """
    lines = [
        f"{'set req/s':>10}{'got req/s':>10}{'done req/s':>11}{'seed':>6}{'n':>4}{'TTFT p50':>10}{'TTFT p99':>10}"
        f"{'TPOT p50':>10}{'out tok/s':>10}"
    ]
    for r in results:
        s = r.summary
        lines.append(
            f"{r.config.rate:>10.2f}{s['achieved_arrival_rate']:>10.2f}{s['request_throughput']:>11.2f}"
            f"{r.config.seed:>6d}{s['completed']:>4d}"
            f"{s['ttft_s']['p50']:>9.2f}s{s['ttft_s']['p99']:>9.2f}s{s['tpot_s']['p50'] * 1e3:>8.0f}ms"
            f"{s['output_throughput']:>10.1f}"
        )
    return "\n".join(lines)

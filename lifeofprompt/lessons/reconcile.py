"""One quantity measured in several places, set side by side: the batch-1 step and the read rates.

The measurements appendix shows the CPU's batch-1 decode step twice (the shared machine profile's, the
committed engine benchmark's) and its memory read rate three times (the profile's, the
benchmark's, the product-path table's). They are not meant to agree to the digit: each was
taken by its own function, in its own run, at its own moment on a shared machine. These
functions gather, for each number, what it measures, which run it came from, at how many
threads and under what load, and what uses it, so the appendix prints the comparison from the
numbers themselves instead of a reader guessing why two of them differ.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import roofline
from .machine_profile import PROFILE_CONTEXT, PROFILE_DECODE_STEPS, MachineProfile
from .story_model import SMOLLM2_135M

# benchmarks/cpu_linear.py's own read_bandwidth (tests/test_reconcile.py checks its source still says so)
LINEAR_SUM_BYTES = 256 << 20
LINEAR_SUM_REPEATS = 5


@dataclass(frozen=True)
class StepTiming:
    """One measurement of the batch-1 decode step, with the read rate measured in the same run."""

    source: str  # where the number is stored
    step_s: float
    how: str  # what was timed, and which statistic of the timed steps
    when: str
    load_average: float | None  # None: the run did not record it
    threads: int | None
    read_bandwidth: float  # bytes/s a sum() read in the same run
    weight_bytes: int  # what a batch-1 step reads (the embedding table but one row excluded)

    @property
    def floor_s(self) -> float:
        """The step's floor in its own run: the weights read once at that run's read rate."""
        return self.weight_bytes / self.read_bandwidth

    @property
    def over_floor(self) -> float:
        return self.step_s / self.floor_s

    @property
    def weights_read_rate(self) -> float:
        """Bytes/s the step's weights went through, the whole step counted (products and all the rest)."""
        return self.weight_bytes / self.step_s


@dataclass(frozen=True)
class StepComparison:
    """The machine profile's batch-1 step against the committed benchmark's."""

    profile: StepTiming
    benchmark: StepTiming
    benchmark_fastest_s: float | None  # the fastest of the benchmark's timed steps (it reports the median)

    @property
    def step_ratio(self) -> float:
        """How many times the profile's step the benchmark's took."""
        return self.benchmark.step_s / self.profile.step_s

    @property
    def read_ratio(self) -> float:
        """How many times the profile's read rate the benchmark's run measured."""
        return self.benchmark.read_bandwidth / self.profile.read_bandwidth

    def same_distance_from_floor(self, tolerance: float = 0.1) -> bool:
        """Both steps within ``tolerance`` (relative) of the same multiple of their own run's floor:
        then the machine's speed at each moment, not the engine, accounts for the difference."""
        a, b = self.profile.over_floor, self.benchmark.over_floor
        return abs(a - b) <= tolerance * min(a, b)


def _load(value) -> str:
    return "not recorded" if value is None else f"{value:.2f}"


def profile_step(profile: MachineProfile, weight_bytes: int) -> StepTiming:
    """The shared profile's step: a fresh engine, one request, the fastest of its timed steps."""
    return StepTiming(
        source="machine profile (lifeofprompt.lessons.machine_profile)",
        step_s=profile.decode_step_s,
        how=(
            f"the fastest of {PROFILE_DECODE_STEPS} decode steps of a fresh engine serving one request "
            f"after a {PROFILE_CONTEXT}-token prompt, timed by the engine's step records"
        ),
        when=profile.measured_at,
        load_average=profile.load_average,
        threads=profile.threads,
        read_bandwidth=profile.read_bandwidth,
        weight_bytes=weight_bytes,
    )


def benchmark_step(cpu: dict, source: str, weight_bytes: int) -> StepTiming:
    """``benchmarks/bench_engine.py``'s step: the batching curve's batch-1 point, timed after the whole workload."""
    row = next(r for r in cpu["batching_curve"] if r["batch"] == 1 and "step_s" in r)
    steps = f"{row['timed_steps']} " if "timed_steps" in row else "its timed "
    b1 = cpu["batch1_step"]
    return StepTiming(
        source=source,
        step_s=row["step_s"],
        how=(
            f"the median of {steps}decode steps, each a `model_runner.step` call on the benchmark's engine "
            f"after its whole workload, {row['context']} tokens of context"
        ),
        when=f"the run that began {cpu['env']['date']}",
        load_average=b1.get("load_average"),
        threads=cpu.get("threads"),
        read_bandwidth=b1["read_bandwidth"],
        weight_bytes=weight_bytes,
    )


def batch1_weight_bytes(dtype=torch.float32) -> int:
    """The bytes a batch-1 decode step of the embedded SmolLM2-135M reads (both steps are of it, in fp32)."""
    return roofline.decode_weight_bytes(SMOLLM2_135M, dtype)


def compare_steps(profile: MachineProfile, cpu: dict, source: str) -> StepComparison:
    """The profile's step beside the benchmark's, each with its own run's read floor (both fp32's)."""
    if cpu.get("quantization"):
        raise ValueError(f"the profile's step is fp32's; this benchmark ran on {cpu['quantization']} blocks")
    weight_bytes = batch1_weight_bytes(getattr(torch, cpu.get("dtype", "float32")))
    bench = benchmark_step(cpu, source, weight_bytes)
    row = next(r for r in cpu["batching_curve"] if r["batch"] == 1 and "step_s" in r)
    return StepComparison(profile_step(profile, weight_bytes), bench, row.get("min_step_s"))


# ----------------------------------------------------------------------------- read rates


@dataclass(frozen=True)
class Rate:
    """One bytes-per-second figure of the appendix: what moved, in which run, and what it is used for."""

    name: str
    bytes_per_s: float
    measures: str
    run: str
    threads: int | None
    used_for: str


def read_rates(comparison: StepComparison, cpu: dict, linear: dict, linear_source: str) -> list[Rate]:
    """Every memory rate the appendix shows, bare reads first, then weights read inside products and steps."""
    profile, bench = comparison.profile, comparison.benchmark
    read_how = (
        f"`sum()` over {roofline.CPU_READ_BYTES >> 20} MiB in 2 MiB pages, "
        f"fastest of {roofline.BANDWIDTH_REPEATS} (`roofline.measure_read_bandwidth`)"
    )
    one_row = next(r for r in linear["rows"] if r["rows"] == 1)
    fastest = max((k for k in one_row if k != "rows"), key=lambda k: one_row[k]["weight_GB_per_s"])
    linear_run = f"{linear_source}, {linear['env']['date']}, load {_load(linear.get('load_average'))}"
    bench_run = f"{bench.source}, {bench.when}, load {_load(bench.load_average)}"
    return [
        Rate(
            "profile's read",
            profile.read_bandwidth,
            read_how,
            f"machine profile, {profile.when}, load {_load(profile.load_average)}",
            profile.threads,
            f"the profile's floor, {profile.floor_s * 1e3:.1f} ms (its step {profile.over_floor:.2f}× it); "
            "the floor the chapters quote",
        ),
        Rate(
            "benchmark's read",
            bench.read_bandwidth,
            read_how + ", at the end of the run",
            bench_run,
            bench.threads,
            f"the benchmark's batch-1 floor, {bench.floor_s * 1e3:.1f} ms (its step {bench.over_floor:.2f}× it)",
        ),
        Rate(
            "benchmark's copy",
            cpu["machine"]["bandwidth"],
            f"a copy of {roofline.CPU_COPY_BYTES >> 20} MiB, read and write both counted, fastest of "
            f"{roofline.BANDWIDTH_REPEATS} (`roofline.measure_copy_bandwidth`)",
            bench_run,
            bench.threads,
            f"the CPU batching curve's roofline estimate (the weights alone: {cpu['decode_floor_s'] * 1e3:.1f} ms)",
        ),
        Rate(
            "product table's read",
            linear["sum_read_GB_per_s"] * 1e9,
            f"`sum()` over {LINEAR_SUM_BYTES >> 20} MiB of `torch.randn` (ordinary pages), the mean of "
            f"{LINEAR_SUM_REPEATS} (`benchmarks/cpu_linear.py`)",
            linear_run,
            linear.get("threads"),
            "scale only: the dotted line of the product-path figure",
        ),
        Rate(
            "weights through one product row",
            one_row[fastest]["weight_GB_per_s"] * 1e9,
            f"SmolLM2's layer matrices ({linear['weight_bytes'] / 1e6:.0f} MB) times one row by the fastest path "
            f"({fastest}), weight bytes ÷ time",
            linear_run,
            linear.get("threads"),
            "the product-path table",
        ),
        Rate(
            "weights through the benchmark's step",
            bench.weights_read_rate,
            f"the step's weight bytes ({bench.weight_bytes / 1e6:.0f} MB) ÷ the whole step "
            f"({bench.step_s * 1e3:.1f} ms)",
            bench_run,
            bench.threads,
            "nothing: derived, for comparison",
        ),
        Rate(
            "weights through the profile's step",
            profile.weights_read_rate,
            f"the same bytes ÷ the profile's step ({profile.step_s * 1e3:.1f} ms)",
            f"machine profile, {profile.when}",
            profile.threads,
            "nothing: derived, for comparison",
        ),
    ]


def rates_table(rates: list[Rate]) -> str:
    """The rates as a Markdown table, one row each, in the order given."""
    lines = ["| | GB/s | what moved | run | threads | used for |", "|---|---:|---|---|---:|---|"]
    for r in rates:
        threads = "?" if r.threads is None else str(r.threads)
        lines.append(f"| {r.name} | {r.bytes_per_s / 1e9:.1f} | {r.measures} | {r.run} | {threads} | {r.used_for} |")
    return "\n".join(lines)

"""The roofline: why decode is a memory problem and prefill an arithmetic one (notebook 05 and later).

A step must read its bytes (the weights, the KV cache it attends to) and do its operations.
The machine reads at ``bandwidth`` bytes/s and computes at ``flops`` operations/s, and the two
overlap, so a step takes about

    max(bytes / bandwidth, operations / flops) + overhead

(``predict_step_time``). Operations per byte is the step's *arithmetic intensity*; the
machine's *break-even* is ``flops / bandwidth``. A batch-1 decode step does about two
operations per weight (a couple per byte in bf16) — far below any machine's break-even, so
its time is the weights divided by the bandwidth: the *decode floor*. A prefill of hundreds
of tokens reuses every weight hundreds of times and lands on the other side.

Any config, dtype and device: the scheduler's simulator, the engine's benchmarks and the
serving notebook all reuse this module.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch

from ..engine.memory import dtype_bytes, kv_bytes_per_token, weight_bytes
from ..model.config import ModelConfig
from .flops import forward_flops


@dataclass(frozen=True)
class Machine:
    """What bounds a step: bytes/s it reads, operations/s it computes, seconds a step costs regardless."""

    name: str
    bandwidth: float  # bytes per second
    flops: float  # operations per second
    overhead_s: float = 0.0

    @property
    def break_even(self) -> float:
        """Operations per byte where reading and computing take equally long."""
        return self.flops / self.bandwidth

    def describe(self) -> str:
        return (
            f"{self.name}: {self.bandwidth / 1e9:.1f} GB/s, {self.flops / 1e12:.3f} TFLOP/s, "
            f"break-even {self.break_even:.0f} FLOP/byte, overhead {self.overhead_s * 1e3:.2f} ms"
        )


# What the CPU bandwidth measurements move (the measurements appendix prints these beside the rates they give).
CPU_COPY_BYTES = 64 * 2**20  # a copy: past the caches, quick
CPU_READ_BYTES = 512 * 2**20  # a read: far past any cache, in the 2 MiB pages the engine's weights live in
BANDWIDTH_REPEATS = 5  # best of


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_time(fn, device, repeats: int) -> float:
    fn()  # warm up (allocation, kernel selection)
    _sync(device)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def measure_copy_bandwidth(device="cpu", nbytes: int | None = None, repeats: int = BANDWIDTH_REPEATS) -> float:
    """Bytes/s of a large tensor copy, counting the read and the write (best of ``repeats``).

    Default size: 64 MiB on the CPU (well past the caches, quick), 1 GiB on a GPU.
    """
    device = torch.device(device)
    nbytes = nbytes or (2**30 if device.type == "cuda" else CPU_COPY_BYTES)
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    seconds = _best_time(lambda: dst.copy_(src), device, repeats)
    return 2 * src.numel() * 4 / seconds


def measure_read_bandwidth(device="cpu", nbytes: int | None = None, repeats: int = BANDWIDTH_REPEATS) -> float:
    """Bytes/s the current threads *read* (a ``sum()`` over a large tensor: no write), best of ``repeats``.

    This is the ceiling for a decode step, which mostly reads weights. Default size: 512 MiB on
    the CPU (far past any cache), 1 GiB on a GPU.
    """
    device = torch.device(device)
    nbytes = nbytes or (2**30 if device.type == "cuda" else CPU_READ_BYTES)
    if device.type == "cpu":  # the pages the engine keeps its weights in (cpu/huge_pages.py)
        from ..cpu.huge_pages import huge_page_buffer

        data = huge_page_buffer(nbytes // 4 * 4).view(torch.float32).fill_(1.0)
    else:
        data = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    return data.numel() * 4 / _best_time(data.sum, device, repeats)


def measure_matmul_rate(device="cpu", dtype=None, size: int | None = None, repeats: int = 3) -> float:
    """Operations/s of a square matrix product ``size × size`` (``2·size³`` operations), best of ``repeats``."""
    device = torch.device(device)
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    size = size or (8192 if device.type == "cuda" else 512)
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    seconds = _best_time(lambda: a @ b, device, repeats)
    return 2 * size**3 / seconds


def measure_machine(device="cpu", dtype=None, name: str | None = None) -> Machine:
    """Copy bandwidth and matmul rate of ``device`` (a second or two on the CPU); overhead 0 until fitted."""
    device = torch.device(device)
    if name is None:
        if device.type == "cuda":
            name = torch.cuda.get_device_name(device)
        else:
            from ..env import cpu_label

            threads = torch.get_num_threads()
            name = f"{cpu_label()}, {threads} thread{'s' if threads != 1 else ''}"
    return Machine(name=name, bandwidth=measure_copy_bandwidth(device), flops=measure_matmul_rate(device, dtype))


# ----------------------------------------------------------------------------- one step


def decode_weight_bytes(config: ModelConfig, dtype) -> int:
    """Weight bytes a step reads: all of them except the embedding table, of which it reads one row.

    With tied embeddings the LM head reads the whole table anyway, so it stays in.
    """
    table = 0 if config.tie_word_embeddings else config.vocab_size * config.hidden_size * dtype_bytes(dtype)
    return weight_bytes(config, dtype) - table


def step_bytes_and_flops(
    config: ModelConfig, dtype, num_tokens: int, context_tokens: int, num_seqs: int = 1
) -> tuple[int, int]:
    """Bytes read/written and operations of one step over ``num_tokens`` new rows.

    ``context_tokens``: tokens already in the cache before the step, summed over ``num_seqs``
    sequences. Bytes = weights (``decode_weight_bytes``) + embedding rows + the cache read +
    the new keys/values written. Activations are left out (they stay small next to the weights).
    """
    per_token = kv_bytes_per_token(config, dtype)
    nbytes = (
        decode_weight_bytes(config, dtype)
        + num_tokens * config.hidden_size * dtype_bytes(dtype)
        + context_tokens * per_token
        + num_tokens * per_token
    )
    return nbytes, forward_flops(config, num_tokens, context_tokens, num_seqs).total


def arithmetic_intensity(
    config: ModelConfig, dtype, num_tokens: int, context_tokens: int = 0, num_seqs: int = 1
) -> float:
    """Operations per byte of one step."""
    nbytes, flops = step_bytes_and_flops(config, dtype, num_tokens, context_tokens, num_seqs)
    return flops / nbytes


def predict_step_time(
    machine: Machine, config: ModelConfig, dtype, num_tokens: int, context_tokens: int, num_seqs: int = 1
) -> float:
    """Seconds of one step: ``max(bytes / bandwidth, operations / flops) + overhead``."""
    nbytes, flops = step_bytes_and_flops(config, dtype, num_tokens, context_tokens, num_seqs)
    return max(nbytes / machine.bandwidth, flops / machine.flops) + machine.overhead_s


def decode_floor(config: ModelConfig, dtype, machine: Machine) -> float:
    """The fastest a batch-1 decode step can be: its weight bytes divided by the bandwidth."""
    return decode_weight_bytes(config, dtype) / machine.bandwidth


def break_even(machine: Machine) -> float:
    """Operations per byte above which arithmetic, not memory, sets the pace."""
    return machine.break_even


def fit_overhead(
    machine: Machine,
    config: ModelConfig,
    dtype,
    measured_step_s: float,
    num_tokens: int = 1,
    context_tokens: int = 0,
    num_seqs: int = 1,
) -> Machine:
    """The machine with ``overhead_s`` set so the prediction matches one measured step (never below 0)."""
    bare = replace(machine, overhead_s=0.0)
    predicted = predict_step_time(bare, config, dtype, num_tokens, context_tokens, num_seqs)
    return replace(machine, overhead_s=max(0.0, measured_step_s - predicted))


# ----------------------------------------------------------------------------- the picture


def plot_roofline(
    machine: Machine,
    points: dict[str, float] | None = None,
    ax=None,
    measured: dict[str, tuple[float, float]] | None = None,
):
    """Attainable operations/s against arithmetic intensity, with named steps marked on the roof.

    ``points`` maps a label to an intensity (FLOP/byte), e.g. from ``arithmetic_intensity``;
    ``measured`` maps a label to ``(intensity, achieved operations/s)``, drawn as crosses under the roof.
    """
    import matplotlib.pyplot as plt
    import numpy as np

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 4.2))
    points = points or {}
    low = min([0.1, *points.values()]) / 2
    high = max([machine.break_even * 20, *points.values()]) * 2
    x = np.logspace(np.log10(low), np.log10(high), 200)
    ax.loglog(
        x, np.minimum(x * machine.bandwidth, machine.flops), color="black", label="roof: min(I × bandwidth, peak)"
    )
    ax.axvline(machine.break_even, color="grey", linestyle=":", label=f"break-even {machine.break_even:.0f} FLOP/byte")
    for (label, intensity), color in zip(points.items(), plt.rcParams["axes.prop_cycle"].by_key()["color"]):
        rate = min(intensity * machine.bandwidth, machine.flops)
        ax.plot([intensity], [rate], "o", color=color, markersize=8, label=f"{label}: {intensity:.1f} FLOP/byte")
    for (label, (intensity, rate)), marker in zip((measured or {}).items(), "xP*Ds"):  # one marker each
        ax.plot(
            [intensity],
            [rate],
            marker,
            color="black",
            markersize=9,
            mew=2 if marker == "x" else 1,
            fillstyle="none" if marker != "x" else "full",
            label=f"{label}: {rate / 1e9:.2g} GFLOP/s",
        )
    ax.set_xlabel("arithmetic intensity (operations per byte read)")
    ax.set_ylabel("attainable operations per second")
    ax.set_title(f"Roofline of {machine.name}")
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(True, which="both", alpha=0.3)
    return ax

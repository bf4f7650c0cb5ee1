"""The arithmetic of Carlos Chinchilla Corbacho's article "Serving is a memory problem: prefill,
decode and the KV cache", redone from its own inputs.

The article measured Qwen3.5-9B in 4-bit through llama-server on an Apple M5 Pro and drew its
conclusions by division. Each function here takes the article's measured inputs and derives one of
its figures, so a notebook can print the derivation beside the article's number and say whether they
agree. ``checks()`` lists them all. Nothing here is our measurement: our own machine's numbers
come from ``roofline`` and the benchmarks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# The article's measured inputs, as it states them.
WEIGHT_BYTES = 5.38e9  # bytes one decode step reads (4-bit weights, embedding table left out)
READ_BANDWIDTH = 273e9  # bytes/s, the laptop's measured read bandwidth
DECODE_STEP_S = 23.5e-3  # llama.cpp's timed decode step, one sequence
PREFILL_TOK_S = 1143.0  # prefill of a 1,024-token prompt
DECODE_TOK_S = 42.6
PREFILL_OPS_S = 18e12  # "about 18 trillion operations a second" during that prefill
BATCH = 32
BATCH_STEP_S = 195e-3  # the measured step at 32 sequences
PROMISED_TOK_S = 864.0  # what the arithmetic promised at 32 sequences
DELIVERED_TOK_S = 164.0
CLOSED_LOOP_TOK_S = 87.2
CLOSED_LOOP_REQ_S = 0.68
TPOT_CLOSED_S, TPOT_LOADED_S = 76e-3, 89e-3
HYBRID_LAYERS, HYBRID_KV_LAYERS = 32, 8
KV_BYTES_PER_TOKEN = 32 * 1024  # the hybrid's whole cache per token (its 8 attention layers)
STATE_BYTES = 48 * 2**20  # the f32 recurrent state's main part, per sequence
P99_SAMPLES = 60
# Its GPU examples: Llama-3.1-8B (bf16) on an H100 SXM.
LLAMA8B_WEIGHT_BYTES, H100_BANDWIDTH = 15e9, 3.35e12  # bytes a decode step reads (no embedding table)
LLAMA8B_ALL_WEIGHTS = 16e9  # all of its weights, as held in memory
LLAMA8B_KV = dict(layers=32, kv_heads=8, head_dim=128, dtype_bytes=2)
H100_REPORTED_BYTES, GPU_MEMORY_UTILIZATION, CONTEXT = 85.5e9, 0.92, 4096


@dataclass(frozen=True)
class Check:
    """One of the article's figures: how it follows from the inputs, what we get, what the article says."""

    claim: str
    derivation: str
    derived: float
    stated: float  # the figure as the article states it
    tolerance: float  # relative: the article rounds its figures

    @property
    def agrees(self) -> bool:
        return abs(self.derived - self.stated) <= self.tolerance * abs(self.stated)

    def line(self) -> str:
        mark = "agrees" if self.agrees else "DIFFERS"
        return f"{self.claim}: {self.derivation} = {_number(self.derived)} (article: {_number(self.stated)}) {mark}"


def _number(value: float) -> str:
    """Three significant figures, without an exponent for the article's four-digit counts."""
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:,.3g}"


def decode_floor_s() -> float:
    """Weight bytes over read bandwidth: no decode step can be faster."""
    return WEIGHT_BYTES / READ_BANDWIDTH


def operations_per_token() -> float:
    """Prefill's operations per token, ``18e12 / 1,143`` ≈ 2 × the non-embedding parameters."""
    return PREFILL_OPS_S / PREFILL_TOK_S


def llama8b_kv_per_token() -> int:
    """K and V, times layers, KV heads, head size and bytes."""
    kv = LLAMA8B_KV
    return 2 * kv["layers"] * kv["kv_heads"] * kv["head_dim"] * kv["dtype_bytes"]


def cache_left_bytes() -> float:
    """The memory vLLM claims on an H100 (92% of 85.5 GB) less Llama-3.1-8B's 16 GB of weights."""
    return H100_REPORTED_BYTES * GPU_MEMORY_UTILIZATION - LLAMA8B_ALL_WEIGHTS


def h100_requests() -> int:
    """Whole 4,096-token requests an H100 holds: the claimed memory less the weights, over one request's cache."""
    return math.floor(cache_left_bytes() / (llama8b_kv_per_token() * CONTEXT))


def p99_position(samples: int = P99_SAMPLES) -> tuple[int, int, float]:
    """Where numpy's default (linear) p99 of ``samples`` values falls: between the sorted
    values ``(i, i + 1)``, a fraction of the way.

    ``np.percentile`` interpolates at index ``0.99 × (n − 1)`` of the sorted values (0-based).
    """
    index = 0.99 * (samples - 1)
    low = int(np.floor(index))
    return low, low + 1, index - low


def checks() -> list[Check]:
    """Every figure of the article that follows from its inputs by arithmetic."""
    floor = decode_floor_s()
    ops_per_byte_decode = operations_per_token() / WEIGHT_BYTES
    low, high, frac = p99_position()
    return [
        Check("decode floor (ms)", "5.38 GB / 273 GB/s", floor * 1e3, 19.7, 0.005),
        Check(
            "share of the measured step spent reading weights", "19.7 ms / 23.5 ms", floor / DECODE_STEP_S, 0.84, 0.01
        ),
        Check("prefill over decode, per token", "1,143 / 42.6 tok/s", PREFILL_TOK_S / DECODE_TOK_S, 27, 0.02),
        Check(
            "operations per byte, one decode sequence", "(18e12 / 1,143) ops / 5.38 GB", ops_per_byte_decode, 3, 0.05
        ),
        Check(
            "break-even intensity (ops per byte)", "18e12 ops/s / 273 GB/s", PREFILL_OPS_S / READ_BANDWIDTH, 66, 0.01
        ),
        Check("one sequence's step (ms), as llama-server timed it", "1 / 42.6 tok/s", 1e3 / DECODE_TOK_S, 24, 0.03),
        Check("promised step at 32 sequences (ms)", "32 / 864 tok/s", BATCH / PROMISED_TOK_S * 1e3, 37, 0.01),
        Check("delivered step at 32 sequences (ms)", "32 / 164 tok/s", BATCH / DELIVERED_TOK_S * 1e3, 195, 0.01),
        Check("delivered over promised", "164 / 864", DELIVERED_TOK_S / PROMISED_TOK_S, 0.19, 0.02),
        Check(
            "ms per extra sequence",
            "(195 − 23.5) ms / 31",
            (BATCH_STEP_S - DECODE_STEP_S) / (BATCH - 1) * 1e3,
            5.5,
            0.02,
        ),
        Check(
            "output tokens per request, closed loop",
            "87.2 tok/s / 0.68 req/s",
            CLOSED_LOOP_TOK_S / CLOSED_LOOP_REQ_S,
            128,
            0.01,
        ),
        Check("TPOT rise under random arrivals (ms)", "89 − 76", (TPOT_LOADED_S - TPOT_CLOSED_S) * 1e3, 13, 0.001),
        Check(
            "KV bytes per token per attention layer (KiB)",
            "32 KiB / 8 layers",
            KV_BYTES_PER_TOKEN / HYBRID_KV_LAYERS / 1024,
            4,
            0.001,
        ),
        Check(
            "tokens of cache the recurrent state equals",
            "48 MiB / 32 KiB",
            STATE_BYTES / KV_BYTES_PER_TOKEN,
            1536,
            0.001,
        ),
        Check(
            "Llama-3.1-8B bf16 decode floor on an H100 (ms)",
            "15 GB / 3.35 TB/s",
            LLAMA8B_WEIGHT_BYTES / H100_BANDWIDTH * 1e3,
            4.5,
            0.01,
        ),
        Check(
            "Llama-3.1-8B KV bytes per token (KiB)", "2 × 32 × 8 × 128 × 2", llama8b_kv_per_token() / 1024, 128, 0.001
        ),
        Check("GB left for cache on an H100", "85.5 GB × 0.92 − 16 GB", cache_left_bytes() / 1e9, 62, 0.02),
        Check("requests of 4,096 tokens in an H100's cache", "62.7 GB / (128 KiB × 4,096)", h100_requests(), 116, 0.01),
        # The article says the p99 of 60 samples is "the second slowest" (sorted index 58); numpy's default
        # interpolation puts it between that one and the slowest, which this check shows.
        Check(
            "p99 of 60 samples: sorted index (0-based; the article's figure: the second slowest)",
            f"0.99 × 59, between {low} and {high}",
            low + frac,
            58,
            0.001,
        ),
    ]


def select(*phrases: str) -> list[Check]:
    """The checks whose claim contains one of ``phrases``, in ``checks()`` order (each notebook shows its own)."""
    chosen = [c for c in checks() if any(p in c.claim for p in phrases)]
    if not chosen:
        raise KeyError(f"no check of the article's arithmetic matches {phrases}")
    return chosen


def report(*phrases: str) -> str:
    """The chosen checks, one line each: the claim, its derivation from the article's inputs, the article's figure."""
    return "\n".join(c.line() for c in select(*phrases))

"""Quantization moves the decode floor: the embedded model's bytes as stored, against fp32 and bf16 (chapter 06).

A batch-1 decode step reads every weight once, so its floor is weight bytes over read bandwidth.
The embedded SmolLM2 ships as a Q4_1 GGUF: its projection and MLP matrices hold 4-bit numbers
with a scale and a minimum per block of 32 (5 bits a weight), its embedding table (also the LM
head, tied) Q8_0, its norms fp32. ``gguf_bytes`` reads what each tensor occupies from the file
itself (``to_gguf_bytes`` writes our blocks back as the file's records, to check them byte by
byte); ``decode_floors`` turns each storage format's bytes into the floor on a machine. The
engine dequantizes the file and runs fp32 (or bf16): it reads the dequantized bytes, so the
Q4_1 floor is what a kernel that reads the packed weights could reach, not what ours does.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from ..model.block_formats import BlockWeight


@dataclass(frozen=True)
class StoredWeights:
    """What a GGUF file's tensors occupy, by storage type."""

    bytes_by_type: dict[str, int]
    elements_by_type: dict[str, int]

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_by_type.values())

    @property
    def num_weights(self) -> int:
        return sum(self.elements_by_type.values())

    def bits_per_weight(self, kind: str) -> float:
        return 8 * self.bytes_by_type[kind] / self.elements_by_type[kind]


def gguf_bytes(path: Path | str | None = None) -> StoredWeights:
    """Bytes and element counts of every tensor in a GGUF, summed per storage type (default: the embedded model)."""
    if path is None:
        from ..model.loader import smollm2_gguf_path

        path = smollm2_gguf_path()
    from ..model.gguf_weights import GGUFTensors

    nbytes, elements = Counter(), Counter()
    for tensor in GGUFTensors(path).tensors.values():  # read once per process and file version
        nbytes[tensor.tensor_type.name] += int(tensor.n_bytes)
        elements[tensor.tensor_type.name] += int(tensor.n_elements)
    return StoredWeights(dict(nbytes), dict(elements))


def to_gguf_bytes(blocks: BlockWeight) -> torch.Tensor:
    """The inverse of ``model/block_formats.py: from_gguf_bytes``: interleaved records, as a GGUF file stores them."""
    rows, n = blocks.out_features, blocks.blocks_per_row
    parts = [blocks.scales.reshape(rows, n, 1).view(torch.uint8)]
    if blocks.mins is not None:
        parts.append(blocks.mins.reshape(rows, n, 1).view(torch.uint8))
    parts.append(blocks.quants.reshape(rows, n, -1).view(torch.uint8))
    return torch.cat(parts, dim=-1).reshape(rows, -1)


@dataclass(frozen=True)
class Floor:
    """One storage format: the bytes a decode step reads and the fastest step they allow."""

    label: str
    weight_bytes: int
    floor_s: float


def decode_floors(stored: StoredWeights, read_bandwidth: float) -> list[Floor]:
    """The decode floor for the file's own bytes, for bf16 and for fp32 (2 and 4 bytes a weight).

    All weights are counted: the tied embedding table is read whole by the LM head every step.
    """
    n = stored.num_weights
    rows = [("as stored (Q4_1 + Q8_0 table + fp32 norms)", stored.total_bytes), ("bf16", 2 * n), ("fp32", 4 * n)]
    return [Floor(label, nbytes, nbytes / read_bandwidth) for label, nbytes in rows]


# ----------------------------------------------------------------------------- the engine on each format (05b)

FORMATS = {  # label: how load_model makes it
    "fp32": dict(dtype="float32"),
    "bf16": dict(dtype="bfloat16"),
    "Q8_0 (at load)": dict(quantization="q8_0"),
    "Q4_1 (at load)": dict(quantization="q4_1"),
    "GGUF as stored": dict(quantization="gguf"),
}


@dataclass(frozen=True)
class FormatStep:
    """One way of holding the embedded model: the bytes a step reads, their floor, the measured step, perplexity."""

    label: str
    weight_bytes: int
    floor_s: float
    step_s: float
    path: str  # how the step ran: the C step, or torch's layers for bf16
    perplexity: float

    @property
    def bits_per_weight(self) -> float:
        from .story_model import SMOLLM2_135M

        return 8 * self.weight_bytes / SMOLLM2_135M.num_parameters()


def measure_formats(labels: list[str], read_bandwidth: float, rounds: int = 3) -> list[FormatStep]:
    """Load the embedded model each ``label`` way (``FORMATS``), time its batch-1 decode step, score its perplexity.

    The formats take turns, ``rounds`` times, and each keeps its fastest median: a moment of load on a shared
    machine then slows one round of every format rather than all rounds of one. fp32 and blocks run the C
    step (``cpu/c_step.py``), which computes in fp32; bf16 runs torch's layers, whose bf16 products use
    the CPU's own bf16 instructions where it has them.
    """
    from ..model.loader import load_model
    from ..model.quantized_linear import weight_bytes
    from .perplexity import perplexity

    loaded = {label: load_model("smollm2-135m", **FORMATS[label]) for label in labels}
    times = {label: [] for label in labels}
    for _ in range(rounds):
        for label in labels:
            times[label].append(_step_seconds(label, loaded[label][0]))
    steps = []
    for label, (model, tokenizer) in loaded.items():
        nbytes, path = weight_bytes(model), "torch layers" if label == "bf16" else "C step"
        steps.append(
            FormatStep(label, nbytes, nbytes / read_bandwidth, min(times[label]), path, perplexity(model, tokenizer))
        )
    return steps


def _step_seconds(label: str, model) -> float:
    """One timing of a batch-1 step: torch's layers for bf16, else the C step (fp32 in its faster layout)."""
    from ..cpu.block_calibration import fastest_float_step, step_seconds
    from ..cpu.c_step import PACKED, TORCH

    if label == "bf16":
        return step_seconds(model, TORCH)
    if model.quantization is None:
        return fastest_float_step(model)[0]
    return step_seconds(model, PACKED)


# ------------------------------------------------------- each block format timed the way the machine profile times fp32

BLOCK_FORMATS = {"Q8_0 (at load)": "q8_0", "Q4_1 (at load)": "q4_1", "GGUF as stored": "gguf"}  # label: quantization


def steps_beside_profile(profile, labels=tuple(BLOCK_FORMATS)) -> list[FormatStep]:
    """fp32's row from the machine profile, then each block format's batch-1 step timed the profile's way (chapter 06).

    The profile's step is the engine's fp32 step (``quantization=None``): the fastest decode step of one request
    with ``PROFILE_CONTEXT`` tokens of context (``machine_profile.measure_decode_step``). Each block format gets a
    fresh engine with its ``quantization`` and the same timing, at the thread count the caller set. Every row's
    bytes and perplexity come from the model that row's engine (or, for fp32, ``load_model``) holds.
    """
    import torch

    from ..cpu.big_step_weights import drop_copies
    from ..engine.llm_engine import LLMEngine
    from ..model.loader import load_model
    from ..model.quantized_linear import weight_bytes
    from .machine_profile import PROFILE_CONTEXT, PROFILE_DECODE_STEPS
    from .perplexity import perplexity
    from .serving_study import time_decode_steps

    model, tokenizer = load_model("smollm2-135m", dtype="float32")
    nbytes = weight_bytes(model)
    bandwidth = profile.read_bandwidth
    rows = [
        FormatStep(
            "fp32", nbytes, nbytes / bandwidth, profile.decode_step_s, "machine profile", perplexity(model, tokenizer)
        )
    ]
    for label in labels:
        engine = LLMEngine(
            "smollm2-135m",
            dtype=torch.float32,
            quantization=BLOCK_FORMATS[label],
            device="cpu",
            num_kv_blocks=64,
            max_num_seqs=1,
            log_stats=False,
        )
        time_decode_steps(engine, 1, prompt_len=16, decode_steps=2)  # warm-up, as the profile does
        step_s = time_decode_steps(engine, 1, prompt_len=PROFILE_CONTEXT, decode_steps=PROFILE_DECODE_STEPS).step_s
        nbytes = weight_bytes(engine.model)
        drop_copies(engine.model)  # the blocks' own perplexity, not that of big steps' bf16 copy (chapter 06)
        rows.append(
            FormatStep(label, nbytes, nbytes / bandwidth, step_s, "engine", perplexity(engine.model, engine.tokenizer))
        )
    return rows

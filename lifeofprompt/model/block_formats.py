"""GGUF's 8-bit and 4-bit weight blocks (Q8_0, Q4_1): what a block holds, how to make one, how to read one.

A decode step reads every weight once, so the bytes a weight takes set the step's floor. GGUF
stores a matrix in blocks of 32 consecutive weights of one row, each block with its own scale:

* **Q8_0**, 34 bytes per 32 weights (8.5 bits): a float16 scale ``d`` and 32 signed bytes ``q``;
  the weight is ``d * q``. ``d = max|x| / 127``, so the largest weight of the block is exact.
* **Q4_1**, 20 bytes per 32 weights (5 bits): a float16 scale ``d``, a float16 minimum ``m`` and
  32 four-bit numbers ``q`` in 16 bytes; the weight is ``d * q + m``, with ``m`` the block's
  smallest weight and ``d = (max - min) / 15``. Byte ``j`` holds weight ``j`` in its low four bits
  and weight ``j + 16`` in its high four.

(The layouts are ggml's ``block_q8_0`` and ``block_q4_1`` in ``ggml-common.h``; gguf-py's
``quants.py`` computes the same numbers, and the tests check ours against it element by element.)

We keep a matrix's blocks as separate planes, not as interleaved 34- or 20-byte records: the
quants of all blocks of a row side by side (``quants [out, in]`` int8 for Q8_0, ``[out, in / 2]``
uint8 for Q4_1), the scales ``[out, in / 32]`` and, for Q4_1, the minimums beside them. The
numbers and the byte count are the file's; planes let a kernel load a row's quants as one vector
stream and its scales as another, on a CPU and a GPU alike. A row whose length is not a multiple
of 32 gets a last block padded with zeros (``in_features`` keeps the true length).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 32  # weights per block in both formats
FORMATS = ("q8_0", "q4_1")
BYTES_PER_BLOCK = {"q8_0": 2 + 32, "q4_1": 2 + 2 + 16}


@dataclass
class BlockWeight:
    """One matrix ``[out_features, in_features]`` kept as its blocks (see the module docstring)."""

    format: str  # "q8_0" or "q4_1"
    quants: torch.Tensor  # q8_0: int8 [out, padded_in]; q4_1: uint8 [out, padded_in / 2]
    scales: torch.Tensor  # float16 [out, blocks]
    mins: torch.Tensor | None  # q4_1: float16 [out, blocks]; q8_0: None
    in_features: int

    @property
    def out_features(self) -> int:
        return self.quants.shape[0]

    @property
    def blocks_per_row(self) -> int:
        return self.scales.shape[1]

    @property
    def device(self) -> torch.device:
        return self.quants.device

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.quants, self.scales, self.mins) if t is not None]

    @property
    def nbytes(self) -> int:
        """The bytes a step reads for this matrix: the file's own size for these blocks."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def to(self, device) -> BlockWeight:
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return BlockWeight(self.format, move(self.quants), move(self.scales), move(self.mins), self.in_features)

    def rows(self, first: int, last: int) -> BlockWeight:
        """Output rows ``first .. last - 1`` (whole rows of blocks: exact)."""
        pick = lambda t: None if t is None else t[first:last].contiguous()  # noqa: E731
        return BlockWeight(self.format, pick(self.quants), pick(self.scales), pick(self.mins), self.in_features)

    def permute_rows(self, order: torch.Tensor) -> BlockWeight:
        """The same blocks with the output rows reordered (``order[i]`` is the old row of new row ``i``)."""
        pick = lambda t: None if t is None else t[order].contiguous()  # noqa: E731
        return BlockWeight(self.format, pick(self.quants), pick(self.scales), pick(self.mins), self.in_features)

    def dequantize(self, dtype=torch.float32, first: int = 0, last: int | None = None) -> torch.Tensor:
        """The weights ``[rows, in_features]`` as floats (rows ``first .. last - 1``; all by default)."""
        return dequantize(self.rows(first, self.out_features if last is None else last), dtype)


def weight_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """Every tensor of weights a step reads: the float parameters, and the planes of each module that keeps a
    matrix as blocks (its ``blocks``: ``quantized_linear.QuantizedLinear``)."""
    planes = [
        t for m in model.modules() if isinstance(getattr(m, "blocks", None), BlockWeight) for t in m.blocks.tensors()
    ]
    return [*model.parameters(), *planes]


def concatenate(parts: list[BlockWeight]) -> BlockWeight:
    """Stack matrices of one format and width row-wise (q/k/v into qkv, gate/up into gate_up): exact."""
    first = parts[0]
    if any(p.format != first.format or p.in_features != first.in_features for p in parts):
        raise ValueError("only matrices of one block format and one width can be stacked")
    cat = lambda ts: None if ts[0] is None else torch.cat(ts)  # noqa: E731
    return BlockWeight(
        first.format,
        cat([p.quants for p in parts]),
        cat([p.scales for p in parts]),
        cat([p.mins for p in parts]),
        first.in_features,
    )


# ----------------------------------------------------------------------------- making blocks


def _padded_blocks(weight: torch.Tensor) -> torch.Tensor:
    """``weight [out, in]`` as fp32 ``[out, blocks, 32]``, the last block padded with zeros."""
    rows, cols = weight.shape
    padded = -(-cols // BLOCK) * BLOCK
    x = weight.detach().to(torch.float32)
    if padded != cols:
        x = torch.nn.functional.pad(x, (0, padded - cols))
    return x.reshape(rows, padded // BLOCK, BLOCK)


def _round_half_away(x: torch.Tensor) -> torch.Tensor:
    """C's ``roundf`` (halves away from zero), which ggml uses; ``torch.round`` rounds halves to even."""
    return torch.sign(x) * torch.floor(x.abs() + 0.5)


def quantize(weight: torch.Tensor, fmt: str) -> BlockWeight:
    """A float matrix ``[out, in]`` as blocks of ``fmt``, computed as ggml's reference quantizers do."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown block format {fmt!r}: use one of {', '.join(FORMATS)}")
    x = _padded_blocks(weight)
    rows, blocks, _ = x.shape
    if fmt == "q8_0":
        d = x.abs().amax(dim=-1, keepdim=True) / 127
        inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
        q = _round_half_away(x * inv).to(torch.int8)
        return BlockWeight(fmt, q.reshape(rows, -1), d.squeeze(-1).half(), None, weight.shape[1])
    low, high = x.amin(dim=-1, keepdim=True), x.amax(dim=-1, keepdim=True)
    d = (high - low) / 15
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = torch.trunc((x - low) * inv + 0.5).clamp(0, 15).to(torch.uint8)
    packed = q[..., :16] | (q[..., 16:] << 4)
    return BlockWeight(fmt, packed.reshape(rows, -1), d.squeeze(-1).half(), low.squeeze(-1).half(), weight.shape[1])


def dequantize(blocks: BlockWeight, dtype=torch.float32) -> torch.Tensor:
    """The weights ``[out, in_features]``: ``d * q`` (Q8_0) or ``d * q + m`` (Q4_1), in fp32, then ``dtype``."""
    rows, n = blocks.out_features, blocks.blocks_per_row
    d = blocks.scales.float().unsqueeze(-1)
    if blocks.format == "q8_0":
        x = blocks.quants.reshape(rows, n, BLOCK).float() * d
    else:
        packed = blocks.quants.reshape(rows, n, BLOCK // 2)
        q = torch.cat([packed & 0x0F, packed >> 4], dim=-1).float()
        x = q * d + blocks.mins.float().unsqueeze(-1)
    return x.reshape(rows, n * BLOCK)[:, : blocks.in_features].to(dtype)


# ----------------------------------------------------------------------------- GGUF's own bytes


def from_gguf_bytes(raw: torch.Tensor, fmt: str, in_features: int) -> BlockWeight:
    """A GGUF tensor's bytes ``[out, blocks * bytes_per_block]`` (uint8, as stored) split into planes."""
    rows = raw.shape[0]
    records = raw.reshape(rows, -1, BYTES_PER_BLOCK[fmt])
    scales = records[..., 0:2].contiguous().view(torch.float16).reshape(rows, -1)
    if fmt == "q8_0":
        quants = records[..., 2:].contiguous().view(torch.int8).reshape(rows, -1)
        return BlockWeight(fmt, quants, scales, None, in_features)
    mins = records[..., 2:4].contiguous().view(torch.float16).reshape(rows, -1)
    return BlockWeight(fmt, records[..., 4:].contiguous().reshape(rows, -1), scales, mins, in_features)

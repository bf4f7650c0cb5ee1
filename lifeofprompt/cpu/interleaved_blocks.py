"""GGUF blocks re-laid for the CPU's integer dot products, and the product that reads them.

``block_kernels.py`` turns every weight into a float before it multiplies it. The CPU's integer
dot product (``vpdpbusd``: four unsigned bytes times four signed bytes, summed into a 32-bit
lane, sixteen lanes at once) does four weights of sixteen rows in one instruction, if both sides
are bytes and the sixteen rows' weights sit side by side. So, at start-up, each block matrix is re-laid
in groups of 16 rows (``interleave``), and at each product the activations are made bytes per
block of 32 (``quantize_activations``): two int8 digits, ``x ~ s/256 (256 hi + lo)``, accurate to
about 1/65,000 of the block's largest value (one digit, as llama.cpp uses, errs up to 1/254 of it).
``integer_kernels.h`` says how the kernel reads the layout; this module makes it, calls the kernel
and holds the reference the tests compare with.

The copy costs the blocks' bytes again (the planes stay: the embedding, the prefill path and a GPU
read them).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from ..model.block_formats import BLOCK, BlockWeight
from .block_kernels import PRODUCT_ARGS, SOURCE, run_product
from .native_build import c_function

GROUP = 16  # weight rows re-laid together (integer_kernels.h's GROUP)
FORMAT_CODES = {"q8_0": 4, "q4_1": 5}  # block_kernels.h's FORMAT_Q8_0_X16, FORMAT_Q4_1_X16


@dataclass
class InterleavedBlocks:
    """A block matrix in groups of 16 rows: per group and block, the 16 rows' weights as the kernel's vectors
    (``quants``: 512 bytes for Q8_0, 256 for Q4_1), then their scales and minimums as 16 fp16 in a row."""

    format: str
    quants: torch.Tensor  # uint8 [groups, blocks, 512 or 256]
    scales: torch.Tensor  # float16 [groups, blocks, 16]
    mins: torch.Tensor | None  # float16 [groups, blocks, 16] (Q4_1)
    in_features: int
    out_features: int

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.quants, self.scales, self.mins) if t is not None]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


def can_interleave(blocks: BlockWeight) -> bool:
    """Whether ``blocks`` can be re-laid: CPU tensors and whole groups of 16 rows."""
    return blocks.device.type == "cpu" and blocks.out_features % GROUP == 0


def block_integers(blocks: BlockWeight) -> torch.Tensor:
    """The blocks' weights as the integers the kernel multiplies, ``[out, blocks, 32]`` uint8 in the columns'
    order: Q4_1's ``q`` (0..15) and Q8_0's ``q + 128`` (so that both are unsigned bytes)."""
    rows, n = blocks.out_features, blocks.blocks_per_row
    if blocks.format == "q8_0":
        return (blocks.quants.reshape(rows, n, BLOCK).to(torch.int16) + 128).to(torch.uint8)
    packed = blocks.quants.reshape(rows, n, BLOCK // 2)
    return torch.cat([packed & 0x0F, packed >> 4], dim=-1)


@torch.no_grad()
def interleave(blocks: BlockWeight) -> InterleavedBlocks:
    """``blocks`` re-laid in groups of 16 rows (``integer_kernels.h``): vector ``V_k`` of group ``g`` and block
    ``b`` holds, in its lane ``i``, weights ``4k .. 4k+3`` of row ``16 g + i``. Q4_1 packs ``V_j`` (low nibbles)
    with ``V_{j+4}`` (high nibbles) into one vector."""
    if not can_interleave(blocks):
        raise ValueError(f"only CPU matrices of whole groups of {GROUP} rows can be re-laid ({blocks.out_features})")
    groups, n = blocks.out_features // GROUP, blocks.blocks_per_row
    q = block_integers(blocks).reshape(groups, GROUP, n, 8, 4)  # [g, row i, block, k, byte t]
    vectors = q.permute(0, 2, 3, 1, 4)  # [g, block, k, i, t]: V_k as lanes i of 4 bytes
    if blocks.format == "q4_1":
        vectors = vectors[:, :, :4] | (vectors[:, :, 4:] << 4)
    by_group = lambda t: None if t is None else t.reshape(groups, GROUP, n).transpose(1, 2).contiguous()  # noqa: E731
    return InterleavedBlocks(
        blocks.format,
        vectors.reshape(groups, n, -1).contiguous(),
        by_group(blocks.scales),
        by_group(blocks.mins),
        blocks.in_features,
        blocks.out_features,
    )


def block_layers(model) -> list:
    """The model's block matrices (``model/quantized_linear.QuantizedLinear``, known by its ``blocks`` and
    ``interleaved``): every layer's four and the LM head."""
    return [
        m for m in model.modules() if hasattr(m, "interleaved") and isinstance(getattr(m, "blocks", None), BlockWeight)
    ]


def can_interleave_model(model) -> bool:
    """Whether every block matrix can be re-laid and the C step's slices of them stay whole groups of 16 rows
    (its heads, and the up rows ``intermediate`` rows after the gate rows)."""
    c = model.config
    layers = block_layers(model)
    fits = c.head_dim % GROUP == 0 and c.intermediate_size % GROUP == 0
    return bool(layers) and fits and all(can_interleave(m.blocks) for m in layers)


def interleave_model(model) -> int:
    """Re-lay every block matrix for integer products (kept on each module as ``interleaved``: its products
    then take them); returns the copies' bytes. Raises ``ValueError`` where the shapes do not allow it."""
    if not can_interleave_model(model):
        raise ValueError("this model's block matrices cannot be re-laid in groups of 16 rows")
    for module in block_layers(model):
        if module.interleaved is None:
            module.interleaved = interleave(module.blocks)
    return interleaved_bytes(model)


def integer_on_offer(model) -> bool:
    """Whether ``block_activations="auto"`` may choose integer products for ``model`` here: a vector path
    for them in this CPU's build (plain C is correct but slow) and shapes that can be re-laid."""
    return integer_path() not in (None, "portable") and can_interleave_model(model)


def drop_interleaved(model) -> None:
    """Back to the float-activation kernel: the re-laid copies freed."""
    for module in block_layers(model):
        module.interleaved = None


def interleaved_bytes(model) -> int:
    return sum(m.interleaved.nbytes for m in block_layers(model) if m.interleaved is not None)


# ----------------------------------------------------------------------------- the compiled product


@functools.cache
def integer_kernel():
    """The compiled ``integer_blocks_times_weight``, or None where it cannot be built here."""
    return c_function(SOURCE, "integer_blocks_times_weight", PRODUCT_ARGS, ctypes.c_int)


@functools.cache
def integer_path() -> str | None:
    """The instructions this machine's build uses for integer products: ``"avx512-vnni"``, ``"avx-vnni"``,
    ``"avx2"`` or ``"portable"`` (plain C); None where the kernels cannot be built."""
    function = c_function(SOURCE, "integer_path", [], ctypes.c_char_p)
    return function().decode() if function is not None else None


def integer_linear(x: torch.Tensor, blocks: InterleavedBlocks) -> torch.Tensor:
    """``x @ W.T`` for fp32 ``x [M, in]`` on the CPU and re-laid blocks ``W``, with integer dot products: fp32
    ``[M, out]``. Runs on ``torch.get_num_threads()`` OpenMP threads; ctypes releases the GIL meanwhile."""
    kernel = integer_kernel()
    if kernel is None:
        raise RuntimeError(
            "the integer block kernel is not available on this machine (no C compiler, or its build failed)"
        )
    if x.dim() != 2 or x.shape[1] != blocks.in_features:
        raise ValueError(f"expected x [M, {blocks.in_features}], got {tuple(x.shape)}")
    planes = [blocks.quants, blocks.scales, blocks.mins]
    failure = "the integer block kernel could not allocate x's digits"
    return run_product(kernel, FORMAT_CODES[blocks.format], x, planes, blocks.out_features, failure)


def kernel_digits(x: torch.Tensor) -> Digits:
    """``x``'s digits as the compiled code makes them (``integer_quantize_rows``), to hold against
    ``quantize_activations``."""
    function = c_function(
        SOURCE, "integer_quantize_rows", [ctypes.c_void_p, ctypes.c_long, ctypes.c_long] + [ctypes.c_void_p] * 5
    )
    if function is None:
        raise RuntimeError("the integer block kernel is not available on this machine")
    x = x.to(torch.float32).contiguous()
    rows, blocks = x.shape[0], -(-x.shape[1] // BLOCK)
    hi, lo = (torch.empty(rows, blocks, BLOCK, dtype=torch.int8) for _ in range(2))
    scale, sums = torch.empty(rows, blocks), torch.empty(rows, blocks)
    offset = torch.empty(rows, blocks, dtype=torch.int32)
    function(
        x.data_ptr(),
        rows,
        x.shape[1],
        hi.data_ptr(),
        lo.data_ptr(),
        scale.data_ptr(),
        sums.data_ptr(),
        offset.data_ptr(),
    )
    return Digits(hi, lo, scale)


# ----------------------------------------------------------------------------- the reference


@dataclass
class Digits:
    """Activations as the kernel makes them: per block of 32, ``x ~ scale * (256 hi + lo)``."""

    hi: torch.Tensor  # int8 [M, blocks, 32]
    lo: torch.Tensor  # int8 [M, blocks, 32]
    scale: torch.Tensor  # fp32 [M, blocks]: s / 256, s = max|x| / 127

    def values(self) -> torch.Tensor:
        """The floats the digits stand for, ``[M, blocks * 32]`` (float64, exact)."""
        whole = 256 * self.hi.double() + self.lo.double()
        return (whole * self.scale.double().unsqueeze(-1)).flatten(1)


def quantize_activations(x: torch.Tensor) -> Digits:
    """``x [M, in]`` as two int8 digits per block of 32 (zeros past ``in``), as ``integer_kernels.h`` computes
    them: ``s = max|x| / 127``, ``hi = round(x / s)``, ``lo = round(256 (x - s hi) / s)``, both clamped to
    -127..127."""
    rows, cols = x.shape
    padded = torch.nn.functional.pad(x.float(), (0, -(-cols // BLOCK) * BLOCK - cols)).reshape(rows, -1, BLOCK)
    amax = padded.abs().amax(-1, keepdim=True)
    s = amax / 127
    inverse = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    hi = torch.round(padded * inverse).clamp(-127, 127)
    rest = (padded.double() - hi.double() * s.double()).float()  # the C code's fmaf: one rounding
    lo = torch.round(rest * inverse * 256).clamp(-127, 127)
    return Digits(hi.to(torch.int8), lo.to(torch.int8), (s / 256).squeeze(-1))


def integer_product_reference(x: torch.Tensor, blocks: BlockWeight) -> torch.Tensor:
    """What the integer product computes, in float64: per block, ``d`` times the digits' values times ``q``, plus
    (Q4_1) the minimum ``m`` times the block's sum of ``x`` itself (the kernel sums the floats for that term)."""
    digits = quantize_activations(x)
    n = blocks.blocks_per_row
    q = block_integers(blocks).double() - (128 if blocks.format == "q8_0" else 0)  # [out, blocks, 32]
    values = digits.values().reshape(x.shape[0], n, BLOCK)  # [M, blocks, 32]
    per_block = torch.einsum("mbi,obi->mob", values, q) * blocks.scales.double()  # [M, out, blocks]
    if blocks.mins is not None:
        sums = torch.nn.functional.pad(x.double(), (0, n * BLOCK - x.shape[1])).reshape(x.shape[0], n, BLOCK).sum(-1)
        per_block = per_block + sums.unsqueeze(1) * blocks.mins.double()
    return per_block.sum(-1)


def activation_error_bound(x: torch.Tensor, blocks: BlockWeight) -> torch.Tensor:
    """How far the integer product may lie from ``x @ W.T`` (float64) by the digits' rounding alone: per block,
    at most ``s / 256`` (half a ``lo`` step, or a clamped one) times the block's ``sum |w|``."""
    from ..model.block_formats import dequantize

    digits = quantize_activations(x)
    w = dequantize(blocks, torch.float64).abs()
    w = torch.nn.functional.pad(w, (0, blocks.blocks_per_row * BLOCK - blocks.in_features))
    per_block = w.reshape(blocks.out_features, -1, BLOCK).sum(-1)  # [out, blocks]
    return digits.scale.double() @ per_block.T

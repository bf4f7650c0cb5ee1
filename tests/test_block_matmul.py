"""The GGUF block product (``kernels/block_matmul.py``) against the dequantized torch product, on the CPU interpreter.

Fixed shapes and one drawn from a seeded generator: activation rows 1 (the multiply-and-sum path), 3 and 16
(the ``tl.dot`` path, padded to 16 rows) and 17 (two row tiles); output features that are not a
multiple of any tile (17, 33, 40, random); inputs whose last 32-weight block is ragged (72, 100,
300) and one long row (2,000); split-K off and on; activations that are a slice of a wider buffer.
fp32 and fp16 only: the interpreter's bf16 ``tl.dot`` is wrong, so bf16 runs in ``tests/gpu``.

The reference is ``x @ dequantize(blocks).T`` in fp32 (``dequantize`` rounds the weights to fp16
first for the fp16 cases, as ``reference`` does). Tolerance, elementwise, with ``S = |x| @ |w|.T``
(the size of the terms summed): fp32 ``1e-6·S`` (the same products summed in another order;
observed at most 1.2e-7·S); fp16 ``2^-10·S + 2^-10·|ref|``, one rounding of each weight to fp16
(the one-row path keeps the exact fp32 weight, the reference rounds it) plus the output's
rounding, each at most 2^-11, with a factor 2 of margin (observed at most 1.2e-4, about 2^-13).
Every output the wrapper allocates starts as NaN (``poison_allocations``), so an element or a
split that a kernel forgets to write fails.

The same check rejects a broken product: a reference with the two nibbles of a Q4_1 byte swapped,
or without the blocks' minimums, or with Q8_0's scales taken one block off, is far outside it.
"""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch

if importlib.util.find_spec("triton") is None:  # find it without importing it: lifeofprompt.kernels must be first
    pytest.skip("Triton is not installed", allow_module_level=True)
import block_reference  # noqa: E402  (tests/block_reference.py)
from lifeofprompt.kernels import block_matmul as bm  # noqa: E402

from lifeofprompt import kernels  # noqa: E402
from lifeofprompt.lessons.flops import matrix_shapes  # noqa: E402
from lifeofprompt.model.block_formats import BLOCK, BlockWeight, dequantize, quantize  # noqa: E402
from lifeofprompt.model.config import TINYLLAMA_1_1B  # noqa: E402

pytestmark = [
    pytest.mark.numerics,
    pytest.mark.skipif(
        torch.cuda.is_available() and not kernels.INTERPRETED,
        reason="CPU interpreter tests; on a GPU machine run tests/gpu",
    ),
]

DTYPES = [torch.float32, torch.float16]
FORMATS = ["q8_0", "q4_1"]
FP32_SCALE, FP16_SCALE = 1e-6, 2.0**-10


def cases(seed=0):
    """``(rows, out_features, in_features, split_k)``: ragged K, N off every tile, split-K off and on."""
    rng = random.Random(seed)
    fixed = [(1, 40, 72, None), (3, 33, 100, None), (16, 17, 72, 2), (1, 33, 300, 3), (17, 40, 100, None)]
    drawn = [(rng.choice([1, 3, 16]), rng.randint(5, 70), rng.randint(2, 12) * 32 + rng.randint(1, 31), None)]
    return fixed + drawn + [(1, 80, 2000, 4), (16, 24, 2000, None)]


def make(rows, out_features, in_features, fmt, dtype, seed, extra=0):
    """Blocks of a random matrix (its rows on different scales and offsets, so min and scale matter)
    and activations ``x [rows, in]``, a slice of a wider buffer when ``extra`` > 0."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=gen) * torch.rand(out_features, 1, generator=gen)
    weight += torch.randn(out_features, 1, generator=gen) * 0.5
    buffer = torch.randn(rows, in_features + extra, generator=gen).to(dtype)
    return quantize(weight, fmt), buffer[:, extra:]


def within_bound(out: torch.Tensor, expected: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Elementwise: is ``out`` within the module docstring's tolerance of ``expected`` (``x @ w.T`` in fp32)?"""
    size = x.float().abs() @ w.float().abs().t()
    if x.dtype == torch.float32:
        bound = FP32_SCALE * size
    else:
        bound = FP16_SCALE * size + FP16_SCALE * expected.abs()
    return (out.float() - expected).abs() <= bound + 1e-30


def expected_of(x: torch.Tensor, blocks: BlockWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """``reference``'s numbers computed in fp32: the weights rounded to ``x``'s dtype, no rounding of the sum."""
    w = dequantize(blocks, x.dtype).float()
    return x.float() @ w.t(), w


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", cases(), ids=lambda c: "M{}-N{}-K{}-split{}".format(*c))
def test_matches_the_dequantized_product(case, dtype, fmt, poison_allocations):
    rows, out_features, in_features, split_k = case
    blocks, x = make(rows, out_features, in_features, fmt, dtype, seed=rows * 1000 + in_features, extra=5)
    out = bm.block_matmul(x, blocks, split_k=split_k)
    assert out.shape == (rows, out_features) and out.dtype == dtype
    expected, w = expected_of(x, blocks)
    ok = within_bound(out, expected, x, w)
    worst = ((out.float() - expected).abs() / (x.float().abs() @ w.abs().t())).max().item()
    assert bool(ok.all()), f"{int((~ok).sum())} of {ok.numel()} outputs out of bound; worst error/S {worst:.2e}"


@pytest.mark.parametrize("fmt", FORMATS)
def test_reference_is_the_dequantized_product(fmt):
    blocks, x = make(3, 20, 72, fmt, torch.float32, seed=1)
    assert torch.equal(block_reference.reference(x, blocks), x @ dequantize(blocks).t())


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("tiles", [dict(block_n=16, block_k=32), dict(block_n=64, block_k=64), dict(block_k=128)])
def test_every_tile_shape_gives_the_same_product(fmt, tiles, poison_allocations):
    blocks, x = make(3, 50, 164, fmt, torch.float32, seed=7)
    expected, w = expected_of(x, blocks)
    for split_k in (1, 2, 5):
        out = bm.block_matmul(x, blocks, split_k=split_k, **tiles)
        assert bool(within_bound(out, expected, x, w).all()), (tiles, split_k)


def test_no_rows_and_a_single_output():
    blocks, x = make(0, 9, 40, "q4_1", torch.float32, seed=3)
    assert bm.block_matmul(x, blocks).shape == (0, 9)
    blocks, x = make(1, 1, 40, "q8_0", torch.float32, seed=3)
    expected, w = expected_of(x, blocks)
    assert bool(within_bound(bm.block_matmul(x, blocks), expected, x, w).all())


# ----------------------------------------------------------------------------- broken products are caught


def swapped_nibbles(blocks: BlockWeight) -> BlockWeight:
    """A Q4_1 matrix read with the wrong nibble order (high four bits first)."""
    q = blocks.quants
    return BlockWeight(blocks.format, (q >> 4) | (q << 4), blocks.scales, blocks.mins, blocks.in_features)


def without_mins(blocks: BlockWeight) -> BlockWeight:
    return BlockWeight(blocks.format, blocks.quants, blocks.scales, torch.zeros_like(blocks.mins), blocks.in_features)


def scales_one_block_off(blocks: BlockWeight) -> BlockWeight:
    return BlockWeight(blocks.format, blocks.quants, blocks.scales.roll(1, dims=1), blocks.mins, blocks.in_features)


@pytest.mark.parametrize(
    "fmt, break_it",
    [("q4_1", swapped_nibbles), ("q4_1", without_mins), ("q4_1", scales_one_block_off), ("q8_0", scales_one_block_off)],
    ids=["q4_1-swapped-nibbles", "q4_1-no-mins", "q4_1-scales-off", "q8_0-scales-off"],
)
@pytest.mark.parametrize("rows", [1, 3])
def test_the_check_rejects_a_broken_product(fmt, break_it, rows):
    """The kernel passes the check against the true reference and fails it, by far, against a broken one."""
    blocks, x = make(rows, 40, 100, fmt, torch.float16, seed=11)
    out = bm.block_matmul(x, blocks)
    expected, w = expected_of(x, blocks)
    assert bool(within_bound(out, expected, x, w).all())
    wrong, wrong_w = expected_of(x, break_it(blocks))
    assert not torch.equal(wrong_w, w)
    assert (~within_bound(out, wrong, x, wrong_w)).float().mean() > 0.5  # most outputs far outside the bound


# ----------------------------------------------------------------------------- tiles


def tinyllama_blocks(out_features: int, in_features: int, fmt: str) -> BlockWeight:
    """Blocks of TinyLlama's shape without the data (choose_tiles reads only the shapes)."""
    blocks = -(-in_features // BLOCK)
    width = blocks * BLOCK // (2 if fmt == "q4_1" else 1)
    quants = torch.empty(out_features, width, dtype=torch.uint8 if fmt == "q4_1" else torch.int8)
    scales = torch.empty(out_features, blocks, dtype=torch.float16)
    return BlockWeight(fmt, quants, scales, scales if fmt == "q4_1" else None, in_features)


TINYLLAMA = matrix_shapes(TINYLLAMA_1_1B)  # qkv 2560 x 2048, o, gate_up 11264 x 2048, down, head 32000 x 2048


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", [1, 16])
def test_tiles_at_tinyllama_shapes_fill_an_h200(fmt, rows):
    """On 132 SMs every product has at least one program per SM, whole blocks per step, and no empty split."""
    for name, (out_features, in_features) in TINYLLAMA.items():
        tiles = bm.choose_tiles(rows, tinyllama_blocks(out_features, in_features, fmt), num_sms=132)
        programs = -(-out_features // tiles.block_n) * tiles.split_k
        k_tiles = -(-in_features // tiles.block_k)
        assert programs >= 132, (name, tiles)
        assert tiles.block_k % BLOCK == 0 and tiles.use_dot == (rows > 1), (name, tiles)
        assert (tiles.split_k - 1) * tiles.tiles_per_split < k_tiles <= tiles.split_k * tiles.tiles_per_split


def test_tiles_without_sms_never_split_and_bad_tiles_are_refused():
    blocks = tinyllama_blocks(2048, 5632, "q4_1")
    assert bm.choose_tiles(1, blocks, num_sms=None).split_k == 1
    with pytest.raises(ValueError, match="block_k"):
        bm.choose_tiles(1, blocks, None, block_k=48)
    with pytest.raises(ValueError, match="block_n"):
        bm.choose_tiles(3, blocks, None, block_n=8)

"""The compiled block kernel (cpu/block_kernels.c) against the dequantized product, and the layers that call it."""

import itertools

import pytest
import torch

from lifeofprompt.cpu import block_kernels
from lifeofprompt.cpu.block_kernels import blocks_kernel_available, blocks_linear, dequantize_rows
from lifeofprompt.model import quantized_linear
from lifeofprompt.model.block_formats import BlockWeight, dequantize, quantize
from lifeofprompt.model.quantized_linear import QuantizedLinear

pytestmark = [
    pytest.mark.numerics,
    pytest.mark.skipif(not blocks_kernel_available(), reason="no C compiler: the block kernel is not offered"),
]

FORMATS = ("q8_0", "q4_1")
EPS = torch.finfo(torch.float32).eps


def reference(x: torch.Tensor, blocks: BlockWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """``x @ W.T`` in float64 on the dequantized weights, and a bound on the kernel's distance from it.

    The kernel sums in fp32 in its own order: each product adds to a chain of at most
    ``in / 8 + 8`` fp32 additions (vectors of 8 or 16 lanes along the row, a few accumulators, the
    lanes' sum), and each weight ``d q + m`` is rounded once in fp32. Every rounding moves the
    result by at most ``EPS`` times the sum of the magnitudes it adds, so the error is below
    ``(in / 8 + 8) * EPS * sum_i |x_i| (|d q_i| + |m|)``.
    """
    x64 = x.double()
    want = x64 @ dequantize(blocks, torch.float64).t()
    magnitudes = dequantize(blocks, torch.float64).abs()
    if blocks.mins is not None:
        magnitudes += blocks.mins.double().abs().repeat_interleave(32, dim=1)[:, : blocks.in_features]
    depth = blocks.in_features // 8 + 8
    return want, depth * EPS * (x64.abs() @ magnitudes.t())


def assert_matches(got: torch.Tensor, x: torch.Tensor, blocks: BlockWeight) -> float:
    """``got`` is ``x @ dequantize(blocks).T`` within the fp32 bound of ``reference``; returns the worst
    error as a fraction of that bound."""
    want, bound = reference(x, blocks)
    ratio = ((got.double() - want).abs() / bound).max().item()
    assert ratio <= 1, f"the kernel is {ratio:.3g} times the fp32 bound away from the dequantized product"
    return ratio


def random_blocks(fmt: str, out: int, inner: int, seed: int) -> BlockWeight:
    """Blocks of every bit pattern: random quant bytes (Q8_0 down to -128, which ggml never writes but a
    file may hold; Q4_1 all sixteen nibbles), random fp16 scales and minimums, zeros past ``inner``."""
    g = torch.Generator().manual_seed(seed)
    blocks = -(-inner // 32)
    width = blocks * (32 if fmt == "q8_0" else 16)
    quants = torch.randint(0, 256, (out, width), generator=g, dtype=torch.uint8)
    scales = (torch.rand(out, blocks, generator=g) * 0.02 + 1e-4).half()
    if fmt == "q8_0":
        return BlockWeight(fmt, quants.view(torch.int8), scales, None, inner)
    mins = (-torch.rand(out, blocks, generator=g) * 0.1).half()
    return BlockWeight(fmt, quants, scales, mins, inner)


# Row counts across the kernel's tiles (1, 2-4, 5-8 rows; 16 = two tiles of 8), output rows that are
# no multiple of a tile or a thread's chunk, widths with a ragged last block (72, 100) and whole ones.
SHAPES = [(1, 37, 72), (2, 70, 100), (3, 33, 576), (5, 64, 32), (8, 97, 1536), (11, 40, 100), (16, 129, 576)]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m, out, inner", SHAPES)
@torch.no_grad()
def test_the_kernel_computes_the_dequantized_product(fmt, m, out, inner):
    """Quantized random weights and arbitrary bit patterns alike."""
    torch.manual_seed(m * 1000 + out)
    x = torch.randn(m, inner)
    for blocks in (quantize(torch.randn(out, inner) * 0.1, fmt), random_blocks(fmt, out, inner, seed=out)):
        assert_matches(blocks_linear(x, blocks), x, blocks)


@pytest.mark.parametrize("fmt", FORMATS)
@torch.no_grad()
def test_the_comparison_catches_a_wrong_scale_or_nibble_order(fmt):
    """The check above has teeth: the kernel's result, held against the product of blocks with one
    block's scale changed, or (Q4_1) with each byte's two nibbles swapped, or (Q8_0) with the bytes
    of a block read in the other order, is far outside the bound."""
    x = torch.randn(4, 100)
    blocks = quantize(torch.randn(45, 100) * 0.1, fmt)
    got = blocks_linear(x, blocks)
    assert assert_matches(got, x, blocks) < 0.1
    scaled = blocks.scales.clone()
    scaled[7, 2] *= 1.01
    wrong = [BlockWeight(fmt, blocks.quants, scaled, blocks.mins, blocks.in_features)]
    if fmt == "q4_1":
        swapped = (blocks.quants >> 4) | (blocks.quants << 4)
        wrong.append(BlockWeight(fmt, swapped, blocks.scales, blocks.mins, blocks.in_features))
    else:
        reversed_blocks = blocks.quants.view(45, -1, 32).flip(-1).reshape(45, -1)
        wrong.append(BlockWeight(fmt, reversed_blocks, blocks.scales, blocks.mins, blocks.in_features))
    for mutated in wrong:
        want, bound = reference(x, mutated)
        assert ((got.double() - want).abs() / bound).max().item() > 100


@torch.no_grad()
def test_a_ragged_width_reads_no_column_past_it():
    """Q4_1 turns the zeros padding a row's last block into ``d q + m``, not exactly 0: the kernel must
    meet them with zeros, whatever lies past the row's end in memory (here x is a slice of a wider,
    non-contiguous buffer full of large numbers)."""
    blocks = quantize(torch.randn(24, 72) * 0.1 + 0.5, "q4_1")  # a minimum far from 0: padding weighs ~0.5
    wide = torch.full((3, 200), 1e4)
    wide[:, :72] = torch.randn(3, 72)
    x = wide[:, :72]
    assert not x.is_contiguous()
    assert_matches(blocks_linear(x, blocks), x.contiguous(), blocks)


@pytest.mark.parametrize("fmt", FORMATS)
@torch.no_grad()
def test_threads_split_the_rows_and_each_output_is_the_same(fmt):
    """Every output is one thread's sum, in an order that does not depend on the thread count."""
    x = torch.randn(5, 576)
    blocks = quantize(torch.randn(1000, 576) * 0.1, fmt)
    previous = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outs.append(blocks_linear(x, blocks))
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(outs[0], outs[1])


def test_the_kernel_reads_fp32_rows_of_the_matrix_width():
    """Rows of another float dtype are made fp32 first; rows of another width, or of integers, are refused."""
    blocks = quantize(torch.randn(8, 64), "q8_0")
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    assert torch.equal(blocks_linear(x, blocks), blocks_linear(x.float(), blocks))
    for wrong in (torch.randn(2, 65), torch.ones(2, 64, dtype=torch.int32), torch.randn(64)):
        with pytest.raises(ValueError, match="float x"):
            blocks_linear(wrong, blocks)


@pytest.mark.parametrize("fmt", FORMATS)
@torch.no_grad()
def test_a_quantized_layer_takes_the_kernel_for_few_rows_and_dequantizes_for_many(fmt, monkeypatch):
    """``QuantizedLinear`` on the CPU: up to its row limit (timed per machine, here pinned) the compiled kernel,
    more the dequantizing fallback, and both compute the same product."""
    layer = QuantizedLinear(quantize(torch.randn(50, 100) * 0.1, fmt))
    monkeypatch.setattr(quantized_linear, "cpu_kernel_rows", lambda: quantized_linear.KERNEL_MAX_ROWS)
    calls = []
    monkeypatch.setattr(
        quantized_linear,
        "block_kernel",
        lambda x, b, real=quantized_linear.block_kernel: calls.append(x.shape[0]) or real(x, b),
    )
    for rows in (1, quantized_linear.KERNEL_MAX_ROWS, quantized_linear.KERNEL_MAX_ROWS + 1):
        x = torch.randn(rows, 100)
        assert_matches(layer(x), x, layer.blocks)
    assert calls == [1, quantized_linear.KERNEL_MAX_ROWS, quantized_linear.KERNEL_MAX_ROWS + 1]
    few, many = torch.randn(3, 100), torch.randn(quantized_linear.KERNEL_MAX_ROWS + 1, 100)
    assert quantized_linear.block_kernel(few, layer.blocks) is blocks_linear
    assert quantized_linear.block_kernel(many, layer.blocks) is None


def test_every_row_count_and_format_agrees_with_one_row_at_a_time():
    """A tile of rows computes each row as a lone row would, up to fp32 summation order."""
    torch.manual_seed(0)
    for fmt, m in itertools.product(FORMATS, (2, 7, 9)):
        blocks = quantize(torch.randn(33, 96) * 0.1, fmt)
        x = torch.randn(m, 96)
        together = blocks_linear(x, blocks)
        alone = torch.cat([blocks_linear(x[r : r + 1], blocks) for r in range(m)])
        torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("inner", [32, 96, 576, 1536])
@torch.no_grad()
def test_each_row_count_up_to_a_tile_is_the_dequantized_product(fmt, inner):
    """With AVX-512, one row of x and 2 to 8 rows take loops of their own (``block_kernels.h``: a lookup of a
    block's sixteen Q4_1 weights by nibble, Q8_0 sign-extended in one instruction), unrolled over pairs
    of blocks for one row: an odd and an even number of blocks, every nibble and byte, each row count."""
    torch.manual_seed(inner)
    for m in range(1, 10):
        x = torch.randn(m, inner)
        for blocks in (quantize(torch.randn(67, inner) * 0.1, fmt), random_blocks(fmt, 67, inner, seed=m)):
            assert_matches(blocks_linear(x, blocks), x, blocks)


# ----------------------------------------------------------------------------- dequantize_rows (prefill)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("inner", [32, 72, 100, 576])
def test_the_compiled_dequantization_is_torch_s_bit_for_bit(fmt, inner):
    """``dequantize_rows`` writes the very floats of ``BlockWeight.dequantize`` (``d * q``, then ``+ m``, each
    rounded; no fused multiply-add): every bit pattern, ragged widths, row ranges that are no multiple of a
    thread's chunk, the true and the padded width, one thread and two."""
    previous = torch.get_num_threads()
    try:
        for threads, blocks in itertools.product(
            (1, 2), (quantize(torch.randn(101, inner) * 0.1, fmt), random_blocks(fmt, 101, inner, seed=inner))
        ):
            torch.set_num_threads(threads)
            for first, last in ((0, 101), (0, 1), (3, 40), (33, 97), (100, 101), (7, 7)):
                want = blocks.dequantize(torch.float32, first, last)
                got = dequantize_rows(blocks, first, last)
                assert got.shape == want.shape
                assert torch.equal(got.view(torch.int32), want.view(torch.int32))
                padded = dequantize_rows(blocks, first, last, padded=True)
                assert padded.shape == (last - first, blocks.blocks_per_row * 32)
                assert torch.equal(padded[:, :inner].view(torch.int32), want.view(torch.int32))
    finally:
        torch.set_num_threads(previous)


def test_the_compiled_dequantization_writes_into_a_scratch_buffer():
    """``out``: the rows land at its front and the result is a view of it; a buffer too small, of
    another dtype or not contiguous is refused, as are rows outside the matrix."""
    blocks = random_blocks("q4_1", 40, 100, seed=3)
    scratch = torch.full((64 * 100,), float("nan"))
    got = dequantize_rows(blocks, 5, 30, out=scratch)
    assert got.data_ptr() == scratch.data_ptr() and got.shape == (25, 100)
    assert torch.equal(got, blocks.dequantize(torch.float32, 5, 30))
    assert scratch[25 * 100 :].isnan().all()
    for wrong in (torch.empty(25 * 100 - 1), torch.empty(25 * 100, dtype=torch.float64), torch.empty(100, 50).t()):
        with pytest.raises(ValueError, match="out must be"):
            dequantize_rows(blocks, 5, 30, out=wrong)
    for first, last in ((-1, 3), (5, 41), (6, 5)):
        with pytest.raises(ValueError, match="not within"):
            dequantize_rows(blocks, first, last)


def exact_product(x: torch.Tensor, blocks: BlockWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """``x @ W.T`` in float64 on the fp32 weights, and a bound for an fp32 product in any summation order
    (BLAS's): at most ``in`` roundings in a chain, each by ``EPS`` of the magnitudes summed."""
    w = blocks.dequantize(torch.float32).double()
    x64 = x.double()
    return x64 @ w.t(), (blocks.in_features + 1) * EPS * (x64.abs() @ w.abs().t())


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m, out, inner", [(17, 70, 72), (64, 300, 100), (300, 129, 576), (33, 1100, 1536)])
@torch.no_grad()
def test_the_compiled_dequantized_product_for_many_rows(fmt, m, out, inner, monkeypatch):
    """``dequantized_product`` on the CPU takes ``dequantize_rows`` for each tile of output rows (here tiles
    of 64 rows, so that most products have several and a ragged last one) and BLAS for the product: the
    dequantized product within fp32 summation tolerance, and the torch fallback's result as closely."""
    torch.manual_seed(m + out)
    monkeypatch.setattr(quantized_linear, "CPU_DEQUANTIZE_ROWS", 64)
    tiles = []

    def counted(blocks, first, last, **kwargs):
        tiles.append((first, last))
        return dequantize_rows(blocks, first, last, **kwargs)

    monkeypatch.setattr(block_kernels, "dequantize_rows", counted)
    x = torch.randn(m, inner)
    for blocks in (quantize(torch.randn(out, inner) * 0.1, fmt), random_blocks(fmt, out, inner, seed=m)):
        tiles.clear()
        got = quantized_linear.dequantized_product(x, blocks, torch.float32)
        assert tiles == [(first, min(first + 64, out)) for first in range(0, out, 64)]
        want, bound = exact_product(x, blocks)
        assert got.dtype == torch.float32 and got.shape == (m, out)
        assert ((got.double() - want).abs() <= bound).all()
        with monkeypatch.context() as no_compiler:
            no_compiler.setattr(block_kernels, "dequantize_kernel", lambda: None)
            fallback = quantized_linear.dequantized_product(x, blocks, torch.float32)
        assert len(tiles) == -(-out // 64)
        assert ((fallback.double() - want).abs() <= bound).all()


@torch.no_grad()
def test_a_quantized_layer_prefills_through_the_compiled_dequantization():
    """A layer given more than ``KERNEL_MAX_ROWS`` rows (a prompt) under ``no_grad``, and one under autograd
    (which always dequantizes), both compute the product; another output dtype is honoured."""
    layer = QuantizedLinear(random_blocks("q8_0", 200, 100, seed=5))
    x = torch.randn(2, 40, 100)
    want, bound = exact_product(x.reshape(-1, 100), layer.blocks)
    got = layer(x)
    assert got.shape == (2, 40, 200)
    assert ((got.reshape(-1, 200).double() - want).abs() <= bound).all()
    half = quantized_linear.dequantized_product(x.reshape(-1, 100), layer.blocks, torch.bfloat16)
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.float(), got.reshape(-1, 200), rtol=1e-2, atol=1e-2)


def test_the_kernels_row_limit_is_what_the_timing_found(monkeypatch, tmp_path):
    """The CPU's row limit follows the measurement: the last timed count the kernel won, never under the floor."""
    monkeypatch.setenv("LIFEOFPROMPT_CACHE", str(tmp_path))
    clock = iter([0.0, 1.0, 0.0, 2.0] + [0.0, 1.0, 0.0, 2.0] + [0.0, 3.0, 0.0, 2.0] * 3)  # wins at 16, 64; loses at 256
    monkeypatch.setattr("time.perf_counter", lambda: next(clock))
    assert quantized_linear.kernel_row_limit() == 64

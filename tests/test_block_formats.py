"""GGUF's Q8_0 and Q4_1 blocks: ours against gguf-py's, byte by byte and element by element.

gguf-py (``gguf.quants``) is the reference implementation of the file format that llama.cpp's
converter uses; ours is torch code that keeps the blocks as planes (``model/block_formats.py``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from lifeofprompt.lessons.quantization import to_gguf_bytes
from lifeofprompt.model.block_formats import (
    BLOCK,
    BlockWeight,
    concatenate,
    dequantize,
    from_gguf_bytes,
    quantize,
)
from lifeofprompt.model.gguf_weights import unpermute_order

GGML = {"q8_0": GGMLQuantizationType.Q8_0, "q4_1": GGMLQuantizationType.Q4_1}


def weights(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Random weights with the awkward blocks too: one all zeros, one constant (a zero scale), one huge."""
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 0.05
    w[0, :BLOCK] = 0.0
    if rows > 1:
        w[1, :BLOCK] = 0.3
    if rows > 2:
        w[2, 3] = 40.0
    return w


@pytest.mark.parametrize("fmt", ["q8_0", "q4_1"])
@pytest.mark.parametrize("shape, seed", [((5, 64), 0), ((17, 96), 1), ((3, 576), 2)])
def test_our_blocks_are_gguf_pys_byte_for_byte(fmt, shape, seed):
    w = weights(*shape, seed)
    ours = to_gguf_bytes(quantize(w, fmt)).numpy()
    theirs = quants.quantize(w.numpy(), GGML[fmt])
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype == np.uint8
    assert np.array_equal(ours, theirs)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_1"])
def test_dequantized_weights_are_gguf_pys_element_for_element(fmt):
    w = weights(9, 160, seed=3)
    raw = quants.quantize(w.numpy(), GGML[fmt])
    blocks = from_gguf_bytes(torch.from_numpy(raw), fmt, 160)
    theirs = torch.from_numpy(quants.dequantize(raw, GGML[fmt]))
    assert torch.equal(dequantize(blocks), theirs)
    assert torch.equal(to_gguf_bytes(blocks), torch.from_numpy(raw))  # planes and records hold the same bytes


def swapped_nibbles(blocks: BlockWeight) -> BlockWeight:
    """Q4_1 blocks read with the nibbles the wrong way round (weight j in the high half)."""
    q = blocks.quants
    return BlockWeight(blocks.format, (q >> 4) | (q << 4), blocks.scales, blocks.mins, blocks.in_features)


def test_the_element_check_catches_a_swapped_nibble_order_and_a_wrong_scale():
    w = weights(4, 64, seed=4)
    raw = quants.quantize(w.numpy(), GGML["q4_1"])
    theirs = torch.from_numpy(quants.dequantize(raw, GGML["q4_1"]))
    blocks = from_gguf_bytes(torch.from_numpy(raw), "q4_1", 64)
    assert not torch.equal(dequantize(swapped_nibbles(blocks)), theirs)
    halved = BlockWeight("q4_1", blocks.quants, blocks.scales / 2, blocks.mins, 64)
    assert not torch.equal(dequantize(halved), theirs)


@pytest.mark.parametrize("fmt, levels", [("q8_0", 127), ("q4_1", 15)])
@pytest.mark.parametrize("cols", [72, 100, 31])
def test_a_ragged_last_block_is_padded_and_the_error_is_half_a_step(fmt, levels, cols):
    w = weights(6, cols, seed=cols)
    blocks = quantize(w, fmt)
    assert blocks.quants.shape[1] * (2 if fmt == "q4_1" else 1) == -(-cols // BLOCK) * BLOCK
    back = dequantize(blocks)
    assert back.shape == w.shape
    padded = torch.nn.functional.pad(w, (0, (-cols) % BLOCK)).reshape(6, -1, BLOCK)
    spread = padded.abs().amax(-1) if fmt == "q8_0" else padded.amax(-1) - padded.amin(-1)
    step = (spread / levels).repeat_interleave(BLOCK, dim=1)[:, :cols]
    # half a quantization step, plus fp16's rounding of the scale (and the minimum) it is stored in
    bound = step / 2 + 2e-3 * padded.abs().amax(-1).repeat_interleave(BLOCK, dim=1)[:, :cols]
    assert ((back - w).abs() <= bound).all()


def test_stacking_and_reordering_rows_of_blocks_is_exact():
    a, b = quantize(weights(4, 64, 5), "q4_1"), quantize(weights(6, 64, 6), "q4_1")
    stacked = concatenate([a, b])
    assert torch.equal(dequantize(stacked), torch.cat([dequantize(a), dequantize(b)]))
    order = torch.randperm(10, generator=torch.Generator().manual_seed(0))
    assert torch.equal(dequantize(stacked.permute_rows(order)), dequantize(stacked)[order])
    with pytest.raises(ValueError, match="one block format"):
        concatenate([a, quantize(weights(2, 64, 7), "q8_0")])


def llama_cpp_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """What llama.cpp's converter does to q and k rows (``convert_hf_to_gguf.py``'s ``permute``)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("rows, heads", [(576, 9), (192, 3), (64, 1)])
def test_unpermuting_undoes_llama_cpps_rotary_row_order(rows, heads):
    w = torch.arange(rows, dtype=torch.float32).unsqueeze(1).expand(rows, 4)
    assert torch.equal(llama_cpp_permute(w, heads)[unpermute_order(rows, heads)], w)

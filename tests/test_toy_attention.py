"""lifeofprompt.lessons.toy_attention: the toy is real attention, the layer walkthrough is the real layer."""

from __future__ import annotations

import matplotlib
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_counts import examples

from lifeofprompt.lessons.toy_attention import (
    layer_walkthrough,
    plot_attention,
    plot_gqa,
    plot_matrix,
    plot_projections,
    plot_rope,
    rope_scores,
    toy_attention,
)
from lifeofprompt.model.layers import RotaryEmbedding

matplotlib.use("Agg")


def test_default_toy_shapes_and_prediction():
    toy = toy_attention()
    assert toy.tokens == ("a", "sunset", "is")
    assert toy.X.shape == toy.Q.shape == toy.K.shape == toy.V.shape == toy.context.shape == (3, 4)
    assert toy.W_Q.shape == (4, 4) and toy.scores.shape == toy.weights.shape == (3, 3)
    assert toy.logits.shape == (8,) and toy.next_token == "extremely"
    assert torch.equal(toy.mask, torch.tensor([[1, 0, 0], [1, 1, 0], [1, 1, 1]], dtype=torch.bool))
    assert torch.isinf(toy.masked[0, 1]) and torch.equal(toy.weights.triu(1), torch.zeros(3, 3))


@settings(max_examples=examples(25), deadline=None)
@given(st.integers(0, 10_000))
def test_toy_is_causal_attention_for_any_seed(seed):
    toy = toy_attention(seed)
    sdpa = F.scaled_dot_product_attention(toy.Q[None], toy.K[None], toy.V[None], is_causal=True)[0]
    assert torch.allclose(toy.context, sdpa, atol=1e-5)
    assert torch.allclose(toy.weights.sum(-1), torch.ones(3))
    last_only = (toy.Q[-1] @ toy.K.T / 2).softmax(-1) @ toy.V  # one query, every key and value
    assert torch.allclose(last_only, toy.context[-1], atol=1e-6)
    assert torch.allclose(toy.logits, toy.context[-1] @ toy.W_LM)


def test_heatmaps_carry_shapes_and_highlights():
    import matplotlib.pyplot as plt

    toy = toy_attention()
    fig = plot_projections(toy)
    titles = [ax.get_title() for ax in fig.axes]
    assert "X (token vectors)  [3×4]" in titles and "W_Q  [4×4]" in titles and "K = X·W_K  [3×4]" in titles
    plt.close(fig)
    fig = plot_attention(toy)
    masked_ax = next(ax for ax in fig.axes if ax.get_title().startswith("causal mask"))
    assert sum(t.get_text() == "-inf" for t in masked_ax.texts) == 3
    red = [p for p in masked_ax.patches if p.get_edgecolor()[:3] == (1.0, 0.0, 0.0)]
    assert len(red) == 1 and red[0].get_y() == pytest.approx(1.5)  # the last row, and only it
    assert "argmax = 'extremely'" in fig.axes[-1].get_title()
    plt.close(fig)
    fig, ax = plt.subplots()
    plot_matrix(ax, torch.zeros(2, 5), "zeros")
    assert ax.get_title() == "zeros  [2×5]"
    plt.close(fig)


def test_rope_scores_depend_on_relative_position_only():
    rotary = RotaryEmbedding(16, 64, 10000.0)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(16, generator=g), torch.randn(16, generator=g)
    s = rope_scores(rotary, q, k, 12)
    assert torch.allclose(s[:-1, :-1], s[1:, 1:], atol=1e-4)  # constant along every diagonal
    assert not torch.allclose(s[0, 0], s[5, 0], atol=1e-3)  # but it does change with the distance
    import matplotlib.pyplot as plt

    plt.close(plot_rope(rotary, 16))
    fig = plot_gqa(9, 3)
    assert "9 query heads share 3 key/value heads" in fig.axes[0].get_title()
    plt.close(fig)


@pytest.mark.parametrize("layer_idx", [0, 7])
def test_layer_walkthrough_equals_the_layer(smollm2, layer_idx):
    model, _ = smollm2
    walk = layer_walkthrough(model, [6004, 957, 1462, 314], layer_idx=layer_idx)
    assert walk["q"].shape == (4, 9, 64) and walk["k"].shape == walk["v"].shape == (4, 3, 64)
    assert walk["attn_weights"].shape == (9, 4, 4) and walk["swiglu"].shape == (4, 1536)
    assert torch.equal(walk["attn_weights"].triu(1), torch.zeros(9, 4, 4))
    assert (walk["layer_output"] - walk["reference_output"]).abs().max().item() < 1e-4
    assert (walk["layer_output"] - walk["layer_input"]).abs().max().item() > 1e-2  # the layer did something

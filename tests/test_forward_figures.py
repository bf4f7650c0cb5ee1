"""Chapter 02's drawings and the figure footer: they draw what they claim, from the toy's own numbers."""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from lifeofprompt.figures.footer import add_footer  # noqa: E402
from lifeofprompt.figures.forward import AGAIN, CACHED, LAYER_BOXES, plot_decoder_layer, plot_naive_vs_cached  # noqa: E402
from lifeofprompt.lessons import machine_profile as mp  # noqa: E402
from lifeofprompt.lessons.toy_attention import TOY_TOKENS, toy_attention  # noqa: E402


def test_decoder_layer_has_one_box_per_module():
    fig = plot_decoder_layer(30, 576, {"self_attn.qkv_proj": "[T, 960]"})
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert all(label in texts for label, _, _ in LAYER_BOXES)
    assert "[T, 960]" in texts
    plt.close(fig)


def test_naive_step_recomputes_what_the_cached_step_reads():
    toy = toy_attention(tokens=TOY_TOKENS + ("extremely",))
    assert torch.equal(toy.K[:3], toy_attention().K)  # the old rows are the previous step's
    fig = plot_naive_vs_cached(toy)
    naive_k, cached_k = fig.axes[1], fig.axes[6]
    colour = lambda ax: [matplotlib.colors.to_hex(p.get_facecolor()) for p in ax.patches]  # noqa: E731
    assert colour(naive_k).count(AGAIN) == 12 and colour(cached_k).count(CACHED) == 12
    cached_context = [float(t.get_text()) for t in fig.axes[9].texts]
    assert cached_context == [round(float(v), 1) + 0.0 for v in toy.context[-1]]  # the same last row
    plt.close(fig)


def test_footer_names_this_run_and_the_profile():
    profile = mp.MachineProfile("fake CPU, 1 thread", 30e9, 20e9, 1e11, 0.02, "2026-01-01 00:00 UTC", 0.1)
    text = mp.run_footer(profile)
    assert "load average" in text and "fake CPU, 1 thread" in text and "batch-1 step 20.0 ms" in text
    fig, _ = plt.subplots()
    add_footer(fig, text)
    assert fig.texts[-1].get_text() == text
    plt.close(fig)

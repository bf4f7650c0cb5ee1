"""The VRAM-land panel's callback, called directly (the browser test moves the real slider)."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

from lifeofprompt.engine.memory import plan_memory  # noqa: E402
from lifeofprompt.figures.memory import land_figure, land_report, memory_panel, update_land  # noqa: E402
from lifeofprompt.model.config import TINYLLAMA_1_1B  # noqa: E402
from lifeofprompt.units import GiB  # noqa: E402


def test_update_gives_figure_and_the_logged_numbers():
    fig, text = update_land(16, 0.9, "tinyllama-1.1b", 16, 4096)
    assert "GPU blocks         36,387" in text
    assert "CPU blocks         11,915" in text
    assert "requests of 4,096 tokens that fit at once: 142" in text
    assert "(estimated)" in text
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert any(label.startswith("KV pool") for label in labels)
    assert any("activations (estimated)" in label for label in labels)


def test_more_memory_more_blocks():
    _, small = update_land(16, 0.9, "tinyllama-1.1b", 16, 4096)
    _, large = update_land(24, 0.9, "tinyllama-1.1b", 16, 4096)
    blocks = [int(t.split("GPU blocks")[1].split()[0].replace(",", "")) for t in (small, large)]
    assert blocks[1] > blocks[0]


def test_a_model_that_does_not_fit_explains_itself():
    fig, text = update_land(8, 0.9, "llama-3.1-8b", 16, 4096)
    assert fig is None and text.startswith("OutOfMemoryError") and "do not fit" in text


def test_the_bar_spans_the_whole_device():
    plan = plan_memory(TINYLLAMA_1_1B, "bf16", 16 * GiB, activations=GiB, activations_measured=True)
    fig = land_figure(plan)
    widths = sum(p.get_width() for p in fig.axes[0].patches)
    assert abs(widths - 16) < 1e-9
    assert "(measured)" in land_report(plan, 2048)
    assert any("activations (measured)" in t.get_text() for t in fig.axes[0].get_legend().get_texts())


def test_panel_redraws_when_a_slider_moves():
    panel = memory_panel()

    def printed():
        return panel.shown["text"]

    assert "36,387" in printed()
    panel.controls["gpu_memory_gib"].value = 24
    assert "36,387" not in printed() and "GPU blocks" in printed()

"""The VRAM-land panel's callback, called directly (the browser test moves the real slider): the plan the
sliders ask for, the bar drawn from it, and the panel following a slider."""

from __future__ import annotations

import io

import matplotlib

matplotlib.use("Agg")

from lifeofprompt.engine.memory import plan_memory  # noqa: E402
from lifeofprompt.figures.memory import land_figure, land_plan, land_report, memory_panel, update_land  # noqa: E402
from lifeofprompt.lessons.memory_arithmetic import cpu_blocks, max_concurrency, unusable  # noqa: E402
from lifeofprompt.model.config import TINYLLAMA_1_1B  # noqa: E402
from lifeofprompt.units import GiB  # noqa: E402


def bars(fig) -> list[float]:
    return [p.get_width() for p in fig.axes[0].patches]


def test_the_sliders_plan_is_vllms_arithmetic_on_tinyllama():
    plan = land_plan(16, 0.9, "tinyllama-1.1b", 16)
    assert plan.num_gpu_blocks == 36_387 and cpu_blocks(plan) == 11_915
    assert max_concurrency(plan, 4096) == 142 and not plan.activations_measured


def test_the_bar_draws_each_tenant_of_the_plan_and_renders():
    fig, text, plan = update_land(16, 0.9, "tinyllama-1.1b", 16, 4096)
    expected = [plan.weights, plan.activations, plan.kv_pool, unusable(plan)]
    assert bars(fig) == [n / GiB for n in expected]
    assert len(fig.axes[0].get_legend().get_texts()) == 4  # one entry per tenant
    assert f"{plan.num_gpu_blocks:,}" in text
    png = io.BytesIO()
    fig.savefig(png, format="png")
    assert png.getvalue().startswith(b"\x89PNG")


def test_more_memory_more_blocks():
    small, large = (land_plan(gib, 0.9, "tinyllama-1.1b", 16) for gib in (16, 24))
    assert large.num_gpu_blocks > small.num_gpu_blocks and large.weights == small.weights


def test_a_model_that_does_not_fit_explains_itself():
    fig, text, plan = update_land(8, 0.9, "llama-3.1-8b", 16, 4096)
    assert fig is None and plan is None and text.startswith("OutOfMemoryError") and "do not fit" in text


def test_the_bar_spans_the_whole_device_with_measured_activations():
    plan = plan_memory(TINYLLAMA_1_1B, "bf16", 16 * GiB, activations=GiB, activations_measured=True)
    fig = land_figure(plan)
    assert abs(sum(bars(fig)) - 16) < 1e-9 and bars(fig)[1] == 1.0
    assert "measured" in land_report(plan, 2048) and "estimated" not in land_report(plan, 2048)  # says which it is


def test_panel_redraws_when_a_slider_moves():
    panel = memory_panel()
    before = panel.shown["plan"]
    assert before.num_gpu_blocks == 36_387
    panel.controls["gpu_memory_gib"].value = 24
    after = panel.shown["plan"]
    assert after.num_gpu_blocks > before.num_gpu_blocks and f"{after.num_gpu_blocks:,}" in panel.shown["text"]

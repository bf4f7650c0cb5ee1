"""Chapter 14 in a real browser: moving the k slider redraws the yield curve and changes the prediction."""

from __future__ import annotations

import re

NOTEBOOK = "notebooks/14_speculative_decoding.ipynb"


def _prediction(text: str) -> tuple[int, float]:
    match = re.search(r"predicted at k = (\d+), α = [\d.]+: ([\d.]+) tokens per verify step", text)
    assert match, f"no prediction line in the panel's output:\n{text}"
    return int(match.group(1)), float(match.group(2))


def test_k_slider_changes_the_predicted_yield(lab):
    page = lab.open_and_run(NOTEBOOK)
    panel_output = page.locator(".widget-output").last
    panel_output.wait_for()
    k, before = _prediction(panel_output.inner_text())
    assert k == 4
    assert panel_output.locator("img").count() == 1
    assert "measured" in panel_output.inner_text()  # the notebook's runs are listed
    lab.screenshot(page, "notebook14_panel_before", locator=panel_output)

    slider = page.locator(".widget-hslider", has_text="k")
    handle = slider.first.locator(".noUi-handle")
    handle.focus()
    for _ in range(3):  # k 4 -> 7
        handle.press("ArrowRight")
    page.wait_for_function(
        """() => {
        const outs = document.querySelectorAll('.widget-output');
        const text = outs.length ? outs[outs.length - 1].innerText : '';
        return text.includes('predicted at k = 7');
    }""",
        timeout=60_000,
    )
    lab.wait_idle(page)
    k, after = _prediction(panel_output.inner_text())
    assert k == 7 and after > before  # more drafts, more expected tokens at α = 0.7
    lab.screenshot(page, "notebook14_panel_after", locator=panel_output)

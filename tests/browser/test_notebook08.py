"""Chapter 08 in a real browser: it runs, and moving the concurrency slider redraws the schedule panel."""

from __future__ import annotations

import re

NOTEBOOK = "notebooks/08_scheduler.ipynb"


def panel_state(page):
    """The panel's printed summary line and the picture it drew (its data URL)."""
    output = page.locator(".widget-output").last
    text = output.inner_text()
    images = output.locator("img")
    src = images.first.get_attribute("src") if images.count() else None
    return text, src


def test_notebook08_concurrency_slider_changes_the_figure(lab):
    page = lab.open_and_run(NOTEBOOK)
    text = lab.output_text(page)
    assert "1 prefill chunk tokens   0..3   (4)  blocks [1]" in text  # the cinema queue's step 0
    assert "2 PREEMPTED" in text and "recompute" in text  # preemption made visible
    assert "same tokens for every request: True" in text

    slider = page.locator(".widget-slider", has_text="max seqs").first
    slider.scroll_into_view_if_needed()
    page.wait_for_function(
        "() => Array.from(document.querySelectorAll('.widget-output'))"
        ".some(o => o.innerText.includes('max_num_seqs=16,'))",
        timeout=120_000,
    )
    before_text, before_src = panel_state(page)
    assert "max_num_seqs=16," in before_text and before_src

    readout = slider.locator(".widget-readout")
    readout.click()
    page.keyboard.press("Control+A")
    page.keyboard.type("2")
    page.keyboard.press("Enter")
    lab.wait_idle(page)
    page.wait_for_function(
        "() => Array.from(document.querySelectorAll('.widget-output'))"
        ".some(o => o.innerText.includes('max_num_seqs=2,'))",
        timeout=120_000,
    )
    after_text, after_src = panel_state(page)
    assert "max_num_seqs=2," in after_text and after_src and after_src != before_src
    p50 = [float(re.search(r"TTFT p50 ([\d.]+) s", t).group(1)) for t in (before_text, after_text)]
    assert p50[1] > p50[0], "two seats instead of sixteen should make requests wait longer"
    path = lab.screenshot(page, "notebook08_panel", locator=page.locator(".widget-output").last)
    assert path.stat().st_size > 10_000

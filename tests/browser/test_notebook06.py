"""Notebook 06 in a real browser: it runs, and moving the block-size slider redraws the paging panel."""

from __future__ import annotations

import pytest

NOTEBOOK = "notebooks/06_paged_cache.ipynb"


@pytest.mark.browser
def test_block_size_slider_redraws_the_pool(lab):
    page = lab.open_and_run(NOTEBOOK)
    text = lab.output_text(page)
    assert "same tokens as generate_cached: True" in text
    assert "hello there finishes: blocks [2] back to the free queue" in text

    widget = page.locator(".widget-vbox").filter(has=page.locator(".widget-slider")).first
    widget.scroll_into_view_if_needed()
    readout = widget.locator(".widget-readout").first
    assert readout.inner_text().strip() == "16"
    output = widget.locator(".widget-output")
    output.locator("img").first.wait_for()
    before_text = output.inner_text()
    before_image = output.locator("img").first.get_attribute("src")
    assert "block size 16 → 128 blocks" in before_text
    lab.screenshot(page, "notebook06_panel_block16", locator=widget)

    handle = widget.locator(".widget-slider .noUi-handle").first
    handle.click()
    page.keyboard.press("ArrowRight")                      # 16 → 32 tokens per block
    lab.wait_idle(page)
    page.wait_for_function("(el) => el.innerText.includes('block size 32')", arg=output.element_handle(),
                           timeout=60_000)
    assert readout.inner_text().strip() == "32"
    after_text = output.inner_text()
    assert "block size 32 → 64 blocks" in after_text and "paged:" in after_text
    image = output.locator("img").first
    image.wait_for()
    assert image.get_attribute("src") != before_image, "the figure was not redrawn"
    page.wait_for_function("(img) => img.complete && img.naturalWidth > 0", arg=image.element_handle(),
                           timeout=30_000)
    image.evaluate("img => img.decode()")                 # decoded and painted before the screenshot
    page.evaluate("() => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)))")
    page.wait_for_timeout(1000)
    lab.screenshot(page, "notebook06_panel_block32", locator=widget)   # a loaded machine may paint late:
    page.wait_for_timeout(3000)                                         # the second shot is the one kept
    path = lab.screenshot(page, "notebook06_panel_block32", locator=widget)
    assert path.stat().st_size > 10_000

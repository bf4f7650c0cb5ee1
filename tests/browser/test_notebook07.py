"""Chapter 07 in a real browser: it runs, and moving the block-size slider redraws the paging panel."""

from __future__ import annotations

import pytest

NOTEBOOK = "notebooks/07_paged_cache.ipynb"


@pytest.mark.browser
def test_block_size_slider_redraws_the_pool(lab):
    page = lab.open_and_run(NOTEBOOK)
    text = lab.output_text(page)
    assert "same tokens as generate_cached: True" in text
    assert "hello there finishes: blocks [2] back to the free queue" in text

    widget = page.locator(".widget-vbox").filter(has=page.locator(".lop-paging-summary")).first
    widget.scroll_into_view_if_needed()
    readout = widget.locator(".widget-readout").first
    assert readout.inner_text().strip() == "16"
    summary = widget.locator(".lop-paging-summary")
    image = widget.locator("img").first
    image.wait_for()
    before_image = image.get_attribute("src")
    assert "block size 16 → 128 blocks" in summary.inner_text()
    lab.screenshot(page, "notebook07_panel_block16", locator=widget)

    # Focus the handle and press the key on it (a click can start a drag, or leave the focus elsewhere
    # on a loaded machine): the slider's own readout must move first, then the kernel redraws.
    handle = widget.locator(".widget-slider .noUi-handle").first
    handle.focus()
    handle.press("ArrowRight")  # 16 → 32 tokens per block
    page.wait_for_function("(el) => el.innerText.trim() === '32'", arg=readout.element_handle(), timeout=10_000)
    lab.wait_idle(page)
    page.wait_for_function(
        "(el) => el.innerText.includes('block size 32')", arg=summary.element_handle(), timeout=120_000
    )
    assert "block size 32 → 64 blocks" in summary.inner_text() and "paged:" in summary.inner_text()
    page.wait_for_function(
        "([img, old]) => img.src !== old && img.complete && img.naturalWidth > 0",
        arg=[image.element_handle(), before_image],
        timeout=30_000,
    )
    path = lab.screenshot(page, "notebook07_panel_block32", locator=widget)
    assert path.stat().st_size > 10_000

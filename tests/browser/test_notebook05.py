"""Chapter 05 in a real browser: moving the GPU-memory slider redraws the land and changes the block count."""

from __future__ import annotations

import re

NOTEBOOK = "notebooks/05_memory_and_roofline.ipynb"


def _gpu_blocks(text: str) -> int:
    match = re.search(r"GPU blocks\s+([\d,]+)", text)
    assert match, f"no 'GPU blocks' line in the panel's output:\n{text}"
    return int(match.group(1).replace(",", ""))


def test_gpu_memory_slider_changes_the_block_count(lab):
    page = lab.open_and_run(NOTEBOOK)
    panel_output = page.locator(".widget-output").last
    panel_output.wait_for()
    assert _gpu_blocks(panel_output.inner_text()) == 36_387  # TinyLlama, 16 GiB, 0.9, blocks of 16
    assert panel_output.locator("img").count() == 1  # the redrawn bar
    lab.screenshot(page, "notebook05_panel_before", locator=panel_output)

    slider = page.locator(".widget-hslider", has_text="GPU GiB")
    handle = slider.locator(".noUi-handle")
    handle.focus()
    for _ in range(8):  # 16 -> 24 GiB, one step per key
        handle.press("ArrowRight")
    page.wait_for_function(
        """() => {
        const outs = document.querySelectorAll('.widget-output');
        const text = outs.length ? outs[outs.length - 1].innerText : '';
        return text.includes('GPU blocks') && !text.includes('36,387');
    }""",
        timeout=60_000,
    )
    lab.wait_idle(page)
    assert "24" in slider.locator(".widget-readout").inner_text()
    after = _gpu_blocks(panel_output.inner_text())
    assert after > 36_387  # more memory, more blocks
    lab.screenshot(page, "notebook05_panel_after", locator=panel_output)

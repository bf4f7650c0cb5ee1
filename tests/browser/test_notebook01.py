"""Chapter 01 in a real browser: JupyterLab runs it and the token table appears on the page."""

from __future__ import annotations

NOTEBOOK = "notebooks/01_tokenization.ipynb"
STORY_IDS = [[6004, 957, 1462, 314], [28195, 314, 253, 3953, 4018, 1194], [28120, 665]]


def test_notebook01_runs_and_shows_the_token_table(lab):
    page = lab.open_and_run(NOTEBOOK)
    table = page.locator("table.lop-token-table")
    assert table.count() == 1, "the HTML token table did not render"
    table_text = table.inner_text()
    for ids in STORY_IDS:
        for token_id in ids:
            assert str(token_id) in table_text
    assert "Ġbeautiful" in table_text
    # the chip of each token shows its id underneath, one chip per token
    chip_ids = [int(t) for t in table.locator(".token-id").all_inner_texts()]
    assert chip_ids == [i for ids in STORY_IDS for i in ids]
    # the printed table and the merge walkthrough ran in the kernel, not just the stored outputs
    text = lab.output_text(page)
    assert "[28195, 314, 253, 3953, 4018, 1194]" in text
    assert "merge  9" in text and "ids [3953]" in text
    assert page.locator(".jp-OutputArea-output img").count() >= 1, "the BPE figure did not render"
    path = lab.screenshot(page, "notebook01_token_table", locator=table)
    assert path.stat().st_size > 10_000
    lab.close(page)

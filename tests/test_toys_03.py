"""Chapter 03's toy, the naive decoding loop written out in a cell, run against the package's ``generate_naive``.

The cell is found by its marker line (``# toy: naive loop``) and run as the notebook holds it, on a tiny random
model with SmolLM2's layout, so a drift between the toy and the package fails here although the notebook runs
separately (nbval). The check must be able to fail: a toy that keeps the first row's token instead of the last
one's gives other tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lifeofprompt import generate_naive
from lifeofprompt.lessons.tiny_models import tiny_model

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "03_decode_without_cache.ipynb"
MARKER = "# toy: naive loop"


def toy_source() -> str:
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    hits = [
        "".join(c["source"])
        for c in cells
        if c["cell_type"] == "code" and MARKER in (line.strip() for line in "".join(c["source"]).splitlines())
    ]
    assert len(hits) == 1, f"{NOTEBOOK.name}: {len(hits)} code cells marked {MARKER!r} (want one)"
    return hits[0]


def toy_loop(source: str):
    namespace: dict = {"torch": torch}  # the notebook imported torch in an earlier cell
    exec(compile(source, "<03 toy: naive loop>", "exec"), namespace)
    return namespace["naive_loop"]


@pytest.mark.parametrize("prompt", [[1, 2, 3, 4], [7], [5, 9, 11, 200, 3, 3]])
def test_the_naive_loop_toy_gives_generate_naives_tokens(prompt):
    model, _ = tiny_model(seed=0)
    assert toy_loop(toy_source())(model, prompt, 16) == generate_naive(model, prompt, 16)


def test_the_naive_loop_check_fails_on_a_broken_toy():
    source = toy_source()
    assert source.count("logits[0, -1]") == 1, "the toy no longer holds 'logits[0, -1]': update this test's change"
    broken = toy_loop(source.replace("logits[0, -1]", "logits[0, 0]"))  # the first row's token, not the last's
    model, _ = tiny_model(seed=0)
    prompt = [1, 2, 3, 4]
    assert broken(model, prompt, 16) != generate_naive(model, prompt, 16)

"""Chapter 15's numbers against chapter 05's and its exercises' checks, outside the notebook.

* One function, one answer: ``parallelism.devices_needed`` plans each rank's memory with chapter 05's card and
  share (an "80 GB" H100 reports 85.5 GB, current vLLM claims 0.92), so at ``T = 1`` it counts exactly the
  tokens 05's ``plan_memory`` gives Llama-3.1-8B on that card, and the executed chapter prints that number twice.
* The exercises: each check cell, run with the solution's answer, says "right"; with a wrong one, "not quite";
  shipped with ``None``, it only says how to answer.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from lifeofprompt.engine.memory import plan_memory
from lifeofprompt.lessons import article_arithmetic as article
from lifeofprompt.lessons import parallelism as par
from lifeofprompt.lessons.memory_arithmetic import LLAMA_3_1_8B, kv_tokens

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "15_many_devices.ipynb"


def chapter_05_tokens() -> int:
    """Chapter 05's call: Llama-3.1-8B in bf16 on the H100 as software sees it, at current vLLM's share."""
    return kv_tokens(
        plan_memory(LLAMA_3_1_8B, "bf16", int(article.H100_REPORTED_BYTES), article.GPU_MEMORY_UTILIZATION)
    )


def test_devices_needed_uses_chapter_05s_card_and_share():
    assert par.H100_SXM.memory == article.H100_REPORTED_BYTES
    counted = par.devices_needed(LLAMA_3_1_8B, "bf16", par.H100_SXM, tokens=0)
    assert counted.tensor_parallel_size == 1
    assert counted.kv_tokens == chapter_05_tokens() == 474_544
    # the old card (80e9 bytes at 0.9) gave another answer: the two chapters disagreed
    old = par.devices_needed(LLAMA_3_1_8B, "bf16", par.Card("80e9", 80e9, 3.35e12), 0, gpu_memory_utilization=0.9)
    assert old.kv_tokens != counted.kv_tokens


def cells() -> list[dict]:
    return json.loads(NOTEBOOK.read_text())["cells"]


def text_output(cell: dict) -> str:
    return "".join("".join(o.get("text", "")) for o in cell.get("outputs", []))


def test_the_chapter_prints_chapter_05s_number():
    expected = f"{chapter_05_tokens():,}"
    table = next(c for c in cells() if c["cell_type"] == "code" and "par.devices_needed(config" in "".join(c["source"]))
    printed = text_output(table)
    first_row = next(line for line in printed.splitlines() if line.startswith("meta-llama/Llama-3.1-8B"))
    assert first_row.split()[-1] == expected, first_row
    assert re.search(rf"chapter 05's plan_memory.*= {expected} tokens", printed), printed


def exercise_checks() -> list[str]:
    sources = ["".join(c["source"]) for c in cells() if c["cell_type"] == "code"]
    return [s for s in sources if "# NBVAL_CHECK_OUTPUT" in s and "answer =" in s]


SOLUTIONS = {"h200s_for_64": (4, 2), "bytes_per_rank": (28672, 16384), "idle_share": (0.273, 0.75)}


@pytest.mark.parametrize("name", sorted(SOLUTIONS))
def test_each_exercise_check_says_right_wrong_or_how(name, capsys):
    source = next(s for s in exercise_checks() if f"if {name} is None" in s)
    right, wrong = SOLUTIONS[name]
    for value, word in ((None, "Set "), (right, "right"), (wrong, "not quite")):
        exec(compile(source, f"<exercise {name}>", "exec"), {"par": par, name: value})
        printed = capsys.readouterr().out
        assert printed.startswith(word), (value, printed)

"""``scripts/lint.py``'s rules each catch a fake offender, and pass the repository as it is.

The rules themselves run in ``scripts/test.sh`` before pytest; these tests keep them honest: a rule that
could not fail would pass everything, and fails here instead.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "lint.py"
_spec = importlib.util.spec_from_file_location("repo_lint", SCRIPT)
lint = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lint)


def md(*lines: str) -> dict:
    return {"cell_type": "markdown", "source": ["\n".join(lines)]}


def code(source: str) -> dict:
    return {"cell_type": "code", "source": [source], "outputs": []}


def chapter(title: str, *cells: dict) -> dict:
    return {"cells": [md(title), *cells]}


def test_the_counter_counts_markdown_and_generated_markdown_but_not_code():
    fake = {
        "cells": [
            {"cell_type": "markdown", "source": ["One idea, drawn.\n", "```python\nx = 1  # not prose\n```\n"]},
            {"cell_type": "code", "source": ["x"], "outputs": [{"data": {"text/markdown": "Two words"}}]},
            {"cell_type": "code", "source": [], "outputs": [{"text": "printed, not counted"}]},
        ]
    }
    assert lint.prose_words(fake) == (5, 2)


def test_a_long_chapter_and_a_chapter_written_by_code_are_caught():
    long = chapter("# 01 · x", md("word " * lint.MAX_WORDS))
    assert lint.prose_too_long("01_x.ipynb", long)
    generated = chapter(
        "# 01 · x", {"cell_type": "code", "source": [], "outputs": [{"data": {"text/markdown": "w " * 61}}]}
    )
    assert lint.prose_too_long("01_x.ipynb", generated)
    assert not lint.prose_too_long("01_x.ipynb", chapter("# 01 · x", md("a short chapter")))


def test_numbering_links_and_the_chain_are_checked():
    good = {f"{n:02d}_c.ipynb": chapter(f"# {n:02d} · c", md(f"next: [on]({n + 1:02d}_c.ipynb)")) for n in range(1, 16)}
    assert not lint.misnumbered(good) and not lint.unchained(good)
    bad_title = dict(good, **{"03_c.ipynb": chapter("# Three", md("[on](04_c.ipynb)"))})
    assert lint.misnumbered(bad_title) == ["03_c.ipynb: first line is '# Three'"]
    assert lint.misnumbered({k: v for k, v in good.items() if k != "07_c.ipynb"})
    assert lint.unchained(dict(good, **{"05_c.ipynb": chapter("# 05 · c", md("no link"))})) == [
        "05_c.ipynb never links to 06_c.ipynb"
    ]
    texts = {"README.md": "[a](notebooks/01_c.ipynb) [b](notebooks/99_gone.ipynb#top)"}
    assert lint.broken_links(texts, {"01_c.ipynb"}) == [
        "README.md links to notebooks/99_gone.ipynb, which does not exist"
    ]


def test_exercises_must_come_last_with_a_cell_to_edit_and_one_that_checks():
    ok = chapter("# 01 · x", md("## Exercises", "1. do it"), code("answer = None"), code("check(answer)"))
    assert not lint.exercises_not_last("x", ok)
    assert lint.exercises_not_last("x", chapter("# 01 · x", md("no exercises")))
    one_cell = chapter("# 01 · x", md("## Exercises"), code("answer = None"))
    assert "a cell to edit" in lint.exercises_not_last("x", one_cell)[0]
    after = chapter("# 01 · x", md("## Exercises"), code("a = 1"), code("check(a)"), md("## Summary"))
    assert "sections after the exercises" in lint.exercises_not_last("x", after)[0]


def test_narrating_the_making_is_caught():
    assert lint.narrates("x", chapter("# 01 · x", md("As the seed text says, ...")))
    assert not lint.narrates("x", chapter("# 01 · x", md("As Kwon et al. write, ...")))


def test_the_code_rules_catch_offenders():
    body = "\n".join(f"    x{i} = {i}" for i in range(60))
    assert lint.long_functions(f"def f():\n{body}\n", "x.py")  # 61 lines
    inner = "\n".join(f"        x{i} = {i}" for i in range(58))
    nested = f"def outer():\n    def inner():\n{inner}\n    return inner\n"
    assert lint.long_functions(nested, "x.py")  # a nested function counts toward the one around it
    init = "class ModelRunner:\n    def __init__(self):\n" + "\n".join(f"        self.a{i} = {i}" for i in range(40))
    assert lint.long_functions(init, "model_runner.py") and not lint.long_functions(init, "other.py")
    assert lint.getattr_on_sequences_or_runner("getattr(seq, 'grammar', None)\n", "x.py")
    assert lint.getattr_on_sequences_or_runner("getattr(self.runner, 'cpu_decode_rows', 0)\n", "x.py")
    assert not lint.getattr_on_sequences_or_runner("getattr(tokenizer, 'chat_template', None)\n", "x.py")
    assert lint.missing_constructors({Path("llm_engine.py"): "class LLMEngine:\n    def __init__(self): pass\n"}) == [
        "model_runner.py: no ModelRunner.__init__ to check"
    ]


def test_the_repository_as_it_is_passes_every_rule():
    done = lint.checks()
    assert len(done) > 100 and [problem for _, found in done for problem in found] == []

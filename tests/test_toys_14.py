"""Chapter 14's toy and exercises, outside the notebook.

The toy's printed run is compared exactly by nbval (``# NBVAL_CHECK_OUTPUT``), so it must not hinge on the last
bits of a float: another CPU (another vector width for softmax, exp or log) may round differently. Every decision
in the printed run is checked here to be far from a tie. The exercises' check cells must say "right" to the
solution, "not quite" to a wrong answer, and how to answer when nothing is set.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "14_speculative_decoding.ipynb"
TOY, CHECK = "# toy: speculative accept/reject/rollback", "# check: speculative accept/reject/rollback"
ACCEPT = "if u[i] >= min(1.0, p[i, x] / q[i, x]):"
RECORD = "margins.append(abs(float(u[i]) - min(1.0, float(p[i, x] / q[i, x]))))\n        "


def code_cells() -> list[str]:
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    return ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]


def cell_with(text: str) -> str:
    hits = [s for s in code_cells() if text in s]
    assert len(hits) == 1, f"{len(hits)} code cells hold {text!r}"
    return hits[0]


def run(*sources: str, namespace: dict | None = None) -> dict:
    namespace = {"__name__": "chapter14"} if namespace is None else namespace
    for source in sources:
        exec(compile(source, "<chapter 14>", "exec"), namespace)
    return namespace


def test_the_printed_toy_run_has_no_near_ties(monkeypatch, capsys):
    """Each draw is an argmax of p / Exp(1) (torch.multinomial's one-sample rule) and each acceptance a
    comparison of u with p/q: both winners must lead by far more than any rounding."""
    margins = []
    multinomial = torch.multinomial

    def recorded(p, n, generator):
        exponential = torch.empty_like(p).exponential_(1, generator=torch.Generator().set_state(generator.get_state()))
        ratio = (p / exponential).double().sort(descending=True).values
        margins.append(float((ratio[0] - ratio[1]) / ratio[0]))
        return multinomial(p, n, generator=generator)

    monkeypatch.setattr(torch, "multinomial", recorded)
    toy = cell_with(TOY)
    assert toy.count(ACCEPT) == 1, "the toy's acceptance line changed: update this test"
    watched = toy.replace(ACCEPT, RECORD + ACCEPT)
    run(watched, namespace={"__name__": "chapter14", "margins": margins})
    printed = capsys.readouterr().out
    assert "4 of 4 accepted" in printed and "ten tokens:" in printed
    assert len(margins) > 10 and min(margins) > 1e-3, sorted(margins)[:3]


def test_multinomial_draws_the_argmax_of_p_over_exponentials():
    """The rule the margin test relies on."""
    for seed in range(50):
        p = torch.softmax(torch.randn(10, generator=torch.Generator().manual_seed(100 + seed)), dim=-1)
        drawn = int(torch.multinomial(p, 1, generator=torch.Generator().manual_seed(seed)))
        exponential = torch.empty_like(p).exponential_(1, generator=torch.Generator().manual_seed(seed))
        assert drawn == int(torch.argmax(p / exponential))


def test_exercise_checks_answer_right_wrong_and_unset(capsys):
    from lifeofprompt.lessons import speculation as spec

    namespace = run(cell_with(TOY), cell_with(CHECK))
    namespace["spec"] = spec
    checks = [
        (cell_with("target, draft = [5, 3, 8, 1, 9]"), {"my_accepted": 2, "my_kept": [5, 3, 8]}, {"my_accepted": 3}),
        (cell_with("best_k = max(speedups"), {"my_best_k": 3}, {"my_best_k": 4}),
    ]
    for check, solution, wrong in checks:
        capsys.readouterr()
        run(check, namespace=namespace | {k: None for k in solution})
        assert capsys.readouterr().out.startswith("set ")
        run(check, namespace=namespace | solution)
        assert capsys.readouterr().out.startswith("right")
        run(check, namespace=namespace | solution | wrong)
        assert capsys.readouterr().out.startswith("not quite")

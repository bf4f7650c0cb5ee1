"""Where the test suite's time goes: the slowest tests, and the time by file and by kind.

Run the suite with a JUnit report (``pytest tests notebooks ... --junitxml=suite.xml``), then:

    python benchmarks/suite_durations.py suite.xml --out benchmarks/results/suite_durations_<cpu>_<date>

Each test is put in one kind, the first that fits: a notebook run by nbval, a browser test, one that
starts ranks (``ranks``), server fuzzing, Triton's interpreter or the C kernels (read from what its file
imports: ``IMPORTED_KINDS``), one marked ``slow``, else a unit test. Marks are read by collecting the
suite again with ``-m`` (no test runs). The table goes to stdout and, with ``--out``, to ``<out>.md`` and
``<out>.json``.
"""

from __future__ import annotations

import argparse
import collections
import json
import platform
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MARKS = ("browser", "ranks", "slow")


def read_junit(path: Path) -> list[dict]:
    """One entry per test case: its node id (file::name), its file and its seconds."""
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        name = case.get("name", "")
        cases.append(dict(file=file_of(case.get("classname", "")), name=name, seconds=float(case.get("time", 0.0))))
    return cases


def file_of(classname: str) -> str:
    """The file a JUnit class name comes from: ``tests.test_x.TestY`` -> ``tests/test_x.py``; a notebook's
    cells (``notebooks.01_tokenizer.ipynb``) -> the notebook."""
    parts = classname.split(".")
    if parts[-1] == "ipynb":
        return "/".join(parts[:-1]) + ".ipynb"
    for end in range(len(parts), 0, -1):
        candidate = "/".join(parts[:end]) + ".py"
        if (REPO / candidate).exists():
            return candidate
    return classname


def marked_tests(mark: str) -> set[tuple[str, str]]:
    """``(file, test function)`` of every test carrying ``mark`` (parameters and classes dropped, as JUnit's
    names have no class), collected without running."""
    command = [sys.executable, "-m", "pytest", "tests", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", mark]
    out = subprocess.run(command, cwd=REPO, capture_output=True, text=True).stdout
    nodes = [line.strip().split("::") for line in out.splitlines() if "::" in line]
    return {(parts[0], parts[-1].split("[")[0]) for parts in nodes}


def files_importing(pattern: str) -> set[str]:
    """Test files whose source matches ``pattern`` (an import of what makes their kind)."""
    found = re.compile(pattern)
    return {str(p.relative_to(REPO)) for p in (REPO / "tests").rglob("test_*.py") if found.search(p.read_text())}


# Kinds read from what a file imports: Triton's kernels (run under TRITON_INTERPRET=1 without a GPU), the server
# fuzzer, and the C kernels (compiled once per machine into the cache, then loaded).
IMPORTED_KINDS = {
    "server fuzzing": r"import schemathesis|from schemathesis",
    "Triton interpreter": r"lifeofprompt\.kernels|from lifeofprompt import kernels",
    "C kernels": r"lifeofprompt\.cpu\.(c_step|block_kernels|row_kernels|native_build)",
}


def kind_of(case: dict, marked: dict[str, set[tuple[str, str]]], imported: dict[str, set[str]]) -> str:
    """The first that fits: a notebook, a browser test, one that starts ranks, one whose file imports what makes
    a kind (``IMPORTED_KINDS``, in order), one marked slow, else a unit test."""
    test = (case["file"], case["name"].split("[")[0])
    if case["file"].endswith(".ipynb"):
        return "notebooks (nbval)"
    for mark, kind in (("browser", "browser"), ("ranks", "spawned ranks")):
        if test in marked[mark]:
            return kind
    for kind, files in imported.items():
        if case["file"] in files:
            return kind
    return "slow (other)" if test in marked["slow"] else "unit"


def table(
    cases: list[dict], marked: dict[str, set[tuple[str, str]]], imported: dict[str, set[str]]
) -> tuple[str, dict]:
    total = sum(c["seconds"] for c in cases)
    by_kind, by_file = collections.Counter(), collections.Counter()
    count_kind = collections.Counter()
    for c in cases:
        kind = kind_of(c, marked, imported)
        by_kind[kind] += c["seconds"]
        count_kind[kind] += 1
        by_file[c["file"]] += c["seconds"]
    lines = [f"{len(cases)} tests, {total / 60:.1f} min of test time (the sum of each test's own time)", ""]
    lines += ["| kind | tests | minutes | share |", "|---|---|---|---|"]
    for kind, seconds in by_kind.most_common():
        lines.append(f"| {kind} | {count_kind[kind]} | {seconds / 60:.1f} | {seconds / total:.0%} |")
    lines += ["", "| file | minutes |", "|---|---|"]
    lines += [f"| {file} | {seconds / 60:.2f} |" for file, seconds in by_file.most_common(40)]
    lines += ["", "| the slowest 40 tests | seconds |", "|---|---|"]
    for c in sorted(cases, key=lambda c: -c["seconds"])[:40]:
        lines.append(f"| {c['file']}::{c['name']} | {c['seconds']:.1f} |")
    data = dict(total_s=total, by_kind=dict(by_kind), by_file=dict(by_file), tests=len(cases))
    return "\n".join(lines), data


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("junit", type=Path)
    parser.add_argument("--out", type=Path, help="write <out>.md and <out>.json")
    parser.add_argument("--title", default="", help="the run: machine, commit, wall time")
    args = parser.parse_args(argv)
    cases = read_junit(args.junit)
    marked = {mark: marked_tests(mark) for mark in MARKS}
    imported = {kind: files_importing(pattern) for kind, pattern in IMPORTED_KINDS.items()}
    text, data = table(cases, marked, imported)
    cpu = platform.processor() or platform.machine()
    text = f"# The test suite's time: {args.title or cpu}\n\n{text}\n"
    print(text)
    if args.out:
        args.out.with_suffix(".md").write_text(text)
        args.out.with_suffix(".json").write_text(json.dumps(data, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

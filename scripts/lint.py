"""The repository's own rules, the ones ruff does not know: chapters a chapter's length, a series that holds
together, and a core that reads in short pieces. They read files (JSON and ``ast``), so they run in a second
without pytest; ``scripts/test.sh`` runs them after ruff, in both tiers. ``tests/test_lint_rules.py`` shows each
rule catching a fake offender, so a rule that could never fail would fail there.

    python scripts/lint.py        prints every broken rule and exits 1 if there is one
"""

from __future__ import annotations

import ast
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"

# ---- chapters: about 2,000 words of prose, at most a few sentences of them written by code ----------------
# Prose is what a reader reads as text: the Markdown cells (code blocks in them left out) and the Markdown that
# code cells display (``text/markdown`` outputs, English assembled by the notebook). Appendix notebooks are exempt.
MAX_WORDS, MAX_GENERATED_WORDS = 2_200, 60
WORD = re.compile(r"[A-Za-z0-9][\w'’.,-]*")
FENCED_CODE = re.compile(r"```.*?```", re.S)


def words(text: str) -> int:
    return len(WORD.findall(text))


def prose_words(notebook: dict) -> tuple[int, int]:
    """``(all prose words, generated ones)`` of a notebook as nbformat's JSON."""
    written = generated = 0
    for cell in notebook["cells"]:
        if cell["cell_type"] == "markdown":
            written += words(FENCED_CODE.sub("", "".join(cell["source"])))
        for output in cell.get("outputs", []):
            generated += words("".join(output.get("data", {}).get("text/markdown", "")))
    return written + generated, generated


def prose_too_long(name: str, notebook: dict) -> list[str]:
    total, generated = prose_words(notebook)
    found = []
    if total > MAX_WORDS:
        found.append(f"{name}: {total} words of prose (at most {MAX_WORDS})")
    if generated > MAX_GENERATED_WORDS:
        found.append(f"{name}: {generated} words of prose written by code (at most {MAX_GENERATED_WORDS})")
    return found


# ---- the series: numbered chapters, links that resolve, exercises last, no narration of its making ---------
LINK = re.compile(r"\]\(((?:notebooks/)?[\w.-]+\.ipynb)(?:#[^)]*)?\)")
# Words that narrate the project's making, or name the two articles as what they were to us.
PROCESS_TALK = re.compile(
    r"seed texts?|the (?:first|second) seed|rerun at|wired in|now warms up|as stored for this project"
    r"|our first torch path|in this session",
    re.I,
)


def markdown(notebook: dict) -> list[str]:
    return ["".join(c["source"]) for c in notebook["cells"] if c["cell_type"] == "markdown"]


def misnumbered(chapters: dict[str, dict]) -> list[str]:
    """Chapters are 01 to 15, each titled ``# NN · ...``."""
    names = sorted(chapters)
    found = [] if [n[:2] for n in names] == [f"{i:02d}" for i in range(1, 16)] else [f"chapters are {names}"]
    for name in names:
        title = markdown(chapters[name])[0].splitlines()[0]
        if not title.startswith(f"# {name[:2]} · "):
            found.append(f"{name}: first line is {title!r}")
    return found


def broken_links(texts: dict[str, str], existing: set[str]) -> list[str]:
    """Every ``](...ipynb)`` link names a notebook that exists."""
    return [
        f"{name} links to {target}, which does not exist"
        for name, text in texts.items()
        for target in LINK.findall(text)
        if Path(target).name not in existing
    ]


def unchained(chapters: dict[str, dict]) -> list[str]:
    """Each chapter but the first is linked from the one before."""
    names = sorted(chapters)
    return [
        f"{before} never links to {after}"
        for before, after in zip(names, names[1:])
        if after not in "\n".join(markdown(chapters[before]))
    ]


def exercises_not_last(name: str, notebook: dict) -> list[str]:
    """A chapter ends with '## Exercises': a cell to edit and a cell that checks it, and no section after."""
    cells = notebook["cells"]
    starts = [
        i
        for i, c in enumerate(cells)
        if c["cell_type"] == "markdown" and re.search(r"^## Exercises", "".join(c["source"]), re.M)
    ]
    if not starts:
        return [f"{name} has no '## Exercises' section"]
    after = cells[starts[-1] + 1 :]
    found = []
    if len([c for c in after if c["cell_type"] == "code" and "".join(c["source"]).strip()]) < 2:
        found.append(f"{name}: the exercises need a cell to edit and a cell that checks it")
    heading_cell = "".join(cells[starts[-1]]["source"])
    rest = [heading_cell[heading_cell.index("## Exercises") :]]
    rest += ["".join(c["source"]) for c in after if c["cell_type"] == "markdown"]
    later = [h for text in rest for h in re.findall(r"^## .*", text, re.M) if h != "## Exercises"]
    if later:
        found.append(f"{name}: sections after the exercises (the chapter must end with them): {later}")
    return found


def narrates(name: str, notebook: dict) -> list[str]:
    found = [m.group(0) for text in markdown(notebook) for m in PROCESS_TALK.finditer(text)]
    return [f"{name} narrates its making: {found}"] if found else []


# ---- the core: short functions, short constructors, declared fields ---------------------------------------
CORE = [ROOT / "lifeofprompt" / folder for folder in ("engine", "model", "distributed", "serving")]
MAX_LINES, MAX_INIT_LINES = 60, 40  # nested functions count toward the one around them
SHORT_INITS = {("llm_engine.py", "LLMEngine"), ("model_runner.py", "ModelRunner")}


def functions(source: str):
    """``(class name or "", function name, lines)`` of every top-level function and method."""
    for node in ast.parse(source).body:
        owners = [(node.name, node.body)] if isinstance(node, ast.ClassDef) else [("", [node])]
        for owner, body in owners:
            for item in body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    yield owner, item.name, item.end_lineno - item.lineno + 1


def long_functions(source: str, filename: str) -> list[str]:
    found = []
    for owner, name, lines in functions(source):
        limit = MAX_INIT_LINES if name == "__init__" and (filename, owner) in SHORT_INITS else MAX_LINES
        if lines > limit:
            found.append(f"{filename}: {owner + '.' if owner else ''}{name} has {lines} lines (at most {limit})")
    return found


def getattr_on_sequences_or_runner(source: str, filename: str) -> list[str]:
    """``getattr(x, "field"...)`` where x names a sequence or the runner: the field should be declared."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr":
            target = ast.unparse(node.args[0])
            if target in ("seq", "s", "sequence", "runner", "self.runner") or target.endswith((".seq", ".runner")):
                found.append(f"{filename}:{node.lineno} getattr({target}, ...)")
    return found


def missing_constructors(sources: dict[Path, str]) -> list[str]:
    """The two constructors the length rule names must exist, or the rule checks nothing."""
    seen = {(path.name, owner) for path, source in sources.items() for owner, name, _ in functions(source)}
    seen = {key for key in seen if key in SHORT_INITS}
    return [f"{file}: no {owner}.__init__ to check" for file, owner in sorted(SHORT_INITS - seen)]


# ---- running them ------------------------------------------------------------------------------------------
def checks() -> list[tuple[str, list[str]]]:
    """``(what was checked, problems)`` for every rule on every file it applies to."""
    notebooks = {p.name: json.loads(p.read_text()) for p in sorted(NOTEBOOKS.glob("*.ipynb"))}
    chapters = {name: nb for name, nb in notebooks.items() if name[:2].isdigit()}
    texts = {name: "\n".join(markdown(nb)) for name, nb in notebooks.items()}
    texts["README.md"] = (ROOT / "README.md").read_text()
    sources = {path: path.read_text() for folder in CORE for path in sorted(folder.rglob("*.py"))}
    done = [
        ("chapters numbered 01-15", misnumbered(chapters)),
        ("links to notebooks", broken_links(texts, set(notebooks))),
        ("chapters chained", unchained(chapters)),
        ("the two short constructors exist", missing_constructors(sources)),
    ]
    for name, notebook in chapters.items():
        done.append((f"{name}: prose length", prose_too_long(name, notebook)))
        done.append((f"{name}: exercises last", exercises_not_last(name, notebook)))
    done += [(f"{name}: no narration", narrates(name, notebook)) for name, notebook in notebooks.items()]
    for path, source in sources.items():
        where = path.relative_to(ROOT)
        done.append((f"{where}: short functions", long_functions(source, path.name)))
        done.append((f"{where}: declared fields", getattr_on_sequences_or_runner(source, path.name)))
    return done


def main() -> int:
    done = checks()
    problems = [problem for _, found in done for problem in found]
    for problem in problems:
        print(problem)
    print(f"lint: {len(done)} checks, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

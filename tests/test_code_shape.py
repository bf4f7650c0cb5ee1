"""The core reads in short pieces: no function over 60 lines in engine/, model/, distributed/ or serving/
(nested functions count toward the one around them), the engine's and the runner's constructors at most 40,
and nothing reaches a sequence's or the runner's fields through ``getattr`` (every field is declared).
Read from the source (``ast``); each rule is also shown to catch a fake offender.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CORE = [REPO / "lifeofprompt" / folder for folder in ("engine", "model", "distributed", "serving")]
MAX_LINES, MAX_INIT_LINES = 60, 40
SHORT_INITS = {("llm_engine.py", "LLMEngine"), ("model_runner.py", "ModelRunner")}


def functions(source: str, filename: str):
    """``(class name or "", function name, lines)`` of every top-level function and method."""
    tree = ast.parse(source)
    for node in tree.body:
        owners = [(node.name, node.body)] if isinstance(node, ast.ClassDef) else [("", [node])]
        for owner, body in owners:
            for item in body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    yield owner, item.name, item.end_lineno - item.lineno + 1


def long_functions(source: str, filename: str) -> list[str]:
    found = []
    for owner, name, lines in functions(source, filename):
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


def core_files():
    for folder in CORE:
        yield from sorted(folder.rglob("*.py"))


def test_no_core_function_is_long():
    found = [p for path in core_files() for p in long_functions(path.read_text(), path.name)]
    assert not found, "\n".join(found)


def test_the_constructors_read_as_lists_of_steps():
    lengths = {}
    for path in core_files():
        for owner, name, lines in functions(path.read_text(), path.name):
            if (path.name, owner) in SHORT_INITS and name == "__init__":
                lengths[owner] = lines
    assert set(lengths) == {"LLMEngine", "ModelRunner"} and max(lengths.values()) <= MAX_INIT_LINES, lengths


def test_no_getattr_on_a_sequence_or_the_runner():
    found = [p for path in core_files() for p in getattr_on_sequences_or_runner(path.read_text(), path.name)]
    assert not found, "\n".join(found)


def test_the_rules_catch_offenders():
    body = "\n".join(f"    x{i} = {i}" for i in range(60))
    assert long_functions(f"def f():\n{body}\n", "x.py")  # 61 lines
    inner = "\n".join(f"        x{i} = {i}" for i in range(58))
    nested = f"def outer():\n    def inner():\n{inner}\n    return inner\n"
    assert long_functions(nested, "x.py")  # a nested function counts toward the one around it
    init = "class ModelRunner:\n    def __init__(self):\n" + "\n".join(f"        self.a{i} = {i}" for i in range(40))
    assert long_functions(init, "model_runner.py") and not long_functions(init, "other.py")
    assert getattr_on_sequences_or_runner("getattr(seq, 'grammar', None)\n", "x.py")
    assert getattr_on_sequences_or_runner("getattr(self.runner, 'cpu_decode_rows', 0)\n", "x.py")
    assert not getattr_on_sequences_or_runner("getattr(tokenizer, 'chat_template', None)\n", "x.py")

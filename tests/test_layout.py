"""The package's folders are its layers: imports run only downward, never in a circle, and
``import lifeofprompt`` stays light. Read from the code's own imports (``ast``), those inside
functions included, so a change that breaks a rule fails here with the offending line named.

Each rule is a plain function over a table of imports; the tests feed it the package's real
imports (nothing may be reported) and then one fake offending import (it must be reported).
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "lifeofprompt"
KERNELS = REPO / "kernels"  # installed as lifeofprompt.kernels

# From the bottom up. A module may import its own layer and the layers below it, nothing above.
LAYERS = [
    (
        "base",
        {
            "lifeofprompt.errors",
            "lifeofprompt.env",
            "lifeofprompt.story",
            "lifeofprompt.texts",
            "lifeofprompt.units",
            "lifeofprompt.latency",
            "lifeofprompt._version",
        },
    ),
    ("model", {"lifeofprompt.model", "lifeofprompt.cpu", "lifeofprompt.kernels"}),  # cpu/: the CPU's speed work
    ("distributed", {"lifeofprompt.distributed"}),  # the model over processes
    ("engine", {"lifeofprompt.engine"}),
    ("serving", {"lifeofprompt.serving"}),
    ("loadtest", {"lifeofprompt.loadtest"}),  # the server's client side: arrivals, latency, the load tester
    ("lessons", {"lifeofprompt.lessons"}),
    ("figures", {"lifeofprompt.figures"}),
    ("front doors", {"lifeofprompt", "lifeofprompt.__main__", "lifeofprompt.cli", "lifeofprompt.commands"}),
]
HEAVY = {
    "matplotlib",
    "ipywidgets",
    "IPython",
    "fastapi",
    "uvicorn",
    "triton",
    "transformers",
    "outlines",
    "xgrammar",
    "lark",
    "llguidance",
}


@dataclass(frozen=True)
class Import:
    importer: str  # lifeofprompt.engine.scheduler
    path: str  # lifeofprompt/engine/scheduler.py
    line: int
    text: str  # the statement as written
    target: str  # the module it loads: lifeofprompt.engine.block_manager

    def __str__(self) -> str:
        return f"{self.path}:{self.line} `{self.text}` imports {self.target}"


# ----------------------------------------------------------------------------- reading the imports


def module_name(path: Path) -> tuple[str, bool]:
    """``lifeofprompt/engine/scheduler.py`` -> ``('lifeofprompt.engine.scheduler', False)``; kernels/ is
    lifeofprompt.kernels."""
    if path.is_relative_to(KERNELS):
        parts = ["lifeofprompt", "kernels", *path.relative_to(KERNELS).with_suffix("").parts]
    else:
        parts = ["lifeofprompt", *path.relative_to(PACKAGE).with_suffix("").parts]
    is_package = parts[-1] == "__init__"
    return ".".join(parts[:-1] if is_package else parts), is_package


def package_files() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py")) + sorted(KERNELS.rglob("*.py"))


def known_modules() -> set[str]:
    return {module_name(path)[0] for path in package_files()}


def ours(name: str | None) -> bool:
    return name is not None and (name == "lifeofprompt" or name.startswith("lifeofprompt."))


def imports_of(source: str, module: str, is_package: bool, path: str, known: set[str]) -> list[Import]:
    """Every import of a lifeofprompt module in ``source``, at any depth, relative ones resolved."""
    lines = source.splitlines()
    here = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names if ours(alias.name)]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = here.split(".")
                assert node.level <= len(parts), f"{path}:{node.lineno} imports from above the package"
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module
            if not ours(base):
                continue
            # ``from .x import y``: y is a module when there is one by that name, else a name in x
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        text = " ".join(line.strip() for line in lines[node.lineno - 1 : node.end_lineno])
        found += [Import(module, path, node.lineno, text, t) for t in dict.fromkeys(targets)]
    return found


def package_imports() -> list[Import]:
    known = known_modules()
    found = []
    for path in package_files():
        module, is_package = module_name(path)
        found += imports_of(path.read_text(), module, is_package, str(path.relative_to(REPO)), known)
    return found


def fake(source: str, module: str, siblings: tuple[str, ...] = ()) -> list[Import]:
    """The imports of a module that does not exist, as if it sat in the package (for the failing cases)."""
    return imports_of(source, module, False, module.replace(".", "/") + ".py", known_modules() | set(siblings))


# ----------------------------------------------------------------------------- the rules


def layer_of(module: str) -> tuple[int, str] | None:
    for rank, (name, members) in enumerate(LAYERS):
        for member in members:
            if module == member or (member != "lifeofprompt" and module.startswith(member + ".")):
                return rank, name
    return None


def layer_violations(imports: list[Import]) -> list[str]:
    problems = []
    for imp in imports:
        low, high = layer_of(imp.target), layer_of(imp.importer)
        if high is None:
            problems.append(f"{imp.importer} is in no layer: add it to LAYERS in tests/test_layout.py")
        elif low is None:
            problems.append(f"{imp}, which is in no layer")
        elif low[0] > high[0]:
            problems.append(f"{imp}: {high[1]} may not import {low[1]}, a layer above it")
    return sorted(set(problems))


KERNEL_USERS = ("lifeofprompt.model.", "lifeofprompt.lessons.")


def kernel_violations(imports: list[Import]) -> list[str]:
    """Only model/ (the attention backend, the fused layers) and lessons/ (chapter 11 runs one launch and
    draws its tiles) load the Triton kernels: the engine's way to them is the model's."""

    def kernels(name):
        return name == "lifeofprompt.kernels" or name.startswith("lifeofprompt.kernels.")

    return [
        f"{imp}: only lifeofprompt/model/ (and the chapters' lessons/) may import the kernels"
        for imp in imports
        if kernels(imp.target) and not kernels(imp.importer) and not imp.importer.startswith(KERNEL_USERS)
    ]


def cpu_violations(imports: list[Import]) -> list[str]:
    """The CPU's speed work (``cpu/``) is entered through ``model/loader.py: prepare_for_device`` only:
    engine/ and distributed/ import nothing from it, so their seams are not shaped by it."""
    return [
        f"{imp}: engine/ and distributed/ reach cpu/ through model/loader.py: prepare_for_device"
        for imp in imports
        if (imp.target == "lifeofprompt.cpu" or imp.target.startswith("lifeofprompt.cpu."))
        and imp.importer.startswith(("lifeofprompt.engine.", "lifeofprompt.distributed."))
    ]


def find_cycle(imports: list[Import]) -> list[Import] | None:
    """One circle of imports (each edge with its line), or None.

    Loading ``lifeofprompt.kernels.fused`` first runs ``lifeofprompt/kernels/__init__.py``, so an
    import also leads to the packages above its target; all but ``lifeofprompt`` itself, whose
    ``__init__`` gathers the public names from everywhere and has always run first (importing it
    by name still counts).
    """
    edges: dict[str, dict[str, Import]] = {}
    for imp in imports:
        parts = imp.target.split(".")
        above = [".".join(parts[:n]) for n in range(2, len(parts))]
        for target in [imp.target, *(p for p in above if not imp.importer.startswith(p + "."))]:
            if target != imp.importer:
                edges.setdefault(imp.importer, {}).setdefault(target, imp)
    state: dict[str, str] = {}
    path: list[Import] = []

    def visit(node: str) -> list[Import] | None:
        state[node] = "open"
        for target, imp in sorted(edges.get(node, {}).items()):
            if state.get(target) == "open":
                start = next(i for i, step in enumerate(path) if step.importer == target)
                return path[start:] + [imp]
            if target not in state:
                path.append(imp)
                found = visit(target)
                if found:
                    return found
                path.pop()
        state[node] = "done"
        return None

    for node in sorted(edges):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def heavy_modules_after(code: str) -> list[str]:
    """Run ``code`` in a fresh interpreter; which of the heavy libraries did it leave in ``sys.modules``?"""
    loaded = "{m.split('.')[0] for m in sys.modules}"
    probe = f"{code}\nimport sys\nprint(' '.join(sorted({loaded} & set({sorted(HEAVY)!r}))))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.split()


# ----------------------------------------------------------------------------- the package keeps them


def test_layers_import_only_downward():
    problems = layer_violations(package_imports())
    assert not problems, "imports against the layers:\n" + "\n".join(problems)


def test_no_import_circles():
    cycle = find_cycle(package_imports())
    assert cycle is None, "an import circle:\n" + "\n".join(map(str, cycle))


def test_only_model_imports_the_kernels():
    problems = kernel_violations(package_imports())
    assert not problems, "\n".join(problems)


def test_engine_and_distributed_import_nothing_from_cpu():
    problems = cpu_violations(package_imports())
    assert not problems, "\n".join(problems)
    fake_import = fake("def f():\n    from ..cpu import c_step\n", "lifeofprompt.engine.fake")
    assert cpu_violations(fake_import) == [
        "lifeofprompt/engine/fake.py:2 `from ..cpu import c_step` imports lifeofprompt.cpu.c_step: "
        "engine/ and distributed/ reach cpu/ through model/loader.py: prepare_for_device"
    ]
    assert cpu_violations(fake("from ..cpu import c_step\n", "lifeofprompt.model.fake")) == []


def test_import_lifeofprompt_loads_no_heavy_library():
    heavy = heavy_modules_after("import lifeofprompt\nfrom lifeofprompt import LLM, SamplingParams, load_model")
    assert heavy == [], f"`import lifeofprompt` loaded {heavy}; import them inside the functions that need them"


def test_subpackage_inits_only_name_their_public_face():
    for init in sorted(PACKAGE.glob("*/__init__.py")):
        tree = ast.parse(init.read_text())
        doc = ast.get_docstring(tree) or ""
        assert len(tree.body) == 1 and doc, f"{init.relative_to(REPO)}: a docstring only, no eager imports"
        lines = [line for line in doc.splitlines() if line.strip()]
        assert 2 <= len(lines) <= 3, f"{init.relative_to(REPO)}: two or three lines naming the public face"


def test_every_module_opens_with_a_docstring():
    missing = [str(p.relative_to(REPO)) for p in package_files() if not ast.get_docstring(ast.parse(p.read_text()))]
    assert not missing, f"modules without an opening docstring: {missing}"


def test_pyproject_lists_every_subpackage():
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {p for p in PACKAGE.rglob("*") if p.is_dir() and p.name != "__pycache__" and any(p.glob("*.py"))}
    assert all((folder / "__init__.py").exists() for folder in folders), "every folder of modules is a package"
    on_disk = {"lifeofprompt", "lifeofprompt.kernels"} | {module_name(f / "__init__.py")[0] for f in folders}
    assert listed == on_disk


def modules_missing_from_the_diagram(readme: str) -> list[str]:
    """The subpackages' modules that the README's package diagram (the block under "## The package") omits."""
    block = readme.split("## The package", 1)[1].split("```", 2)[1]
    words = set(re.findall(r"[A-Za-z_]+", block))
    modules = [p for p in PACKAGE.rglob("*.py") if p.parent != PACKAGE and p.name != "__init__.py"]
    return [str(p.relative_to(PACKAGE)) for p in modules if p.stem not in words]


def test_the_readme_diagram_names_every_module():
    readme = (REPO / "README.md").read_text()
    assert modules_missing_from_the_diagram(readme) == []
    assert modules_missing_from_the_diagram(readme.replace("cuda_graphs", "")) == ["engine/cuda_graphs.py"]


def test_public_names_stay_at_the_top():
    import lifeofprompt
    from lifeofprompt import errors

    for name in [
        "LLM",
        "SamplingParams",
        "LLMEngine",
        "load_model",
        "generate_cached",
        "generate_naive",
        "RequestOutput",
        "ModelConfig",
        "env_report",
        "__version__",
    ]:
        assert hasattr(lifeofprompt, name), name
    exported = {
        name
        for name in dir(errors)
        if isinstance(getattr(errors, name), type)
        and issubclass(getattr(errors, name), Exception)
        and getattr(errors, name).__module__ == errors.__name__
    }
    assert exported <= set(lifeofprompt.__all__) and all(hasattr(lifeofprompt, n) for n in lifeofprompt.__all__)


def test_the_story_prompts_live_in_one_place():
    from lifeofprompt.story import STORY_PROMPTS

    assert STORY_PROMPTS == ("hi my name is", "today is a beautiful summer day", "hello there")
    files = [*package_files(), *sorted((REPO / "tests").rglob("*.py")), *sorted((REPO / "benchmarks").glob("*.py"))]
    # a copy is the name assigned again, or the three prompts written out again side by side
    copy = re.compile(
        r"STORY_PROMPTS = |" + r",\s*".join(re.escape(repr(t)).replace("'", "[\"']") for t in STORY_PROMPTS)
    )
    holders = [str(p.relative_to(REPO)) for p in files if p != Path(__file__).resolve() and copy.search(p.read_text())]
    assert holders == ["lifeofprompt/story.py"]
    assert copy.search('STORY = ["hi my name is", "today is a beautiful summer day", "hello there"]')  # it can fail


# ----------------------------------------------------------------------------- and each rule can fail


def test_a_layer_violation_is_named_even_inside_a_function():
    imports = fake("def trace():\n    from ..figures.engine import live_trace\n", "lifeofprompt.engine.fake")
    assert layer_violations(imports) == [
        "lifeofprompt/engine/fake.py:2 `from ..figures.engine import live_trace` imports lifeofprompt.figures.engine: "
        "engine may not import figures, a layer above it"
    ]
    # absolute, and the old tokenization -> cli import for STORY_PROMPTS
    assert (
        "model may not import serving"
        in layer_violations(fake("import lifeofprompt.serving.server\n", "lifeofprompt.model.fake"))[0]
    )
    assert (
        "model may not import front doors"
        in layer_violations(fake("from ..cli import build_parser\n", "lifeofprompt.model.fake"))[0]
    )
    assert "is in no layer" in layer_violations(fake("from .errors import ConfigError\n", "lifeofprompt.newcomer"))[0]


def test_a_circle_is_found_with_its_lines():
    # the circle this layout removed: commands imported STORY_PROMPTS from cli, which imports commands
    others = [imp for imp in package_imports() if imp.importer != "lifeofprompt.commands"]
    cycle = find_cycle(others + fake("from .cli import build_parser\n", "lifeofprompt.commands"))
    assert cycle is not None
    assert {(imp.importer, imp.target) for imp in cycle} == {
        ("lifeofprompt.cli", "lifeofprompt.commands"),
        ("lifeofprompt.commands", "lifeofprompt.cli"),
    }
    assert any("from . import commands" in str(imp) for imp in cycle)
    # and the env <-> __init__ one: env_info read the version from the package it is imported by
    others = [imp for imp in package_imports() if imp.importer != "lifeofprompt.env"]
    cycle = find_cycle(others + fake("def env_info():\n    from . import __version__\n", "lifeofprompt.env"))
    assert cycle is not None and cycle[0].importer == "lifeofprompt"  # through whichever module imports env
    assert "lifeofprompt/env.py:2 `from . import __version__` imports lifeofprompt" in [str(imp) for imp in cycle]
    # a longer one, closed by an import inside a function
    imports = (
        fake("from .b import x\n", "lifeofprompt.engine.a")
        + fake("def f():\n    from . import c\n", "lifeofprompt.engine.b", siblings=("lifeofprompt.engine.c",))
        + fake("from .a import y\n", "lifeofprompt.engine.c")
    )
    assert [imp.line for imp in find_cycle(imports)] == [1, 2, 1]


def test_kernels_imported_outside_model_is_named():
    problems = kernel_violations(fake("def f():\n    from ..kernels import fused\n", "lifeofprompt.engine.fake"))
    assert problems == [
        "lifeofprompt/engine/fake.py:2 `from ..kernels import fused` imports lifeofprompt.kernels.fused: "
        "only lifeofprompt/model/ (and the chapters' lessons/) may import the kernels"
    ]
    assert kernel_violations(fake("from ..kernels import fused\n", "lifeofprompt.model.fake")) == []


def test_a_heavy_import_is_caught():
    # a stand-in module, so the check is shown failing without paying for the real import
    assert heavy_modules_after(
        "import sys, types\nsys.modules['uvicorn.config'] = types.ModuleType('uvicorn.config')\nimport lifeofprompt"
    ) == ["uvicorn"]


# The runner's surface outside engine/: a step (execute), its flat batch (prepare, which chapter 10 shows
# and tests feed straight to the model), and the decode graphs (start_decode_graphs, chapter 11).
RUNNER_DOORS = {"execute", "prepare", "start_decode_graphs"}


def runner_methods_called(text: str) -> set[str]:
    """The ``ModelRunner`` methods called on a ``runner`` (``runner.x(``, ``engine.runner.x(``) in ``text``
    (``runner.model(...)`` calls the model, an attribute, not the runner)."""
    from lifeofprompt.engine.model_runner import ModelRunner

    names = set(re.findall(r"\brunner\.([a-z_]+)\(", text))
    return {name for name in names if callable(getattr(ModelRunner, name, None))}


def test_the_runner_is_driven_through_three_methods_outside_the_engine():
    outside = [p for p in package_files() if "engine" not in p.relative_to(REPO).parts]
    outside += [p for p in (REPO / "tests").rglob("*.py") if p.name != "test_layout.py"]
    outside += list((REPO / "benchmarks").rglob("*.py"))
    outside += sorted((REPO / "notebooks").glob("*.ipynb"))
    called: dict[str, list[str]] = {}
    for path in outside:
        for name in runner_methods_called(path.read_text()) - RUNNER_DOORS:
            called.setdefault(name, []).append(str(path.relative_to(REPO)))
    assert called == {}, f"runner methods called from outside engine/: {called}"
    assert runner_methods_called("x = engine.runner.forward_step(seqs, n)") == {"forward_step"}


def metadata_built_outside_its_builder(text: str) -> int:
    """How many times ``text`` calls ``PagedCacheMetadata(...)`` itself rather than its builders
    (``for_batch``, ``over_cache``): each would be one more place a step's attention inputs are assembled."""
    return len(re.findall(r"\bPagedCacheMetadata\(", text))


def test_paged_metadata_has_one_builder():
    builder = PACKAGE / "model" / "attention.py"
    elsewhere = {
        str(path.relative_to(REPO)): count
        for path in package_files()
        if path != builder and (count := metadata_built_outside_its_builder(path.read_text()))
    }
    assert elsewhere == {}, f"PagedCacheMetadata built outside model/attention.py's builders: {elsewhere}"
    assert metadata_built_outside_its_builder("meta = PagedCacheMetadata(**fields, cache=cache)") == 1


def stale_imports(sources: dict[str, str]) -> list[str]:
    """Every ``from lifeofprompt... import name`` in ``sources`` (label: text; top level or inside a
    function) whose module or name no longer exists: a script the suite never runs breaks silently
    when code moves."""
    import importlib
    import importlib.util

    stale = []
    for label, text in sources.items():
        for node in ast.walk(ast.parse(text)):
            if not (isinstance(node, ast.ImportFrom) and node.level == 0 and ours(node.module)):
                continue
            module = importlib.import_module(node.module)
            for alias in node.names:
                submodule = hasattr(module, "__path__") and importlib.util.find_spec(f"{node.module}.{alias.name}")
                if not hasattr(module, alias.name) and not submodule:
                    stale.append(f"{label}:{node.lineno}: {node.module}.{alias.name}")
    return stale


def test_benchmarks_and_scripts_import_what_exists():
    paths = sorted((REPO / "benchmarks").rglob("*.py")) + sorted((REPO / "scripts").glob("*.py"))
    assert stale_imports({str(p.relative_to(REPO)): p.read_text() for p in paths}) == []
    moved = "def curve():\n    from lifeofprompt.engine.model_runner import step as run_step\n"
    assert stale_imports({"moved.py": moved}) == ["moved.py:2: lifeofprompt.engine.model_runner.step"]

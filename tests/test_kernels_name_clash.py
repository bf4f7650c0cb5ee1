"""The checkout's ``kernels/`` folder must not break ``import transformers`` under the bare name ``kernels``.

Run from a checkout, the repository root is on ``sys.path`` and ``kernels/`` answers to the name of
Hugging Face's ``kernels`` package. transformers finds the name, imports it to read a version, and (before
5.25) lets any ImportError escape, so ``from transformers import LlamaForCausalLM`` failed on the GPU
machine, where that package is not installed. These run a fresh interpreter from the repository root.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_from_root(code: str, *, site_packages: bool) -> subprocess.CompletedProcess:
    flags = [] if site_packages else ["-S"]  # -S: no site-packages, so Hugging Face's kernels is absent
    code = "import sys; sys.path.insert(0, ''); " + code
    return subprocess.run([sys.executable, *flags, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_without_hugging_faces_package_the_name_reads_as_not_installed():
    # transformers 5.17's _is_package_available: found by find_spec, imported, and taken for "absent"
    # when the module has neither __version__ nor __file__.
    result = run_from_root(
        "import importlib.util, kernels; "
        "assert importlib.util.find_spec('kernels') is not None; "
        "assert getattr(kernels, '__version__', 'N/A') == 'N/A' and kernels.__file__ is None, vars(kernels); "
        "print('ok')",
        site_packages=False,
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_without_hugging_faces_package_its_names_still_fail_to_import():
    result = run_from_root("from kernels import get_kernel", site_packages=False)
    assert result.returncode == 1 and "ImportError" in result.stderr, result.stderr


def test_with_hugging_faces_package_the_name_is_theirs():
    result = run_from_root(
        "import importlib.util, kernels, pathlib; "
        "print('absent' if importlib.util.find_spec('kernels') is None or kernels.__file__ is None "
        "else pathlib.Path(kernels.__file__).resolve())",
        site_packages=True,
    )
    assert result.returncode == 0, result.stderr
    if result.stdout.strip() != "absent":
        assert not Path(result.stdout.strip()).is_relative_to(ROOT / "kernels"), result.stdout

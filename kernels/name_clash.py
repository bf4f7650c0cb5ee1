"""Give the top-level name ``kernels`` back to Hugging Face's package of that name.

This folder is installed as ``lifeofprompt.kernels``. Run from a checkout (``python -m lifeofprompt``,
``python -m pytest``, ``python -c ...``), the repository root is on ``sys.path``, so the folder also
answers to the bare name ``kernels``, which belongs to Hugging Face's ``kernels`` package: transformers
5.25 and later depend on it and import it, and would get this folder instead. When the bare name
reaches ``kernels/__init__.py``, it calls :func:`load_hugging_face_kernels`, which loads the real
package from the rest of ``sys.path`` and puts it in this module's place in ``sys.modules`` (an import
returns whatever the module left there).
"""

import importlib.util
import sys
from importlib.machinery import PathFinder
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parent.parent


def load_hugging_face_kernels() -> None:
    """Replace ``sys.modules["kernels"]`` (this folder) by the package installed under that name."""
    elsewhere = [entry for entry in sys.path if Path(entry or ".").resolve() != CHECKOUT]
    spec = PathFinder.find_spec("kernels", elsewhere)
    if spec is None:
        del sys.modules["kernels"]
        raise ModuleNotFoundError(
            "No module named 'kernels' (the checkout's kernels/ folder is lifeofprompt.kernels)", name="kernels"
        )
    module = importlib.util.module_from_spec(spec)
    sys.modules["kernels"] = module
    spec.loader.exec_module(module)

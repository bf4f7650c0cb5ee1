"""Give the top-level name ``kernels`` back to Hugging Face's package of that name.

This folder is installed as ``lifeofprompt.kernels``. Run from a checkout (``python -m lifeofprompt``,
``python -m pytest``, ``python -c ...``), the repository root is on ``sys.path``, so the folder also
answers to the bare name ``kernels``, which belongs to Hugging Face's ``kernels`` package: transformers
5.25 and later depend on it and import it, and would get this folder instead. When the bare name
reaches ``kernels/__init__.py``, it calls :func:`load_hugging_face_kernels`, which loads the real
package from the rest of ``sys.path`` and puts it in this module's place in ``sys.modules`` (an import
returns whatever the module left there). Where that package is not installed, the name gets an empty
stand-in instead of an error: transformers before 5.25 finds this folder by name, imports it to read a
version, and takes a module with neither ``__version__`` nor ``__file__`` for "not installed"; an
``ImportError`` there would break ``import transformers`` itself.
"""

import importlib.util
import sys
import types
from importlib.machinery import ModuleSpec, PathFinder
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parent.parent


def load_hugging_face_kernels() -> None:
    """Replace ``sys.modules["kernels"]`` (this folder) by the package installed under that name."""
    elsewhere = [entry for entry in sys.path if Path(entry or ".").resolve() != CHECKOUT]
    spec = PathFinder.find_spec("kernels", elsewhere)
    if spec is None:
        sys.modules["kernels"] = absent_package()
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["kernels"] = module
    spec.loader.exec_module(module)


def absent_package() -> types.ModuleType:
    """An empty module shaped like a bare namespace folder: no ``__file__``, no ``__version__``, no names.

    ``from kernels import anything`` still fails with an ``ImportError``, as it would with nothing installed.
    """
    module = types.ModuleType("kernels", "Stand-in: Hugging Face's kernels package is not installed.")
    module.__spec__ = ModuleSpec("kernels", None, is_package=True)
    module.__file__ = None
    module.__path__ = []
    return module

"""Whether the kernels run on a GPU or in Triton's interpreter, fixed before any kernel is decorated.

Without CUDA the kernels run in Triton's interpreter (numpy on the CPU, slow but exact for
fp32/fp16). Interpreter mode is decided when ``@triton.jit`` decorates a kernel, so this
module sets ``TRITON_INTERPRET=1`` *before* anything here imports Triton when no GPU is
available and the variable is unset. Triton decorates its own helpers when it is first
imported, so this only works if nothing imported ``triton`` earlier in the process; otherwise
the import raises ``ConfigError`` saying so. To run the interpreter on a GPU machine, set
``TRITON_INTERPRET=1`` yourself before anything imports Triton (and pass CPU tensors).
"""

import os

import torch

if not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ:
    os.environ["TRITON_INTERPRET"] = "1"

try:
    import triton  # noqa: F401
except ImportError as exc:
    from lifeofprompt.errors import MissingDependencyError

    raise MissingDependencyError(
        "the Triton backend needs Triton (pip install triton, Linux only); backend='torch' runs anywhere"
    ) from exc

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_interpreter_mode() -> None:
    """Triton's own helpers (``tl.max``, ``tl.cdiv``) are decorated when ``triton`` is first imported:
    if that happened before TRITON_INTERPRET was set, interpreted kernels cannot call them."""
    import triton.language as tl
    from triton.runtime.jit import JITFunction

    if INTERPRETED and isinstance(tl.cdiv, JITFunction):
        from lifeofprompt.errors import ConfigError

        raise ConfigError(
            "Triton was imported before TRITON_INTERPRET=1 was set, so its interpreter cannot run "
            "the kernels: set TRITON_INTERPRET=1 in the environment, or import lifeofprompt.kernels "
            "before anything imports triton"
        )


check_interpreter_mode()

"""Triton kernels for the paged KV cache, installed as ``lifeofprompt.kernels``.

``store_kv`` and ``paged_attention`` have exactly the signatures of the torch reference in
``lifeofprompt.paged_attention``; ``lifeofprompt.attention.attention_backend("triton")``
imports them from here. Nothing else in the package imports this subpackage, so the CPU
torch path never needs Triton.

Without CUDA the kernels run in Triton's interpreter (numpy on the CPU, slow but exact for
fp32/fp16). Interpreter mode is decided when ``@triton.jit`` decorates a kernel, so this
module sets ``TRITON_INTERPRET=1`` *before* importing the kernel modules when no GPU is
available and the variable is unset. To run the interpreter on a GPU machine, set
``TRITON_INTERPRET=1`` yourself before the first import (and pass CPU tensors).
"""

import os

import torch

if not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ:
    os.environ["TRITON_INTERPRET"] = "1"

from .paged_attention import paged_attention  # noqa: E402
from .store_kv import store_kv  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

__all__ = ["store_kv", "paged_attention", "INTERPRETED"]

"""The ``rows`` matrix-product path: ``row_kernels.c`` compiled once per machine, called through ctypes.

Why a C file in a torch project: at decode sizes (1-2 rows) the BLAS routines behind
``x @ W.T`` read fp32 weights well below the machine's memory read rate on some CPUs (on the
AMD EPYC this project is developed on, 20 GB/s at best against 33 for a plain sum), and the
cost of a decode step is that read. Walking each weight row once, front to back, is a single
stream the prefetcher follows. It is one candidate among several: the engine times all of
them on the machine it runs on (``linear_calibration.py``) and uses this one only where it wins.

It is built by ``native_build.py`` (once per machine, into the cache folder).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from .native_build import c_function

SOURCE = Path(__file__).with_name("row_kernels.c")


@functools.cache
def rows_kernel():
    """The compiled ``rows_times_weight`` function, or None where it cannot be built here."""
    return c_function(SOURCE, "rows_times_weight", [ctypes.c_void_p] * 3 + [ctypes.c_long] * 3 + [ctypes.c_int])


def rows_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` for contiguous fp32 CPU tensors, by the compiled kernel (ctypes releases the GIL)."""
    kernel = rows_kernel()
    if kernel is None:
        raise RuntimeError("the rows kernel is not available on this machine (no C compiler, or its build failed)")
    x = x.contiguous()
    out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype)
    kernel(
        x.data_ptr(),
        weight.data_ptr(),
        out.data_ptr(),
        x.shape[0],
        x.shape[1],
        weight.shape[0],
        torch.get_num_threads(),
    )
    return out

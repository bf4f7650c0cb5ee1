"""The ``rows`` matrix-product path: ``cpu_rows.c`` compiled once per machine, called through ctypes.

Why a C file in a torch project: at decode sizes (1-2 rows) the BLAS routines behind
``x @ W.T`` read fp32 weights well below the machine's memory read rate on some CPUs (on the
AMD EPYC this project is developed on, 20 GB/s at best against 33 for a plain sum), and the
cost of a decode step is that read. Walking each weight row once, front to back, is a single
stream the prefetcher follows. It is one candidate among several: the engine times all of
them on the machine it runs on (``linear_calibration.py``) and uses this one only where it wins.

The build needs a C compiler (``$CC``, else ``cc``/``gcc``); without one, or where the build
fails, ``rows_kernel()`` returns None and the path is simply not a candidate. The library is
built with ``-march=native`` for this CPU, so its file name carries a hash of the CPU flags,
the compiler and the source: another machine sharing the cache builds its own.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from ..env import cache_dir, cpu_flags, cpu_model

SOURCE = Path(__file__).with_name("cpu_rows.c")
# Tried in order: the vectorised, threaded build first, then plainer ones for compilers that refuse a flag.
BUILD_FLAGS = (["-O3", "-march=native", "-fopenmp"], ["-O3", "-mcpu=native", "-fopenmp"], ["-O3", "-fopenmp"], ["-O3"])


def compiler() -> str | None:
    """The C compiler to build with, or None where there is none."""
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def library_path(cc: str) -> Path:
    """Where this machine's build lives: one file per (source, compiler, CPU)."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256("\n".join([SOURCE.read_text(), version, cpu_model(), " ".join(sorted(cpu_flags()))]).encode())
    return cache_dir() / "cpu_rows" / f"rows-{key.hexdigest()[:16]}.so"


def build(cc: str, target: Path) -> bool:
    """Compile ``cpu_rows.c`` into ``target`` (under a file lock, written atomically); False if no flag set works."""
    from filelock import FileLock

    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if target.exists():
            return True
        for flags in BUILD_FLAGS:
            fd, staging = tempfile.mkstemp(suffix=".so", dir=target.parent)
            os.close(fd)
            done = subprocess.run([cc, *flags, "-shared", "-fPIC", str(SOURCE), "-o", staging],
                                  capture_output=True, timeout=120)
            if done.returncode == 0:
                os.replace(staging, target)
                return True
            os.unlink(staging)
    return False


@functools.lru_cache(maxsize=None)
def rows_kernel():
    """The compiled ``rows_times_weight`` function, or None where it cannot be built here."""
    cc = compiler()
    if cc is None or not SOURCE.exists():
        return None
    try:
        path = library_path(cc)
        if not build(cc, path):
            return None
        function = ctypes.CDLL(str(path)).rows_times_weight
    except (OSError, subprocess.SubprocessError, AttributeError):
        return None
    function.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 3 + [ctypes.c_int]
    function.restype = None
    return function


def rows_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` for contiguous fp32 CPU tensors, by the compiled kernel (ctypes releases the GIL)."""
    kernel = rows_kernel()
    if kernel is None:
        raise RuntimeError("the rows kernel is not available on this machine (no C compiler, or its build failed)")
    x = x.contiguous()
    out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype)
    kernel(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], weight.shape[0],
           torch.get_num_threads())
    return out

"""Compiling this project's small C files once per machine, for ctypes.

Three CPU paths are written in C (``row_kernels.c``: a few rows times a weight; ``block_kernels.c``: a
few rows times a matrix of GGUF blocks; ``c_step.c``: a whole decode step). They are built
with ``-march=native`` for the CPU that runs them, so the library's file name carries a hash of
the source, the compiler and the CPU's model and flags: another machine sharing the cache folder
builds its own. The build needs a C compiler (``$CC``, else ``cc``/``gcc``/``clang``); without
one, or where every flag set fails, ``compiled`` returns None and the path is simply not offered.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from ..env import cache_dir, cpu_flags, cpu_model

# Tried in order: the vectorised, threaded build first, then plainer ones for compilers that refuse a flag.
BUILD_FLAGS = (["-O3", "-march=native", "-fopenmp"], ["-O3", "-mcpu=native", "-fopenmp"], ["-O3", "-fopenmp"], ["-O3"])

# Build for another target than this CPU, e.g. ``x86-64-v3`` (AVX2, no AVX-512): how the
# portability script runs the kernels' narrower code paths on a machine that has wider ones.
MARCH_VARIABLE = "LIFEOFPROMPT_NATIVE_MARCH"


def build_flags() -> list[list[str]]:
    """The flag sets to try, with ``-march`` from ``LIFEOFPROMPT_NATIVE_MARCH`` where it is set."""
    march = os.environ.get(MARCH_VARIABLE)
    if not march:
        return [list(flags) for flags in BUILD_FLAGS]
    return [["-O3", f"-march={march}", "-fopenmp"], ["-O3", f"-march={march}"]]


def compiler() -> str | None:
    """The C compiler to build with, or None where there is none."""
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def source_texts(source: Path) -> list[str]:
    """``source`` and the local headers it includes (``#include "name.h"`` beside it): what a build depends on."""
    text = source.read_text()
    headers = re.findall(r'^#include "([^"]+)"', text, flags=re.MULTILINE)
    return [text] + [(source.parent / name).read_text() for name in headers]


def source_digest(source: Path) -> str:
    """A short digest of ``source`` and its local headers: a choice timed with a changed kernel is timed again."""
    return hashlib.sha256("\n".join(source_texts(source)).encode()).hexdigest()[:16]


def library_path(source: Path, cc: str) -> Path:
    """Where this machine's build of ``source`` lives: one file per (source and headers, compiler, CPU)."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256(
        "\n".join(
            [
                *source_texts(source),
                version,
                cpu_model(),
                " ".join(sorted(cpu_flags())),
                *([os.environ[MARCH_VARIABLE]] if os.environ.get(MARCH_VARIABLE) else []),
            ]
        ).encode()
    )
    return cache_dir() / "cpu_native" / f"{source.stem}-{key.hexdigest()[:16]}.so"


def build(source: Path, cc: str, target: Path) -> bool:
    """Compile ``source`` into ``target`` (under a file lock, written atomically); False if no flag set works."""
    from filelock import FileLock

    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if target.exists():
            return True
        for flags in build_flags():
            fd, staging = tempfile.mkstemp(suffix=".so", dir=target.parent)
            os.close(fd)
            done = subprocess.run(
                [cc, *flags, "-shared", "-fPIC", str(source), "-o", staging, "-lm"], capture_output=True, timeout=120
            )
            if done.returncode == 0:
                os.replace(staging, target)
                return True
            os.unlink(staging)
    return False


@functools.cache
def compiled(source: Path) -> ctypes.CDLL | None:
    """The shared library built from ``source`` for this machine, or None where it cannot be built here."""
    cc = compiler()
    if cc is None or not source.exists():
        return None
    try:
        path = library_path(source, cc)
        if not build(source, cc, path):
            return None
        return ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError):
        return None


def c_function(source: Path, name: str, argtypes: list, restype=None):
    """``name`` from this machine's build of ``source``, typed for ctypes, or None where it cannot be built."""
    library = compiled(source)
    function = getattr(library, name, None) if library is not None else None
    if function is None:
        return None
    function.argtypes = argtypes
    function.restype = restype
    return function

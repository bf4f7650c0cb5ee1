"""Which machine and versions produced a figure: printed by every notebook's first cell, stored in every result."""

from __future__ import annotations

import datetime
import functools
import os
import platform
from pathlib import Path

# CPU features that decide a number format or a kernel here (dtype="auto", the build flags of the
# matrix-product kernel, llama.cpp's build): read from the flags, never assumed from the vendor.
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def env_info() -> dict:
    """Versions, processor and accelerator, as a dict (benchmarks store it beside their numbers)."""
    import torch
    import transformers

    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPU cores",
        "cpu_threads": torch.get_num_threads(),
        "cpu": cpu_model(),
        "cpu_flags": " ".join(
            f for f in sorted(cpu_flags()) if f.startswith(("avx", "amx", "fma", "f16c", "sve", "asimd"))
        ),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu (no GPU)",
    }
    try:  # read, not imported: importing Triton fixes its interpreter mode (see lifeofprompt.kernels)
        from importlib.metadata import version

        info["triton"] = version("triton")
    except ImportError:
        info["triton"] = "not installed"
    from ._version import __version__

    info["lifeofprompt"] = __version__
    return info


def cache_dir() -> Path:
    """Where lifeofprompt keeps what it builds once per machine: ``$LIFEOFPROMPT_CACHE``, else ``~/.cache/lifeofprompt``

    Dequantized models, the compiled matrix-product kernel and the calibrated choice of
    product paths all live here, so a second start skips the work (and repeats the choice).
    """
    root = (
        os.environ.get("LIFEOFPROMPT_CACHE")
        or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "lifeofprompt"
    )
    return Path(root)


@functools.cache
def _cpuinfo() -> dict[str, str]:
    """The first processor's entry of ``/proc/cpuinfo`` (empty where there is none: macOS, Windows)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    fields = {}
    for line in text.split("\n\n")[0].splitlines():
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return fields


def cpu_model() -> str:
    """The processor's name, e.g. ``AMD EPYC`` or ``Intel(R) Xeon(R) Platinum 8488C``."""
    info = _cpuinfo()
    return info.get("model name") or info.get("Model") or platform.processor() or platform.machine()


def cpu_flags() -> frozenset[str]:
    """The instruction-set flags the kernel reports (x86 ``flags``, ARM ``Features``)."""
    info = _cpuinfo()
    return frozenset((info.get("flags") or info.get("Features") or "").split())


# The widest vector instructions a CPU has, widest first: CPUs that share a name ("AMD EPYC" is every
# generation of a cloud VM) differ here, and so do the kernels torch, oneDNN and our C code run.
VECTOR_ISAS = (
    ("amx_tile", "AMX"),
    ("avx512f", "AVX-512"),
    ("avx2", "AVX2"),
    ("avx", "AVX"),
    ("sve", "SVE"),
    ("asimd", "NEON"),
)


def cpu_vector_isa(flags=None) -> str:
    """``AMX``, ``AVX-512``, ``AVX2``, ... from the CPU flags (``flags``: a result file's, else this machine's)."""
    flags = cpu_flags() if flags is None else set(flags)
    return next((name for flag, name in VECTOR_ISAS if flag in flags), platform.machine() or "unknown")


def cpu_label(model: str | None = None, flags=None) -> str:
    """A CPU as results name it: its model and widest vector instructions, e.g. ``AMD EPYC (AVX2)``."""
    return f"{model or cpu_model()} ({cpu_vector_isa(flags)})"


def cpu_native_bf16() -> str | None:
    """The flag by which this CPU computes bf16 natively (AVX512-BF16 or AMX), or None."""
    flags = cpu_flags()
    return next((f for f in NATIVE_BF16_FLAGS if f in flags), None)


def env_report() -> str:
    """One line per fact, for a notebook's first cell."""
    return "\n".join(f"{k:>13}: {v}" for k, v in env_info().items())

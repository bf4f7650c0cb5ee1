"""Which machine and versions produced a figure: printed by every notebook's first cell, stored in every result."""

from __future__ import annotations

import datetime
import os
import platform


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


def env_report() -> str:
    """One line per fact, for a notebook's first cell."""
    return "\n".join(f"{k:>13}: {v}" for k, v in env_info().items())

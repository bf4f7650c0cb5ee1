"""Byte counts as people read them, for every layer's logs and figures."""

from __future__ import annotations

GiB = 1024**3
MiB = 1024**2
KiB = 1024


def format_bytes(n: float) -> str:
    """Binary units, as memory is sold to programs: ``22.0 KiB``, ``88.0 MiB``, ``14.40 GiB``."""
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}" if unit == "GiB" else f"{n / size:.1f} {unit}"
    return f"{int(n)} B"

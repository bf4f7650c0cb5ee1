"""``ForwardPath``: which way the model's forward runs its layers, named where the engine picks it.

The torch layers (``llama.py``) are the reference; the other paths compute the same layers with the
same weights, faster on one kind of device. The engine's speed-ups for the device (``engine/speedups.py``) pick
a path per step; the user's ``cpu_tuning`` setting takes one of ``CPU_TUNINGS``.
"""

from __future__ import annotations

import enum

from .linear import PATHS as PRODUCT_PATHS


class ForwardPath(str, enum.Enum):
    """Which forward a step runs. The C step's values keep their first names ("cpu"); the setting that asks
    for it is ``cpu_tuning="c-step"``."""

    TORCH = "torch"  # the decoder layers (on a GPU their small ops run fused Triton kernels: model/layers.py)
    C_STEP = "cpu"  # every layer in one C call, reading packed weight copies (c_step.py); CPU only, few rows
    C_STEP_ROW_MAJOR = "cpu-rowmajor"  # the same, reading the row-major weights only

    @property
    def is_c_step(self) -> bool:
        return self in (ForwardPath.C_STEP, ForwardPath.C_STEP_ROW_MAJOR)


# ``cpu_tuning``: "auto" measures every CPU path on this machine once (cached); "off" runs the plain torch
# forward and measures nothing; a product path pins every matrix product to it, and "rowwise" brings the
# C step and the C decode attention (they read weights the same way); "c-step" runs the C step for every
# step of up to 16 rows with the products pinned to "linear" (its tests). Pinned, nothing is timed, so no
# timing can move a token.
CPU_TUNINGS = ("auto", "off", *PRODUCT_PATHS, "c-step")

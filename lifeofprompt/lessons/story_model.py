"""Which model a chapter runs on this machine (chapters 10 and 11): the embedded SmolLM2 on a CPU,
TinyLlama on a GPU. The engine loads whatever name it is given; only the notebooks choose by device.
"""

from __future__ import annotations

from ..errors import ModelNotFoundError
from ..model.loader import DEFAULT_MODEL, default_device, tinyllama_dir


def story_model_name(device=None) -> str:
    """The model a notebook runs here: the embedded SmolLM2 on a CPU; TinyLlama on a GPU.

    On a GPU the story's model is used with its real weights when they are on the machine, else
    its random-weight twin, whose ``model.source`` says RANDOM wherever it is printed.
    """
    device = default_device(device)
    if device.type != "cuda":
        return DEFAULT_MODEL
    try:
        tinyllama_dir()
        return "tinyllama-1.1b"
    except ModelNotFoundError:
        return "tinyllama-1.1b-random"

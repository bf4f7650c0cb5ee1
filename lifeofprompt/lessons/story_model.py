"""The story's models as the chapters use them: which one a chapter runs on this machine (chapters 10
and 11: the embedded SmolLM2 on a CPU, TinyLlama on a GPU), and SmolLM2's shape for the chapters'
arithmetic. The engine loads whatever name it is given and reads the embedded model's shape from its
GGUF; only the notebooks choose by device or size a model they do not load.
"""

from __future__ import annotations

from ..errors import ModelNotFoundError
from ..model.config import ModelConfig
from ..model.loader import DEFAULT_MODEL, default_device, tinyllama_dir

# HuggingFaceTB/SmolLM2-135M-Instruct, the embedded default (checked against the GGUF in tests).
SMOLLM2_135M = ModelConfig(
    name="HuggingFaceTB/SmolLM2-135M-Instruct",
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_ids=(2,),
)


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

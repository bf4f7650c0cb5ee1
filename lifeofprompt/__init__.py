"""lifeofprompt: a vLLM-style inference engine built from scratch, one notebook at a time.

The data flow one way: tokenizer → model (``model.py``) → cache (``attention.py``,
``paged_attention.py``) → scheduler → engine. Each stage's finished code lives here once;
the notebooks in ``notebooks/`` explain it and import it.
"""

from .config import ModelConfig
from .env import env_info, env_report
from .generate import generate_cached, generate_naive
from .loader import load_model

__version__ = "0.1.0"
__all__ = ["ModelConfig", "load_model", "generate_naive", "generate_cached", "env_info", "env_report", "__version__"]

from .engine import LLMEngine  # noqa: E402  (notebook 07: the scheduler and the engine's public API)
from .llm import LLM  # noqa: E402
from .outputs import CompletionOutput, RequestMetrics, RequestOutput  # noqa: E402
from .sampling_params import SamplingParams  # noqa: E402

__all__ += ["LLM", "LLMEngine", "SamplingParams", "RequestOutput", "CompletionOutput", "RequestMetrics"]

from .block_manager import BlockManager  # noqa: E402

__all__ += ["BlockManager"]

from .memory import MemoryPlan, kv_bytes_per_token, plan_memory  # noqa: E402  (notebook 05: the VRAM land)
from .roofline import Machine  # noqa: E402

__all__ += ["MemoryPlan", "kv_bytes_per_token", "plan_memory", "Machine"]

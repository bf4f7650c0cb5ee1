"""lifeofprompt: a vLLM-style inference engine built from scratch, one notebook at a time.

The data flow one way, and so do the imports: ``model/`` (tokenizer, Llama layers, attention
metadata) → ``engine/`` (blocks, scheduler, runner, ``LLM``) → ``serving/`` (HTTP, load tests);
``lessons/`` and ``figures/`` sit on top for the notebooks. Each stage's finished code lives here
once; the notebooks in ``notebooks/`` explain it and import it. ``import lifeofprompt`` loads torch
and nothing heavier (no matplotlib, transformers, fastapi, triton) until a name that needs it is used.
"""

from ._version import __version__
from .engine.block_manager import BlockManager
from .engine.llm import LLM
from .engine.llm_engine import LLMEngine
from .engine.memory import MemoryPlan, kv_bytes_per_token, plan_memory
from .engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from .engine.sampling_params import SamplingParams
from .env import env_info, env_report
from .errors import (
    AuthenticationError,
    ConfigError,
    InvalidRequestError,
    LifeOfPromptError,
    MissingDependencyError,
    ModelNotFoundError,
    OutOfMemoryError,
    ParallelConfigError,
    QueueFullError,
    RequestFailedError,
    RequestNotFoundError,
    RequestTooLargeError,
    ShuttingDownError,
    SpeculativeConfigError,
    StructuredOutputUnavailableError,
    WorkerFailedError,
)
from .lessons.generate import generate_cached, generate_naive
from .lessons.roofline import Machine
from .model.config import ModelConfig
from .model.loader import load_model

__all__ = [
    "__version__",
    "env_info",
    "env_report",
    # errors (lifeofprompt.errors)
    "LifeOfPromptError",
    "ModelNotFoundError",
    "MissingDependencyError",
    "InvalidRequestError",
    "RequestTooLargeError",
    "ConfigError",
    "OutOfMemoryError",
    "QueueFullError",
    "RequestNotFoundError",
    "RequestFailedError",
    "ShuttingDownError",
    "AuthenticationError",
    "SpeculativeConfigError",
    "ParallelConfigError",
    "WorkerFailedError",
    "StructuredOutputUnavailableError",
    # model (chapters 01-02)
    "ModelConfig",
    "load_model",
    # engine (chapters 05-11)
    "LLM",
    "LLMEngine",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "RequestMetrics",
    "BlockManager",
    "MemoryPlan",
    "kv_bytes_per_token",
    "plan_memory",
    # lessons (chapters 03-05)
    "generate_naive",
    "generate_cached",
    "Machine",
]

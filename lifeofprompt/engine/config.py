"""The engine's settings in one place: ``EngineConfig`` (what was asked) and ``ResolvedConfig`` (what start-up chose).

``LLM``, ``LLMEngine``, the command line and the server all build an ``EngineConfig``, with vLLM's
names where vLLM has the setting. It is checked as it is made, before any model loads: a bad value
is a ``ConfigError`` naming the field and what it takes. Start-up (``ModelRunner``, in the order
``engine/README.md`` walks) then makes every automatic choice once and freezes the answers in a
``ResolvedConfig``: the layers below read it and the start-up log prints it; it pickles, to travel to
other processes.
Each default is written once, here.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from dataclasses import dataclass, field

from ..errors import ConfigError
from ..model.kv_cache_formats import KV_CACHE_DTYPES
from ..model.linear import PATHS as PRODUCT_PATHS
from ..model.loader import DEFAULT_MODEL

DEFAULT_STEP_TOKENS = 2048  # the step's token budget where nothing measured it (a GPU, pinned CPU paths)
CPU_KV_CACHE_MEMORY = 2 << 30  # bytes of KV pool on a CPU when kv_cache_memory is not given
CPU_TUNING_VARIABLE = "LIFEOFPROMPT_CPU_TUNING"  # the default of ``cpu_tuning`` (tests pin a path with it)
ATTENTION_BACKENDS = ("auto", "torch", "triton")
# ``cpu_tuning``: "auto" measures every CPU path on this machine once (cached); "off" runs the plain torch
# layers and measures nothing; a product path pins every matrix product to it, and "rowwise" brings the
# C step and the C decode attention (they read weights the same way); "c-step" runs the C step for every
# step of up to 16 rows with the products pinned to "linear" (its tests). Pinned, nothing is timed, so no
# timing can move a token (cpu/speedups.py).
CPU_TUNINGS = ("auto", "off", *PRODUCT_PATHS, "c-step")
# ``block_activations``: how a CPU multiplies GGUF blocks by a few rows. "float": each weight made a float
# (exact for the dequantized weights); "integer": the rows made two int8 digits per block and the CPU's
# integer dot products (cpu/interleaved_blocks.py); "auto": integer where this CPU has a vector path for it
# and a batch-1 step measured faster that way (timed once, cached), float with a pinned cpu_tuning.
BLOCK_ACTIVATIONS = ("auto", "integer", "float")
# ``big_step_weights``: what a CPU's big steps (prompt chunks, large batches) multiply a block model by.
# "blocks": the GGUF's blocks at every step size; "bfloat16" / "float32": a copy of the layer matrices in
# that dtype, read by steps of 64 rows or more (cpu/big_step_weights.py); "auto": prompt chunks timed from
# the blocks and from each copy that takes at most a quarter of the free memory (once, cached), the blocks
# with a pinned cpu_tuning.
BIG_STEP_WEIGHTS = ("auto", "blocks", "bfloat16", "float32")


@dataclass(frozen=True)
class EngineConfig:
    """Every engine setting and its default. Where vLLM's default differs from ours:

    * ``gpu_memory_utilization``: vLLM claims 0.92 of the device (0.9 up to its v0.10 line); we keep 0.9;
    * ``max_num_batched_tokens``: vLLM picks it by device and entry point (2,048 to 16,384 on GPUs); we
      take 2,048 on a GPU and, on a CPU, as many tokens as one step prefills in ``cpu/speedups.py: STEP_SECONDS``;
    * ``long_prefill_token_threshold``: off in vLLM; ours caps one prompt's chunk at a quarter of the
      budget while others wait or run (``scheduler.fair_prefill_threshold``);
    * ``kv_cache_memory``: vLLM sizes a CPU pool with ``VLLM_CPU_KVCACHE_SPACE``; ours is 2 GiB on a CPU;
    * ``quantization``: vLLM's None loads the checkpoint as it is; our ``"auto"`` keeps the embedded model's
      GGUF blocks on a CPU where its batch-1 step measured faster with them (``cpu/block_calibration.py``),
      and is None for every other model, on a GPU, and where ``cpu_tuning`` is not ``"auto"``.
    """

    model: object = DEFAULT_MODEL  # a name, a Hugging Face folder, or a loaded LlamaForCausalLM (with tokenizer)
    tokenizer: object = None  # the loaded model's tokenizer
    dtype: object = "auto"  # "auto": bf16 on a GPU; on a CPU what measures faster (model/loader.py)
    quantization: str | None = "auto"  # None, "gguf", "q8_0", "q4_1" (model/loader.py), or "auto": see above
    block_activations: str = "auto"  # one of BLOCK_ACTIVATIONS (above): a CPU's products with block matrices
    big_step_weights: str = "auto"  # one of BIG_STEP_WEIGHTS (above): a CPU's big steps with block matrices
    kv_cache_dtype: str = "auto"  # how the KV pool stores keys and values (model/kv_cache_formats.py)
    device: object = None  # None: CUDA when a GPU is present, else the CPU
    block_size: int = 16  # tokens per KV block
    num_kv_blocks: int | None = None  # vLLM's num_gpu_blocks_override; None: sized from memory
    kv_cache_memory: int | None = None  # bytes for the KV pool (vLLM's kv_cache_memory_bytes); None: see above
    gpu_memory_utilization: float = 0.9  # the share of a GPU's memory the engine may use
    enable_prefix_caching: bool = True
    max_num_seqs: int = 256  # sequences in one step at most
    max_num_batched_tokens: int | None = None  # one step's token budget; None: see above
    max_model_len: int | None = None  # None: the model's context, capped by what the pool holds
    long_prefill_token_threshold: int | None = None  # 0: off; None: a quarter of the budget
    max_waiting: int | None = None  # waiting requests beyond which add_request raises QueueFullError
    attention_backend: str = "auto"  # "auto": Triton on a GPU, torch elsewhere
    enforce_eager: bool = False  # True: never replay decode steps from CUDA graphs
    cpu_tuning: str = "auto"  # one of CPU_TUNINGS (above): "auto" measures, cached; "off" or a pinned path
    prepack_cpu_weights: bool = True  # the CPU paths may keep second, re-laid-out copies of weights
    speculative_config: dict | None = None  # vLLM's dict: {"method": "ngram", ...} or {"model": ...}
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    pipeline_overlap: bool = True  # P > 1: one step per stage in flight
    async_scheduling: bool | None = None  # the next step scheduled while this one runs; None: where it can
    distributed_executor_backend: str | None = None  # None, "uni" or "mp" (distributed/executor.py)
    log_stats: bool = True  # log the start-up lines
    check_invariants: bool = False  # check the block manager after every step (tests)
    max_step_records: int = 10_000  # steps of trace kept (``LLMEngine.step_records``)
    # what ``load_model`` is asked for, decided with the settings (``quantization_to_load``), not a setting
    load_quantization: str | None = field(init=False, default=None)

    def __post_init__(self):
        check(self)
        object.__setattr__(self, "load_quantization", quantization_to_load(self))

    @classmethod
    def from_settings(cls, **settings) -> EngineConfig:
        """The config ``LLM(...)``, ``LLMEngine(...)`` and the CLI build: keywords by name (a misspelt one is a
        ``ConfigError`` naming the closest, an old name one naming its new one), and ``cpu_tuning`` from
        ``$LIFEOFPROMPT_CPU_TUNING`` when not given."""
        refuse_old_names(settings)
        defaults = {f.name: f.default for f in dataclasses.fields(cls) if f.init}
        # None stands for the default, as the old keywords took it (``attention_backend=None``: "auto")
        settings = {
            k: v for k, v in settings.items() if v is not None or defaults.get(k) is None or k in NONE_IS_A_VALUE
        }
        names = set(defaults)
        for name in settings:
            if name not in names:
                close = difflib.get_close_matches(name, names, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ConfigError(f"unknown engine setting {name!r}{hint} (settings: engine/config.py)", param=name)
        tuning = os.environ.get(CPU_TUNING_VARIABLE)
        if tuning and "cpu_tuning" not in settings:
            settings["cpu_tuning"] = tuning
        return cls(**settings)

    def replace(self, **changes) -> EngineConfig:
        return dataclasses.replace(self, **changes)


RENAMED = {  # names that were never released, each refused with the one that replaced it
    "cpu_linear": "cpu_linear= is now cpu_tuning= (a product path pinned: cpu_tuning='linear', 'rowwise', ...)",
    "cpu_decode": "cpu_decode= is now part of cpu_tuning=: cpu_tuning='c-step' runs the C step, a pinned "
    "product path other than 'rowwise' (cpu_tuning='linear') or cpu_tuning='off' keeps it out",
}
OLD_VARIABLE = "LIFEOFPROMPT_CPU_LINEAR"
OLD_C_STEP = "cpu"  # the C step's path name before cpu_tuning: now "c-step"
NONE_IS_A_VALUE = {"quantization"}  # vLLM's None: no quantization (elsewhere None stands for the default)


def refuse_old_names(settings: dict) -> None:
    """A setting by a name that was never released is a ``ConfigError`` naming the one that replaced it."""
    for old, message in RENAMED.items():
        if old in settings:
            raise ConfigError(message, param=old)
    if os.environ.get(OLD_VARIABLE):
        raise ConfigError(f"{OLD_VARIABLE} is now {CPU_TUNING_VARIABLE}: rename the variable", param="cpu_tuning")
    tuning = settings.get("cpu_tuning", os.environ.get(CPU_TUNING_VARIABLE))
    if tuning == OLD_C_STEP:
        message = "cpu_tuning='cpu' is now cpu_tuning='c-step' (the C step for every small step)"
        raise ConfigError(message, param="cpu_tuning")


def check(config: EngineConfig) -> None:
    """Every field in range, before the model loads; the first bad one is a ``ConfigError`` naming it."""
    for name in ("block_size", "max_num_seqs", "tensor_parallel_size", "pipeline_parallel_size"):
        _positive_int(config, name)
    for name in ("num_kv_blocks", "kv_cache_memory", "max_num_batched_tokens", "max_model_len", "max_waiting"):
        if getattr(config, name) is not None:
            _positive_int(config, name, "or None")
    threshold = config.long_prefill_token_threshold
    if threshold is not None and (not _is_int(threshold) or threshold < 0):
        raise ConfigError(
            f"long_prefill_token_threshold must be >= 0 (0: off) or None, got {threshold!r}",
            param="long_prefill_token_threshold",
        )
    if not 0 < config.gpu_memory_utilization <= 1:
        utilization = config.gpu_memory_utilization
        raise ConfigError(
            f"gpu_memory_utilization must be in (0, 1], got {utilization}", param="gpu_memory_utilization"
        )
    _one_of(config, "attention_backend", ATTENTION_BACKENDS)
    for name in ("enable_prefix_caching", "enforce_eager", "prepack_cpu_weights", "pipeline_overlap", "log_stats"):
        if not isinstance(getattr(config, name), bool):
            raise ConfigError(f"{name} must be True or False, got {getattr(config, name)!r}", param=name)
    _check_dtype_and_device(config)
    _check_quantization(config)
    _one_of(config, "cpu_tuning", CPU_TUNINGS)
    _one_of(config, "block_activations", BLOCK_ACTIVATIONS)
    _one_of(config, "big_step_weights", BIG_STEP_WEIGHTS)
    _one_of(config, "kv_cache_dtype", KV_CACHE_DTYPES)
    if config.async_scheduling not in (None, True, False):
        raise ConfigError(
            f"async_scheduling must be True, False or None (where it can), got {config.async_scheduling!r}",
            param="async_scheduling",
        )
    if not _is_int(config.max_step_records) or config.max_step_records < 0:
        records = config.max_step_records
        raise ConfigError(f"max_step_records must be an integer >= 0, got {records!r}", param="max_step_records")
    from ..distributed.executor import uses_process_group
    from .speculative import SpeculativeConfig

    uses_process_group(config.distributed_executor_backend, config.tensor_parallel_size, config.pipeline_parallel_size)
    SpeculativeConfig.from_user(config.speculative_config)  # a SpeculativeConfigError names the field


def _check_dtype_and_device(config: EngineConfig) -> None:
    """``dtype``: "auto", None, a torch floating dtype or its name; ``device``: None or what ``torch.device``
    takes (named before the model loads, not by torch halfway through)."""
    import torch

    dtype = config.dtype
    if dtype not in (None, "auto"):
        named = getattr(torch, dtype.removeprefix("torch."), None) if isinstance(dtype, str) else dtype
        if not isinstance(named, torch.dtype) or not named.is_floating_point:
            raise ConfigError(f"dtype={dtype!r}: use 'auto', 'float32', 'bfloat16' or 'float16'", param="dtype")
    if config.device is not None:
        try:
            torch.device(config.device)
        except (RuntimeError, TypeError):
            raise ConfigError(f"device={config.device!r}: use 'cpu', 'cuda' or 'cuda:N'", param="device") from None


def _check_quantization(config: EngineConfig) -> None:
    """A known format, on a model that can take it, in one process (the shards of a split model are floats)."""
    from ..model.loader import check_quantization

    if config.quantization in ("auto", None):
        return
    if not isinstance(config.model, str):
        raise ConfigError(
            "quantization applies when the engine loads the model by name or folder; quantize a loaded model "
            "yourself (model/quantized_linear.quantize_model) and pass quantization=None",
            param="quantization",
        )
    check_quantization(config.model, config.quantization)
    split = config.tensor_parallel_size * config.pipeline_parallel_size > 1
    if split:
        raise ConfigError(
            f"quantization={config.quantization!r} runs in one process: a split model's shards are kept in floats "
            "(set quantization=None, or tensor_parallel_size and pipeline_parallel_size to 1)",
            param="quantization",
        )


def quantization_to_load(config: EngineConfig):
    """What ``load_model`` is asked for: ``"auto"`` times the blocks only where the CPU's speed-ups are timed
    (``cpu_tuning="auto"``, one process); with a pinned path, tests' and benchmarks' way, it means floats."""
    split = config.tensor_parallel_size * config.pipeline_parallel_size > 1
    if config.quantization == "auto" and (config.cpu_tuning != "auto" or split):
        return None
    return config.quantization


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive_int(config: EngineConfig, name: str, extra: str = "") -> None:
    value = getattr(config, name)
    if not _is_int(value) or value < 1:
        raise ConfigError(f"{name} must be a positive integer{' ' + extra if extra else ''}, got {value!r}", param=name)


def _one_of(config: EngineConfig, name: str, allowed: tuple) -> None:
    value = getattr(config, name)
    if value not in allowed:
        raise ConfigError(f"{name}={value!r} is not one of: {', '.join(map(repr, allowed))}", param=name)


# ----------------------------------------------------------------------------- what start-up chose


@dataclass(frozen=True)
class SchedulerConfig:
    """What the scheduler needs (vLLM's name): the step's budgets and the longest request."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    long_prefill_token_threshold: int | None = None  # None: off
    num_groups: int = 1  # micro-batch groups (pipeline overlap)


@dataclass(frozen=True)
class ResolvedConfig:
    """Every choice start-up made, frozen: read by the layers below, printed by the log, sent to worker ranks."""

    model_name: str
    device: str
    dtype: str
    attention_backend: str  # "torch" or "triton"
    cuda_graphs: bool  # decode steps replayed from CUDA graphs
    fused_kernels: bool  # the element-wise steps as fused Triton kernels
    block_size: int
    num_kv_blocks: int
    enable_prefix_caching: bool
    scheduler: SchedulerConfig
    max_blocks_per_seq: int  # a block table's width: the longest request in whole blocks
    max_waiting: int | None
    tensor_parallel_size: int
    pipeline_parallel_size: int
    speedups: str  # what makes this device fast (model/device.py): its name
    quantization: str | None = None  # the weights' form as loaded: None (floats), "gguf", "q8_0" or "q4_1"
    cpu: object = None  # the CPU paths chosen (cpu/speedups.py: CpuChoices), None elsewhere
    kv_cache_dtype: str = "auto"  # how the pool stores keys and values (model/kv_cache_formats.py)
    why: dict = field(default_factory=dict)  # why an automatic choice fell as it did (the log)

    @property
    def max_model_len(self) -> int:
        return self.scheduler.max_model_len

    @property
    def max_num_seqs(self) -> int:
        return self.scheduler.max_num_seqs

    @property
    def max_num_batched_tokens(self) -> int:
        return self.scheduler.max_num_batched_tokens


def resolve(config: EngineConfig, model, num_kv_blocks: int, speedups, cuda_graphs: bool) -> ResolvedConfig:
    """Every remaining automatic choice, in one place, from what start-up found (the model, the planned
    block count, the device's speed-ups and what they chose):

    * the longest request: ``max_model_len`` if given, else the model's context, never more than the
      model's context nor more than the whole pool holds;
    * the step's token budget: ``max_num_batched_tokens`` if given, else what the speed-ups measured (a CPU:
      ``STEP_SECONDS`` of prefill, at most 2,048), else 2,048; and the fair-prefill cap from it;
    * one micro-batch group per pipeline stage when stages overlap.
    """
    budget = config.max_num_batched_tokens or min(speedups.step_tokens or DEFAULT_STEP_TOKENS, DEFAULT_STEP_TOKENS)
    stages = config.pipeline_parallel_size
    scheduler = SchedulerConfig(
        config.max_num_seqs,
        budget,
        min(context_len(config, model.config), num_kv_blocks * config.block_size),
        fair_prefill_threshold(config.long_prefill_token_threshold, budget),
        stages if stages > 1 and config.pipeline_overlap else 1,
    )
    why = dict(budget="as asked" if config.max_num_batched_tokens else speedups.budget_note or "the default")
    quantization = getattr(model, "quantization", None)  # a split model's shard holds floats
    why["quantization"] = getattr(model, "quantization_reason", "") or "as given"
    return ResolvedConfig(
        model_name=model_name(config, model),
        device=str(model.device),
        dtype=str(model.dtype).removeprefix("torch."),
        attention_backend=speedups.backend,
        cuda_graphs=cuda_graphs,
        fused_kernels=speedups.fused_kernels,
        block_size=config.block_size,
        num_kv_blocks=num_kv_blocks,
        enable_prefix_caching=config.enable_prefix_caching,
        scheduler=scheduler,
        max_blocks_per_seq=-(-scheduler.max_model_len // config.block_size),
        max_waiting=config.max_waiting,
        tensor_parallel_size=config.tensor_parallel_size,
        pipeline_parallel_size=stages,
        speedups=speedups.name,
        quantization=quantization,
        cpu=speedups.choices,
        kv_cache_dtype=config.kv_cache_dtype,
        why=why,
    )


def context_len(config: EngineConfig, model_config) -> int:
    """The longest request the model allows: ``max_model_len`` if given, never past the model's context."""
    return min(config.max_model_len or model_config.max_position_embeddings, model_config.max_position_embeddings)


def model_name(config: EngineConfig, model) -> str:
    """The name requests and the server use: the one asked for, else the loaded model's own."""
    return config.model if isinstance(config.model, str) else model.config.name


MIN_FAIR_CHUNK = 64  # fair prefill never cuts a prompt's chunk thinner than this


def fair_prefill_threshold(requested: int | None, max_num_batched_tokens: int) -> int | None:
    """The scheduler's ``long_prefill_token_threshold``: ``requested`` if given (0 = off), else a
    quarter of the step's budget (512 of 2,048), never under ``MIN_FAIR_CHUNK`` tokens.

    A quarter leaves three quarters of every step to the others while a long prompt prefills, so a
    short request's first token comes one step after it arrives, in a step about a quarter as long;
    and since the cap holds only while others wait or run, a lone prompt keeps the whole budget. The
    floor keeps chunks thick enough for fast matrix products, and leaves tiny budgets (a lesson's 8
    tokens a step) with plain chunked prefill. vLLM's own default is off (4% of max_model_len when
    ``max_num_partial_prefills`` > 1).
    """
    if requested is not None:
        if requested < 0:
            raise ConfigError(
                f"long_prefill_token_threshold must be >= 0 (0 = off), got {requested}",
                param="long_prefill_token_threshold",
            )
        return requested or None
    threshold = max(max_num_batched_tokens // 4, MIN_FAIR_CHUNK)
    return threshold if threshold < max_num_batched_tokens else None

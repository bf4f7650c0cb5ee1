"""Which tensor-parallel sizes a model allows, and which slice of every weight rank ``r`` holds.

Megatron's split of one Llama layer over ``T`` ranks:

* queries by heads: rank ``r`` holds ``num_heads / T`` heads, so ``T`` must divide the query heads;
* keys and values by heads too: ``num_kv_heads / T`` each when ``T`` divides them; when ``T`` is
  a multiple of them instead, every rank holds the one KV head its queries read (replicated
  ``T / num_kv_heads`` times, as vLLM does);
* gate/up by columns of the intermediate layer, so ``T`` must divide ``intermediate_size``;
* the vocabulary by rows, padded up to a multiple of ``T`` (as vLLM pads it), so it sets no rule.

SmolLM2-135M (9 query / 3 KV heads, intermediate 1536) allows T ∈ {1, 3}: 3 divides all
three, and T = 9 would split the heads but not the 1536 columns.

Pipeline stages take contiguous layers, as evenly as they go (``stage_layers``), so any
``P`` from 1 to the number of layers is valid. Rank ``stage * T + r`` holds tensor-parallel
slice ``r`` of stage ``stage``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..errors import ParallelConfigError
from ..model.config import ModelConfig


def _why_not(config: ModelConfig, size: int) -> str | None:
    """The rule ``size`` breaks, or None when it is valid."""
    if size < 1:
        return "it must be at least 1"
    if config.num_heads % size:
        return f"it does not divide the {config.num_heads} query heads"
    if config.intermediate_size % size:
        return f"it does not divide the intermediate size {config.intermediate_size}"
    if config.num_kv_heads % size and size % config.num_kv_heads:
        return f"it neither divides the {config.num_kv_heads} KV heads nor is a multiple of them"
    return None


def valid_tensor_parallel_sizes(config: ModelConfig) -> tuple[int, ...]:
    """Every ``T`` the model can be split by (at most the query heads: each rank needs one)."""
    return tuple(t for t in range(1, config.num_heads + 1) if _why_not(config, t) is None)


def check_tensor_parallel_size(config: ModelConfig, size: int) -> None:
    """Raise ``ParallelConfigError`` naming the valid sizes when ``size`` is not one of them."""
    reason = _why_not(config, size) if isinstance(size, int) and not isinstance(size, bool) else "it must be an int"
    if reason is not None:
        valid = valid_tensor_parallel_sizes(config)
        raise ParallelConfigError(
            f"tensor_parallel_size={size!r} cannot split {config.name}: {reason}; "
            f"valid sizes: {', '.join(map(str, valid))}",
            valid_sizes=valid,
        )


def check_pipeline_parallel_size(config: ModelConfig, stages: int) -> None:
    """Each pipeline stage needs at least one layer."""
    if isinstance(stages, bool) or not isinstance(stages, int) or not 1 <= stages <= config.num_layers:
        raise ParallelConfigError(
            f"pipeline_parallel_size={stages!r} cannot split {config.name}: each stage needs at "
            f"least one of its {config.num_layers} layers; valid sizes: 1 to {config.num_layers}",
            valid_sizes=tuple(range(1, config.num_layers + 1)),
        )


def stage_layers(num_layers: int, stages: int, stage: int) -> tuple[int, int]:
    """Contiguous layers ``[start, end)`` of one stage; the first ``num_layers % stages`` stages get one more."""
    base, extra = divmod(num_layers, stages)
    start = stage * base + min(stage, extra)
    return start, start + base + (1 if stage < extra else 0)


@dataclass(frozen=True)
class ShardPlan:
    """What tensor-parallel rank ``rank`` of ``size`` in pipeline stage ``stage`` holds: head, column,
    vocabulary and layer ranges of the full model. Its process is ``world_rank = stage * size + rank``."""

    rank: int
    size: int
    full: ModelConfig
    heads: tuple[int, int]  # query heads [start, end)
    kv_heads: tuple[int, int]  # KV heads [start, end)
    intermediate: tuple[int, int]  # gate/up columns [start, end)
    vocab: tuple[int, int]  # vocabulary rows [start, start + padded shard), may pass vocab_size
    stage: int = 0
    num_stages: int = 1
    layers: tuple[int, int] = (0, 0)  # the full model's layers [start, end) this stage runs

    @classmethod
    def for_world_rank(cls, config: ModelConfig, world_rank: int, size: int, stages: int = 1) -> ShardPlan:
        check_pipeline_parallel_size(config, stages)
        stage, rank = divmod(world_rank, size)
        plan = cls.for_rank(config, rank, size)
        return replace(plan, stage=stage, num_stages=stages, layers=stage_layers(config.num_layers, stages, stage))

    @property
    def world_rank(self) -> int:
        return self.stage * self.size + self.rank

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.num_stages - 1

    def peer(self, stage: int) -> int:
        """The world rank holding this rank's slice in another stage (hidden states go to it)."""
        return stage * self.size + self.rank

    @classmethod
    def for_rank(cls, config: ModelConfig, rank: int, size: int) -> ShardPlan:
        check_tensor_parallel_size(config, size)
        h, i = config.num_heads // size, config.intermediate_size // size
        if config.num_kv_heads % size == 0:
            k = config.num_kv_heads // size
            kv = (rank * k, rank * k + k)
        else:  # replicated: the KV head this rank's queries read
            first = rank // (size // config.num_kv_heads)
            kv = (first, first + 1)
        per = -(-config.vocab_size // size)
        return cls(
            rank,
            size,
            config,
            (rank * h, rank * h + h),
            kv,
            (rank * i, rank * i + i),
            (rank * per, rank * per + per),
            layers=(0, config.num_layers),
        )

    @property
    def config(self) -> ModelConfig:
        """The shard's own shapes: the existing Llama built from it *is* the shard."""
        return replace(
            self.full,
            num_heads=self.heads[1] - self.heads[0],
            num_kv_heads=self.kv_heads[1] - self.kv_heads[0],
            intermediate_size=self.intermediate[1] - self.intermediate[0],
            vocab_size=self.vocab[1] - self.vocab[0],
            num_layers=self.layers[1] - self.layers[0],
        )

    @property
    def kv_replication(self) -> int:
        """How many ranks hold each KV head (1 when the KV heads are split)."""
        return max(1, self.size // self.full.num_kv_heads)

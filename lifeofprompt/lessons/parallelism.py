"""When one device is not enough (notebook 15): how many devices a model needs, what tensor and
pipeline parallelism move between them, and a cost model of the links that move it.

* **Devices.** Notebook 05's land (``engine.memory.plan_memory``) shared out on each of ``T``
  ranks: each holds ``sizes.ShardPlan``'s slice of the weights (about 1/T) and its own KV heads
  (``kv_bytes_per_token / T``). ``devices_needed`` finds the smallest ``T`` whose ranks fit the
  weights *and* a given number of cached tokens.
* **Bytes.** Megatron's split needs one all-reduce of ``[tokens, hidden]`` after ``o_proj`` and one
  after ``down_proj`` in every layer (plus one after a vocab-parallel embedding); a pipeline sends
  ``[tokens, hidden]`` once per stage boundary.
* **Cost.** A message of ``n`` bytes costs ``L + n / β`` (latency L, bandwidth β): ``CostModel``
  (the latency is *L*, never α: notebook 14 uses α for the acceptance rate).
  ``fit_cost_model`` fits L and β to measured times by least squares, on sizes the engine never
  sends (``split_sizes``); ``predict_calls`` sets an engine's calls beside it; a ring all-reduce over
  ``T`` ranks takes ``2(T − 1)`` such steps of ``n / T`` bytes (``ring_all_reduce_s``).
* **Bubbles.** ``pipeline_schedule`` places each step's stages on a timeline: with one request
  in flight every stage waits for the others; ``m`` independent micro-batches leave idle a
  fraction ``(P − 1) / (m + P − 1)`` of the stage-time (``bubble_fraction``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..distributed.sizes import ShardPlan, valid_tensor_parallel_sizes
from ..engine.memory import dtype_bytes, estimate_activation_bytes, kv_bytes_per_token, plan_memory, weight_bytes
from ..errors import ConfigError, OutOfMemoryError
from ..model.config import ModelConfig
from .article_arithmetic import GPU_MEMORY_UTILIZATION, H100_REPORTED_BYTES
from .memory_arithmetic import kv_tokens

# meta-llama/Llama-3.1-70B: shapes from its config.json (no weights needed for the arithmetic).
LLAMA_3_1_70B = ModelConfig(
    name="meta-llama/Llama-3.1-70B",
    vocab_size=128256,
    hidden_size=8192,
    intermediate_size=28672,
    num_layers=80,
    num_heads=64,
    num_kv_heads=8,
    head_dim=128,
    rope_theta=500000.0,
    max_position_embeddings=131072,
    tie_word_embeddings=False,
    bos_token_id=128000,
    eos_token_ids=(128001,),
)


@dataclass(frozen=True)
class Card:
    """One accelerator: the memory software sees on it (bytes), its memory bandwidth (bytes/s)."""

    name: str
    memory: float
    bandwidth: float


# Memory as software sees it, as notebook 05 counts it (not the marketed size): an "80 GB" H100
# reports about 85.5 GB (81,559 MiB; ``article_arithmetic.H100_REPORTED_BYTES``), and an H200 sold as
# 141 GB reports 150,109,880,320 bytes (torch.cuda.get_device_properties(0).total_memory on the H200
# of benchmarks/results/h200-2026-11-30/gpu_results.json, ``env.gpu.total_memory``). HBM bandwidths
# from NVIDIA's H100 SXM and H200 data sheets.
H100_SXM = Card("H100 SXM (80 GB)", H100_REPORTED_BYTES, 3.35e12)
H200 = Card("H200 (141 GB)", 150_109_880_320, 4.8e12)


# ----------------------------------------------------------------------------- how many devices


def shard_config(config: ModelConfig, tensor_parallel_size: int) -> ModelConfig:
    """The shapes one tensor-parallel rank holds (the engine builds its shard from exactly this)."""
    return ShardPlan.for_rank(config, 0, tensor_parallel_size).config


def weight_bytes_per_rank(config: ModelConfig, dtype, tensor_parallel_size: int) -> int:
    """Weights on one rank: 1/T of every split matrix and the padded vocabulary, plus the replicated norms."""
    return weight_bytes(shard_config(config, tensor_parallel_size), dtype)


def kv_bytes_per_token_per_rank(config: ModelConfig, dtype, tensor_parallel_size: int) -> int:
    """Key + value bytes one token leaves on one rank: its own KV heads only (one when they are replicated)."""
    return kv_bytes_per_token(shard_config(config, tensor_parallel_size), dtype)


@dataclass(frozen=True)
class DeviceCount:
    """The smallest tensor-parallel split of ``model`` on ``card`` that holds ``tokens`` cached tokens."""

    model: str
    card: str
    tokens: int  # cached tokens asked for, all requests together
    tensor_parallel_size: int  # 0: no valid split fits
    weights_per_rank: int
    kv_bytes_per_token_per_rank: int
    kv_tokens: int  # tokens the split's pool holds (each rank the same tokens, its own heads)
    tried: tuple[tuple[int, str], ...]  # (T, why it does not fit) for the smaller sizes


def devices_needed(
    config: ModelConfig,
    dtype,
    card: Card,
    tokens: int,
    gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION,
    block_size: int = 16,
) -> DeviceCount:
    """Try each valid ``T`` in turn: each rank runs notebook 05's ``plan_memory`` on its own shard.

    The defaults are notebook 05's: the card's reported memory and current vLLM's 0.92, so at
    ``T = 1`` this counts exactly the tokens 05's ``plan_memory`` gives the same model and card.

    The activation workspace is ``estimate_activation_bytes`` of the shard (2,048 rows); the KV
    pool that is left must hold ``tokens`` tokens of the shard's heads.
    """
    if tokens < 0:
        raise ConfigError(f"tokens must be >= 0, got {tokens}")
    tried = []
    for size in valid_tensor_parallel_sizes(config):
        shard = shard_config(config, size)
        try:
            plan = plan_memory(
                shard,
                dtype,
                int(card.memory),
                gpu_memory_utilization,
                block_size,
                activations=estimate_activation_bytes(shard, dtype),
            )
        except OutOfMemoryError as exc:
            tried.append((size, str(exc).split(":")[0]))
            continue
        if kv_tokens(plan) >= tokens:
            return DeviceCount(
                config.name, card.name, tokens, size, plan.weights, plan.bytes_per_token, kv_tokens(plan), tuple(tried)
            )
        tried.append((size, f"its pool holds {kv_tokens(plan):,} tokens, not {tokens:,}"))
    return DeviceCount(config.name, card.name, tokens, 0, 0, 0, 0, tuple(tried))


# ----------------------------------------------------------------------------- bytes on the wire


def all_reduces_per_step(config: ModelConfig, vocab_parallel_embedding: bool = True) -> int:
    """Two per layer (after ``o_proj`` and ``down_proj``), one more after a vocab-parallel embedding."""
    return 2 * config.num_layers + (1 if vocab_parallel_embedding else 0)


def all_reduce_bytes_per_token(config: ModelConfig, dtype) -> int:
    """What one all-reduce sums per token: one row of the residual stream, ``hidden × bytes``."""
    return config.hidden_size * dtype_bytes(dtype)


def ring_traffic_per_rank(nbytes: int, ranks: int) -> float:
    """Bytes each rank sends in a ring all-reduce of ``nbytes``: ``2 (T − 1) / T × n``."""
    return 2 * (ranks - 1) / ranks * nbytes


# ----------------------------------------------------------------------------- cost model


@dataclass(frozen=True)
class CostModel:
    """``seconds(n) = latency + n / beta``: a fixed latency *L* per message, then bytes at a bandwidth β."""

    latency: float  # seconds per message (L)
    beta: float  # bytes per second

    def seconds(self, nbytes) -> float:
        return self.latency + nbytes / self.beta

    def total(self, calls: int, nbytes: float) -> float:
        """``calls`` messages carrying ``nbytes`` in all: the model is linear, so sizes need not be known one by one."""
        return calls * self.latency + nbytes / self.beta

    def describe(self) -> str:
        return f"L = {self.latency * 1e6:.1f} µs, β = {self.beta / 1e9:.2f} GB/s"


def fit_cost_model(sizes, seconds) -> CostModel:
    """Least squares of ``seconds = L + sizes / β`` over at least two distinct sizes.

    Weighted by 1/seconds (relative errors), so the small messages that pin L count as much
    as the large ones that pin β. Raises ``ConfigError`` when the data cannot give a positive
    L and β (a size that does not grow the time, one size only): a fit that means nothing.
    """
    sizes, seconds = [float(n) for n in sizes], [float(s) for s in seconds]
    if len(sizes) != len(seconds) or len(set(sizes)) < 2:
        raise ConfigError("fit_cost_model needs times at two or more distinct message sizes")
    w = [1 / s**2 for s in seconds]
    sw = sum(w)
    mx = sum(wi * x for wi, x in zip(w, sizes)) / sw
    my = sum(wi * y for wi, y in zip(w, seconds)) / sw
    sxx = sum(wi * (x - mx) ** 2 for wi, x in zip(w, sizes))
    slope = sum(wi * (x - mx) * (y - my) for wi, x, y in zip(w, sizes, seconds)) / sxx
    latency = my - slope * mx
    if slope <= 0 or latency <= 0:
        raise ConfigError(
            f"the times do not fit L + n/β with positive L and β (L = {latency:.3g} s, 1/β = {slope:.3g} s/byte)"
        )
    return CostModel(latency, 1 / slope)


def relative_errors(model: CostModel, sizes, seconds) -> list[float]:
    """``(predicted − measured) / measured`` at each size: what a fit is judged by on sizes it never saw."""
    return [(model.seconds(n) - s) / s for n, s in zip(sizes, seconds)]


def split_sizes(grid, sent) -> tuple[list[int], list[int]]:
    """``(fit, held_out)``: the grid's sizes outside ``[min(sent) / 2, 2 max(sent)]``, where the engine
    never sends, to fit on; and those inside, timed too but kept aside to judge the fit."""
    low, high = min(sent) / 2, 2 * max(sent)
    fit = [n for n in grid if not low <= n <= high]
    return fit, [n for n in grid if low <= n <= high]


def typical_seconds(calls) -> float:
    """``calls``: ``[(bytes, seconds), ...]``. The calls' time with each one at its size's median:
    a stall (the OS running another process first) lengthens one call, not its size's median."""
    by_size: dict[int, list[float]] = {}
    for nbytes, seconds in calls:
        by_size.setdefault(nbytes, []).append(seconds)
    return sum(len(t) * _median(t) for t in by_size.values())


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


@dataclass(frozen=True)
class CollectivePrediction:
    """One kind of collective of one engine run, measured on rank 0 and predicted, two ways:

    * ``measured`` (every call's wall time, stalls included: what the engine paid) against
      ``predicted``, a model fitted to mean call times;
    * ``typical`` (each call at its size's median) against ``typical_predicted``, a model fitted to
      median call times: the link's cost, which a loaded machine's stalls move far less.
    """

    op: str
    calls: int
    nbytes: int
    measured: float
    predicted: float
    typical: float
    typical_predicted: float

    @property
    def error(self) -> float:
        return (self.predicted - self.measured) / self.measured

    @property
    def typical_error(self) -> float:
        return (self.typical_predicted - self.typical) / self.typical


def predict_calls(op: str, calls, mean_model: CostModel, median_model: CostModel) -> CollectivePrediction:
    """``calls`` (``[(bytes, seconds), ...]``, one kind's, from ``distributed.collectives.samples``) beside
    what each model predicts for the same calls."""
    nbytes = sum(n for n, _ in calls)
    return CollectivePrediction(
        op,
        len(calls),
        nbytes,
        sum(t for _, t in calls),
        mean_model.total(len(calls), nbytes),
        typical_seconds(calls),
        median_model.total(len(calls), nbytes),
    )


def last_arrival_calls(rank_calls: list[list[tuple[int, float]]]) -> list[tuple[int, float]]:
    """One collective's calls, each at the shortest wait of any rank: the rank that arrived last waited for
    the link alone, the others also for it (on a loaded machine, for the OS to run it).

    ``rank_calls``: each rank's ``[(bytes, seconds), ...]`` of that kind, rank 0's first; every rank ran the
    same calls in the same order (an all-reduce of one tensor-parallel group), the others perhaps more
    before rank 0's count began, so each is aligned on its last ``len(rank_calls[0])``.
    """
    count = len(rank_calls[0])
    aligned = [calls[len(calls) - count :] for calls in rank_calls]
    if any(len(calls) != count or [n for n, _ in calls] != [n for n, _ in aligned[0]] for calls in aligned):
        raise ConfigError("the ranks' calls differ: last_arrival_calls needs the same collective on every rank")
    return [(nbytes, min(calls[i][1] for calls in aligned)) for i, (nbytes, _) in enumerate(aligned[0])]


def total_error(predictions, typical: bool = False) -> float:
    """Predicted over measured, summed over the kinds, minus one."""
    measured = sum(p.typical if typical else p.measured for p in predictions)
    predicted = sum(p.typical_predicted if typical else p.predicted for p in predictions)
    return (predicted - measured) / measured


# ----------------------------------------------------------------------------- real links


@dataclass(frozen=True)
class Link:
    """One hop of a collective: ``latency`` seconds to start (L), ``bandwidth`` bytes/s each way."""

    name: str
    latency: float
    bandwidth: float

    @property
    def cost(self) -> CostModel:
        return CostModel(self.latency, self.bandwidth)


# Published per-GPU bandwidths, each way: NVLink 4 gives an H100/H200 900 GB/s both ways; one NDR
# InfiniBand NIC 400 Gb/s. The latencies per ring step are assumptions (NIC, switch and NCCL's
# own overhead), of the order NCCL's small-message tests show, not measurements of ours.
NVLINK4 = Link("NVLink 4 (H100/H200): 900 GB/s both ways = 450 GB/s each way", 1e-6, 450e9)
INFINIBAND_NDR = Link("InfiniBand NDR: 400 Gb/s = 50 GB/s each way, one NIC per GPU", 5e-6, 50e9)


def ring_all_reduce_s(link: Link, nbytes: float, ranks: int) -> float:
    """A ring all-reduce: ``2 (T − 1)`` hops (reduce-scatter, then all-gather), each of ``n / T`` bytes."""
    if ranks <= 1:
        return 0.0
    return 2 * (ranks - 1) * link.cost.seconds(nbytes / ranks)


def tensor_parallel_step_s(config: ModelConfig, dtype, tokens: int, ranks: int, link: Link, layers=None) -> float:
    """All-reduce seconds of one step of ``tokens`` rows over ``ranks`` (``layers``: a stage's share)."""
    layers = config.num_layers if layers is None else layers
    calls = 2 * layers + 1
    return calls * ring_all_reduce_s(link, tokens * all_reduce_bytes_per_token(config, dtype), ranks)


def decode_read_s(config: ModelConfig, dtype, card: Card, ranks: int) -> float:
    """A decode step's floor on each of ``ranks`` tensor-parallel devices: its weight shard over the HBM bandwidth."""
    return weight_bytes_per_rank(config, dtype, ranks) / card.bandwidth


@dataclass(frozen=True)
class LayoutStep:
    """One step of ``tokens`` rows through ``tp × pp`` devices: reading weights, and communicating."""

    tp: int
    pp: int
    read_s: float  # every stage's weight read, one after the other (one step in flight)
    comm_s: float  # every stage's all-reduces plus the sends between stages

    @property
    def total_s(self) -> float:
        return self.read_s + self.comm_s


def layout_step_s(
    config: ModelConfig,
    dtype,
    card: Card,
    tokens: int,
    tp: int,
    pp: int = 1,
    intra: Link = NVLINK4,
    inter: Link = INFINIBAND_NDR,
    gpus_per_node: int = 8,
) -> LayoutStep:
    """The cost model of one step on GPUs: no overlap of reading and talking (an upper bound).

    A tensor-parallel group larger than a node rings over ``inter`` (a ring's step waits for its
    slowest hop); stage boundaries cross nodes once ``tp × pp`` exceeds a node. Each stage
    reads ``1/pp`` of a ``tp``-way shard; with one step in flight the stages run one after another.
    """
    tp_link = intra if tp <= gpus_per_node else inter
    pp_link = intra if tp * pp <= gpus_per_node else inter
    read = weight_bytes_per_rank(config, dtype, tp) / card.bandwidth  # pp stages of 1/pp each, in turn
    allreduce = tensor_parallel_step_s(config, dtype, tokens, tp, tp_link)  # all stages' layers together
    sends = (pp - 1) * pp_link.cost.seconds(tokens * all_reduce_bytes_per_token(config, dtype))
    return LayoutStep(tp, pp, read, allreduce + sends)


# ----------------------------------------------------------------------------- pipeline bubbles


@dataclass(frozen=True)
class StageSlot:
    """Stage ``stage`` runs step ``step`` of request group ``group`` from ``start`` to ``end``."""

    stage: int
    group: int
    step: int
    start: float
    end: float


def pipeline_schedule(num_stages: int, num_groups: int, steps: int = 1, stage_time: float = 1.0) -> list[StageSlot]:
    """Each group's steps through the stages in order, a stage running one step at a time.

    A group's next step may enter stage 0 only when its last one has left the last stage (its
    next input is the token that step sampled). ``num_groups`` independent groups with one step
    each is a GPipe pass of micro-batches; one group with many steps is batch-1 decoding.
    """
    if min(num_stages, num_groups, steps) < 1:
        raise ConfigError("pipeline_schedule needs at least one stage, one group and one step")
    free = [0.0] * num_stages  # when each stage is next free
    ready = [0.0] * num_groups  # when each group's previous step left the last stage
    slots = []
    for step in range(steps):
        for group in range(num_groups):
            t = ready[group]
            for stage in range(num_stages):
                start = max(t, free[stage])
                t = free[stage] = start + stage_time
                slots.append(StageSlot(stage, group, step, start, t))
            ready[group] = t
    return slots


def utilisation(slots: list[StageSlot], num_stages: int) -> float:
    """Busy stage-time over all stage-time until the last step ends."""
    makespan = max(s.end for s in slots) - min(s.start for s in slots)
    return sum(s.end - s.start for s in slots) / (num_stages * makespan)


def bubble_fraction(num_stages: int, num_microbatches: int) -> float:
    """The idle share of a pipeline pass over ``m`` micro-batches: ``(P − 1) / (m + P − 1)``."""
    return (num_stages - 1) / (num_microbatches + num_stages - 1)

"""``ModelRunner``: turns one scheduled step into a flat batch, runs the model, samples.

The scheduler decides *which* tokens run (``num_scheduled_tokens`` per sequence, starting at
``seq.num_computed_tokens``); the runner decides *how*: token ids and positions in one flat
tensor, each new token's cache slot from the sequence's block table, the block tables and
lengths as tensors, and logits only for sequences whose step reaches their last known token
(a prompt chunk in the middle of a prompt samples nothing).

Two paths share this code:

* CPU: fp32 weights, the torch paged attention, every step run eagerly;
* GPU: bf16 weights, the Triton kernels, the KV pool sized from the memory left after a
  profiling forward, and decode steps replayed from CUDA graphs. A graph is captured once per
  batch size of a ladder (1, 2, 4, 8, 16, 32, 48, ... up to ``max_num_seqs``); a step with B
  sequences replays the smallest graph with at least B rows, the extra rows being padding
  (slot -1: nothing is stored; length 1: attention reads one harmless slot). A graph bakes in
  tensor addresses and Python ints, so its inputs live in static buffers that each step fills,
  the block tables have a fixed width, and ``max_seq_len`` is the pool's limit.

Sampling runs on the device (``lifeofprompt.engine.sampler``); the one host synchronisation of a step
is reading the chosen ids back.

The CPU's measured fast paths are chosen in ``cpu_paths.py`` and the decode graphs' buffers live in
``cuda_graphs.py``; ``ModelRunner`` inherits both.
"""

from __future__ import annotations

import math

import torch

from ..errors import ConfigError, OutOfMemoryError
from ..model.allocator import keep_freed_memory
from ..model.attention import PagedCacheMetadata, PagedKVCache
from ..model.cpu_decode import takes_step as cpu_decode_takes_step
from ..model.huge_pages import move_weights_to_huge_pages
from ..model.linear import apply_plans
from ..model.linear_calibration import choose_cpu_linear
from .cpu_paths import CpuPathChoices
from .cuda_graphs import DecodeGraphs
from .memory import kv_bytes_per_block, plan_memory
from .sampler import Sampler
from .sequence import Sequence
from .step_output import Launch, StepOutput, sample_step


def resolve_backend(backend: str, device: torch.device) -> str:
    """``"auto"`` → Triton on CUDA, torch elsewhere; explicit names pass through."""
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if backend not in ("torch", "triton"):
        raise ConfigError(f"unknown attention backend {backend!r}: use 'auto', 'torch' or 'triton'")
    return backend


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """The ladder of decode batch sizes that get a CUDA graph: 1, 2, 4, 8, then every 16, up to ``max_num_seqs``."""
    if max_num_seqs < 1:
        raise ConfigError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 16))
    return sorted(set(sizes + [max_num_seqs]))


def padded_batch_size(batch: int, sizes: list[int]) -> int | None:
    """The smallest ladder size that holds ``batch`` rows (None: larger than every graph)."""
    for size in sizes:
        if size >= batch:
            return size
    return None


class ModelRunner(CpuPathChoices, DecodeGraphs):
    """Runs steps of a model over a paged KV pool.

    ``num_blocks=None`` sizes the pool: on a GPU from the memory free after a profiling forward
    (see ``profile_num_blocks``); on the CPU from ``cpu_kv_bytes`` (default 2 GiB, capped at
    what ``max_num_seqs`` sequences of ``max_model_len`` tokens could ever use).
    """

    def __init__(
        self,
        model,
        num_blocks: int | None = None,
        block_size: int = 16,
        backend: str = "auto",
        *,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int | None = None,
        max_model_len: int | None = None,
        enforce_eager: bool | None = None,
        gpu_memory_utilization: float = 0.9,
        cpu_kv_bytes: int = 2 << 30,
        fused_kernels: bool | None = None,
        prepack_cpu_weights: bool = True,
        cpu_linear: str | None = None,
        cpu_decode: bool | None = None,
        extra_kv_bytes_per_block: int = 0,
    ):
        if block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {block_size}")
        self.model = model
        self.config = model.config
        self.device = model.device
        self.block_size = block_size
        self.backend = resolve_backend(backend, self.device)
        # The fused Triton element-wise kernels (model.fused_hidden_states): on by default where
        # the Triton attention runs on a GPU; on the CPU only when asked (the interpreter is slow).
        if fused_kernels is None:
            fused_kernels = self.backend == "triton" and self.device.type == "cuda"
        self.fused_kernels = fused_kernels
        self.max_num_seqs = max_num_seqs
        self.max_model_len = min(
            max_model_len or self.config.max_position_embeddings, self.config.max_position_embeddings
        )
        self.max_num_batched_tokens = max_num_batched_tokens or max(self.max_model_len, 2048)
        self.max_blocks_per_seq = math.ceil(self.max_model_len / block_size)
        self.gpu_memory_utilization = gpu_memory_utilization
        self.sampler = Sampler()
        self.eos_token_ids: tuple[int, ...] = tuple(
            self.config.eos_token_ids
        )  # min_tokens holds these back (the engine adds the tokenizer's)
        self.memory_report: dict = {}
        self.extra_kv_bytes_per_block = extra_kv_bytes_per_block  # a draft model's KV share of every block
        self.draft = None  # a DraftModelProposer mirrors every eager forward
        if num_blocks is None:
            num_blocks = self.profile_num_blocks() if self.device.type == "cuda" else self.cpu_num_blocks(cpu_kv_bytes)
        self.num_blocks = num_blocks
        self.kv_cache = PagedKVCache.for_model(
            self.config, num_blocks, block_size, dtype=model.dtype, device=self.device
        )
        # On the CPU each matrix product takes the path measured fastest on this machine for its
        # shape and row count (model/linear_calibration.py); weights whose plan uses oneDNN get a packed
        # second copy (prepack_cpu_weights=False rules that path out: less memory).
        self.linear_choice = None
        self.prepack_cpu_weights = prepack_cpu_weights
        # On the CPU the weights move once into 2 MiB pages, which one core streams about a quarter
        # faster than 4 KiB ones (model/huge_pages.py); before the timing, so it times them there.
        self.huge_page_bytes = move_weights_to_huge_pages(model) if self.device.type == "cpu" else 0
        # ... and a big step's freed activations stay mapped for the next one (model/allocator.py).
        self.allocator_note = keep_freed_memory() if self.device.type == "cpu" else ""
        if self.device.type == "cpu" and model.dtype == torch.float32:
            self.linear_choice = choose_cpu_linear(model, cpu_linear, prepack=prepack_cpu_weights)
        self.prepacked_bytes = apply_plans(model, self.linear_choice.plans if self.linear_choice else None)
        self.decode_attention_in_c, self.decode_attention_reason = self.choose_decode_attention(cpu_decode)
        self.cpu_decode_reason = ""  # how the C step's row limit was chosen (start-up log)
        self.cpu_decode_rows = self.choose_cpu_decode_rows(cpu_decode)  # after the attention: the torch step uses it
        self.cpu_step_packed_bytes = self.pack_for_cpu_step()
        # Static decode buffers: used by CUDA graphs, and by the CPU tests that check the padding.
        self._alloc_static_buffers()
        if enforce_eager is None:
            enforce_eager = self.device.type != "cuda" or self.backend != "triton"
        self.enforce_eager = enforce_eager
        # Run decode steps through the graphs' padded static buffers even without graphs: the same
        # computation a graph replays, eagerly (to compare graph against eager, and test on the CPU).
        self.pad_decode_eagerly = False
        self.graph_sizes = graph_batch_sizes(max_num_seqs)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.rank_graphs = False  # a shard: every rank runs its own decode graphs (distributed/rank_graphs.py)
        if not enforce_eager:
            self.start_decode_graphs()

    def start_decode_graphs(self, capture: bool = True) -> None:
        """Capture the decode graphs; ``capture=False`` runs decode steps through the same padded buffers eagerly.

        A tensor-parallel shard cannot capture alone: every rank captures its own graphs, and each
        step's inputs are broadcast outside them (``distributed/rank_graphs.py``).
        """
        if hasattr(self.model, "start_decode_graphs"):
            self.model.start_decode_graphs(self, capture)
            self.rank_graphs = True
        elif capture:
            self.capture_graphs()
        else:
            self.pad_decode_eagerly = True

    # ------------------------------------------------------------------ memory

    def cpu_num_blocks(self, kv_bytes: int) -> int:
        """Blocks that fit ``kv_bytes`` (at most what max_num_seqs full-length sequences use)."""
        per_block = self.kv_bytes_per_block() + self.extra_kv_bytes_per_block
        return max(1, min(kv_bytes // per_block, self.max_num_seqs * self.max_blocks_per_seq + 1))

    def kv_bytes_per_block(self) -> int:
        """Bytes of one block of K and V across all layers (notebook 05's arithmetic)."""
        return kv_bytes_per_block(self.config, self.model.dtype, self.block_size)

    def dummy_prefill(self, cache: PagedKVCache, num_tokens: int, num_seqs: int) -> torch.Tensor:
        """One forward of ``num_tokens`` prompt tokens split over ``num_seqs`` sequences (profiling, warm-up)."""
        num_seqs = max(1, min(num_seqs, num_tokens))
        lengths = [num_tokens // num_seqs + (1 if i < num_tokens % num_seqs else 0) for i in range(num_seqs)]
        seqs, next_block = [], 0
        from .sampling_params import SamplingParams

        for i, n in enumerate(lengths):
            seq = Sequence(f"dummy-{i}", [i % self.config.vocab_size] * n, SamplingParams(temperature=0))
            blocks = math.ceil(n / self.block_size)
            seq.block_table = [(next_block + b) % cache.num_blocks for b in range(blocks)]
            next_block += blocks
            seqs.append(seq)
        input_ids, positions, meta = self.prepare(seqs, lengths, cache=cache)
        return self.run_model(input_ids, positions, meta)

    def run_model(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: PagedCacheMetadata) -> torch.Tensor:
        """The model's forward as this runner runs it: the fused C decode step, the fused Triton kernels, or plain."""
        fused = self.fused_kernels
        if cpu_decode_takes_step(input_ids.shape[0], self.cpu_decode_rows, meta.cache.kv):
            fused = self.cpu_step_layout(input_ids.shape[0])
        return self.model(input_ids, positions, meta, fused_kernels=fused)

    @torch.no_grad()
    def profile_num_blocks(self) -> int:
        """KV blocks that fit in ``gpu_memory_utilization`` × the device after the model and its peak workspace.

        Runs one prefill of ``max_num_batched_tokens`` tokens over ``max_num_seqs`` sequences (the
        largest step the scheduler may send) with a small scratch pool, measures the peak, and hands
        the numbers to ``lifeofprompt.engine.memory.plan_memory`` (notebook 05's function).
        """
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        weights = torch.cuda.memory_allocated()
        tokens = self.max_num_batched_tokens
        scratch_blocks = math.ceil(tokens / self.block_size) + self.max_num_seqs
        scratch = PagedKVCache.for_model(
            self.config, scratch_blocks, self.block_size, dtype=self.model.dtype, device=self.device
        )
        torch.cuda.reset_peak_memory_stats()
        self.dummy_prefill(scratch, tokens, self.max_num_seqs)
        torch.cuda.synchronize()
        activations = torch.cuda.max_memory_allocated() - weights - scratch.nbytes
        del scratch
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        non_torch = max(0, (total - free) - torch.cuda.memory_reserved())
        plan = plan_memory(
            self.config,
            self.model.dtype,
            total,
            self.gpu_memory_utilization,
            self.block_size,
            weights=weights,
            activations=activations + non_torch,
            activations_measured=True,
        )
        self.memory_plan = plan
        if self.extra_kv_bytes_per_block:  # the draft's pool takes its share of every block
            per_block = self.kv_bytes_per_block()
            blocks = plan.num_gpu_blocks * per_block // (per_block + self.extra_kv_bytes_per_block)
            if blocks < 1:
                raise OutOfMemoryError("speculative_config['model']: the draft leaves no room for one KV block")
            return blocks
        self.memory_report = dict(
            plan.as_dict(),
            activation_bytes_torch=activations,
            non_torch_bytes=non_torch,
            profiled_tokens=tokens,
            profiled_seqs=self.max_num_seqs,
        )
        return plan.num_gpu_blocks

    # ------------------------------------------------------------------ one step

    def prepare(self, seqs: list[Sequence], num_scheduled_tokens: list[int], cache: PagedKVCache | None = None):
        """Flat ``input_ids``, ``positions`` and the paged metadata of one step (built on the host, copied once)."""
        ids, positions, query_lens, seq_lens, logits_rows, seq_of_row = [], [], [], [], [], []
        for b, (seq, n) in enumerate(zip(seqs, num_scheduled_tokens)):
            start = seq.num_computed_tokens
            tokens = seq.tokens_with_spec()
            ids.extend(tokens[start : start + n])
            positions.extend(range(start, start + n))
            seq_of_row.extend([b] * n)
            query_lens.append(n)
            seq_lens.append(start + n)
            if start + n == len(tokens):  # a verify wants every row it checks: the last 1 + k
                logits_rows.extend(range(len(ids) - 1 - len(seq.spec_token_ids), len(ids)))
        width = max(len(s.block_table) for s in seqs)
        block_tables = torch.tensor(
            [s.block_table + [-1] * (width - len(s.block_table)) for s in seqs], dtype=torch.int32
        )
        pos = torch.tensor(positions, dtype=torch.long)
        rows = torch.tensor(seq_of_row, dtype=torch.long)
        slots = block_tables[rows, pos // self.block_size].long() * self.block_size + pos % self.block_size
        device = self.device
        fields = PagedCacheMetadata.describe_batch(query_lens, seq_lens, device)
        fields["logits_indices"] = torch.tensor(logits_rows, dtype=torch.long).to(device, non_blocking=True)
        meta = PagedCacheMetadata(
            **fields,
            cache=cache or self.kv_cache,
            block_tables=block_tables.to(device, non_blocking=True),
            slot_mapping=slots.to(device, non_blocking=True),
            backend=self.backend,
            decode_in_c=self.decode_attention_in_c,
        )
        return (
            torch.tensor(ids, dtype=torch.long).to(device, non_blocking=True),
            pos.to(device, non_blocking=True),
            meta,
        )

    @staticmethod
    def is_decode(seqs: list[Sequence], num_scheduled_tokens: list[int]) -> bool:
        """Every sequence runs exactly its one newest token (the shape CUDA graphs serve)."""
        return all(n == 1 and s.num_computed_tokens + 1 == len(s) for s, n in zip(seqs, num_scheduled_tokens))

    def forward(self, seqs: list[Sequence], num_scheduled_tokens: list[int]) -> torch.Tensor:
        """Logits ``[rows that sample, vocab]`` of one step (``forward_step`` without how it ran)."""
        return self.forward_step(seqs, num_scheduled_tokens)[0]

    @torch.no_grad()
    def forward_step(self, seqs: list[Sequence], num_scheduled_tokens: list[int]) -> tuple[torch.Tensor, Launch]:
        """Logits ``[rows that sample, vocab]`` of one step and how it ran: graph replay for decode, else eager."""
        if self.draft is None and self.is_decode(seqs, num_scheduled_tokens):  # a draft mirrors eager steps only
            padded = self.graphs or self.pad_decode_eagerly or self.rank_graphs
            size = padded_batch_size(len(seqs), self.graph_sizes) if padded else None
            if size is not None:
                return self.padded_decode(seqs, size)
        input_ids, positions, meta = self.prepare(seqs, num_scheduled_tokens)
        logits = self.run_model(input_ids, positions, meta)
        if self.draft is not None:
            self.draft.mirror(input_ids, positions, meta)
        return logits, self.launch("eager", input_ids.shape[0])

    def padded_decode(self, seqs: list[Sequence], size: int) -> tuple[torch.Tensor, Launch]:
        """A decode step through the static buffers, padded to ``size`` rows: a graph's replay, or its
        computation run eagerly; with tensor parallelism, on every rank at once."""
        if self.rank_graphs:
            from ..distributed.rank_graphs import replay_payload

            captured = bool(self.model.decode_graphs.graphs)
            self.fill_static_decode(seqs, size)
            logits = self.model.replay_decode(size, replay_payload(self, size))[: len(seqs)]
            mode = "CUDA graph replay on every rank" if captured else "padded eager decode on every rank"
            return logits, self.launch(mode, len(seqs), size)
        if not self.graphs:
            return self.run_static_decode(seqs, size), self.launch("padded eager decode", len(seqs), size)
        self.fill_static_decode(seqs, size)
        graph, logits = self.graphs[size]
        graph.replay()
        return logits[: len(seqs)], self.launch("CUDA graph replay", len(seqs), size)

    def launch(self, mode: str, rows: int, padded_to: int | None = None) -> Launch:
        """How a step of ``rows`` rows ran, for its trace."""
        path = (
            self.cpu_step_layout(rows) if cpu_decode_takes_step(rows, self.cpu_decode_rows, self.kv_cache.kv) else None
        )
        return Launch(mode, rows, padded_to, self.backend, path or self.fused_kernels)

    @torch.no_grad()
    def execute(self, seqs: list[Sequence], num_scheduled_tokens: list[int]) -> StepOutput:
        """Run one step: its tokens, logprobs and failures, and how it ran (``step_output.py``)."""
        logits, launch = self.forward_step(seqs, num_scheduled_tokens)
        return self.sample_step(seqs, num_scheduled_tokens, logits, launch)

    @torch.no_grad()
    def submit(self, seqs: list[Sequence], num_scheduled_tokens: list[int]):
        """Start one step on a pipelined model (P > 1) and return before its logits are back.

        Stage 0 runs its layers here and sends the step on (``ShardedLlamaForCausalLM.submit``);
        ``collect`` waits for the logits and samples. Always eager: a step in the pipe keeps no
        static buffer, so another step can be prepared while it runs.
        """
        input_ids, positions, meta = self.prepare(seqs, num_scheduled_tokens)
        return self.model.submit(input_ids, positions, meta, fused_kernels=self.fused_kernels), self.launch(
            "pipelined eager", input_ids.shape[0]
        )

    @torch.no_grad()
    def collect(self, pending, seqs: list[Sequence], num_scheduled_tokens: list[int]) -> StepOutput:
        """The end of a ``submit``ted step: its logits, then exactly ``execute``'s sampling."""
        logits_on_the_way, launch = pending
        return self.sample_step(seqs, num_scheduled_tokens, logits_on_the_way.wait(), launch)

    def sample_step(self, seqs: list[Sequence], num_scheduled_tokens: list[int], logits, launch) -> StepOutput:
        """``execute``'s second half: the step's tokens from its logits (``step_output.sample_step``)."""
        out = sample_step(self.sampler, seqs, num_scheduled_tokens, logits, self.eos_token_ids)
        out.launch = launch
        return out


def run_greedy_loop(
    runner: ModelRunner, prompts: list[list[int]], max_tokens: int | list[int], params=None, chunk: int | None = None
) -> list[list[int]]:
    """Drive a runner without a scheduler: each prompt gets its blocks up front, one prefill step, then
    every sequence decodes together until its ``max_tokens`` (EOS ignored).

    The engine's scheduler does this properly (admission, chunking, preemption); this loop exists
    so the runner can be tested and benchmarked on its own.
    """
    from .sampling_params import SamplingParams

    params = params or SamplingParams(temperature=0, ignore_eos=True)
    limits = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
    seqs, next_block = [], 0
    for i, (prompt, limit) in enumerate(zip(prompts, limits)):
        seq = Sequence(f"r{i}", prompt, params)
        blocks = math.ceil((len(prompt) + limit) / runner.block_size)
        if next_block + blocks > runner.num_blocks:
            raise OutOfMemoryError(
                f"run_greedy_loop: {len(prompts)} requests need more than {runner.num_blocks} blocks"
            )
        seq.block_table = list(range(next_block, next_block + blocks))
        next_block += blocks
        seqs.append(seq)
    budget = chunk or runner.max_num_batched_tokens
    pending = list(seqs)
    while pending:  # prefill, as many whole prompts per step as fit the budget
        batch, used = [], 0
        while pending and (not batch or used + len(pending[0]) <= budget):
            used += len(pending[0])
            batch.append(pending.pop(0))
        step(runner, batch, [len(s) for s in batch])
    running = [s for s, limit in zip(seqs, limits) if len(s.output_token_ids) < limit]
    while running:
        for start in range(0, len(running), runner.max_num_seqs):
            group = running[start : start + runner.max_num_seqs]
            step(runner, group, [1] * len(group))
        running = [s for s, limit in zip(seqs, limits) if len(s.output_token_ids) < limit]
    return [s.output_token_ids for s in seqs]


def step(runner: ModelRunner, seqs: list[Sequence], num_tokens: list[int]) -> None:
    """One runner step, then the bookkeeping a scheduler would do: advance counters, append samples."""
    sampled = runner.execute(seqs, num_tokens).tokens
    for seq, n, token in zip(seqs, num_tokens, sampled):
        seq.num_computed_tokens += n
        if token is not None:
            seq.output_token_ids.append(token)

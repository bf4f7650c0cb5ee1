"""``ModelRunner``: the engine's start-up, then one scheduled step at a time: a flat batch, the model, samples.

Start-up is the runner's construction, one named step after another (``__init__``), for a model
that arrives prepared for its device (``model/loader.py: prepare_for_device``: its speed-ups, a
CPU's from ``cpu/``, the weights placed): plan the KV pool's blocks from the settings, profile the
pool's size (a GPU), choose the fast paths with it, freeze every choice in the ``ResolvedConfig``,
allocate the pool, capture the decode graphs (a GPU).

Then each step: the scheduler decides *which* tokens run (``num_scheduled_tokens`` per sequence,
from ``seq.num_computed_tokens``); the runner decides *how*: token ids and positions in one flat
tensor, each new token's cache slot from its sequence's block table, logits only for the rows
that sample (a prompt chunk short of its prompt's end samples nothing), then the model's forward
(which runs its own C step where the CPU's start-up gave it one), or a decode replayed from a CUDA
graph (``cuda_graphs.py``). Sampling
runs on the device (``step_output.py``); reading the chosen ids back is the step's main host
synchronisation (logprobs and verifies read theirs too), and the step returns a ``StepOutput``.
"""

from __future__ import annotations

import math

import torch

from ..errors import OutOfMemoryError, RequestFailedError
from ..model.attention import NoCacheMetadata, PagedCacheMetadata, PagedKVCache, synthetic_step
from ..model.kv_cache_formats import FP8_MAX, check_kv_dtype
from ..model.loader import prepare_for_device
from .block_tables import BlockTables
from .config import CPU_KV_CACHE_MEMORY, DEFAULT_STEP_TOKENS, EngineConfig, context_len, resolve
from .cuda_graphs import DecodeGraphs, padded_batch_size
from .memory import kv_bytes_per_block, plan_memory
from .prompt_logprobs import plan_prompt_rows, score_prompt_rows
from .sampler import Sampler
from .sequence import Sequence
from .step_output import Launch, StepOutput, sample_step


def plan_kv_blocks(model, config: EngineConfig, draft_bytes_per_block: int = 0) -> int | None:
    """How many KV blocks the pool gets, decided before anything is timed (the timing leaves room for them):
    ``num_kv_blocks`` as given; else a byte budget (``kv_cache_memory``, or 2 GiB on a CPU) over the bytes
    of a block (with a draft model's share), at most what ``max_num_seqs`` sequences of the longest request
    could use; else None: a GPU's pool is sized by a profiling forward (``ModelRunner.profile_kv_blocks``)."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    if config.kv_cache_memory is None and model.device.type == "cuda":
        return None
    per_block = kv_bytes_per_block(model.config, model.dtype, config.block_size, config.kv_cache_dtype)
    kv_bytes = config.kv_cache_memory or CPU_KV_CACHE_MEMORY
    blocks = kv_bytes // (per_block + draft_bytes_per_block)
    if blocks < 1:
        draft = "speculative_config['model']: with the draft's KV beside the model's, " if draft_bytes_per_block else ""
        raise OutOfMemoryError(
            f"{draft}kv_cache_memory={kv_bytes} bytes holds not one block of {config.block_size} tokens"
        )
    longest = context_len(config, model.config)
    return int(min(blocks, config.max_num_seqs * -(-longest // config.block_size) + 1))


class ModelRunner:
    """Runs steps of a model over a paged KV pool; built once per engine (``engine/README.md``)."""

    def __init__(self, model, config: EngineConfig, speedups, *, draft_kv_bytes_per_block: int = 0):
        """Start-up, in the order it must happen, for a model prepared for its device: ``speedups`` is
        what ``model/loader.py: prepare_for_device`` gave (the weights already placed)."""
        self.model, self.device, self.sampler = model, model.device, Sampler()
        self.eos_token_ids = tuple(model.config.eos_token_ids)  # min_tokens holds these back (+ the tokenizer's)
        self.draft = None  # a DraftModelProposer mirrors every eager forward
        self.graphs: DecodeGraphs | None = None  # decode steps through static buffers (CUDA graphs)
        self.memory_plan = None  # a GPU's plan of its memory (memory.MemoryPlan)
        self.speedups = speedups
        check_kv_dtype(config.kv_cache_dtype, model.config.head_dim, model.device.type, speedups.backend)
        num_blocks = plan_kv_blocks(model, config, draft_kv_bytes_per_block)  # None on a GPU: profiled next
        num_blocks = num_blocks or self.profile_kv_blocks(config, draft_kv_bytes_per_block)
        self.speedups.choose(num_blocks)
        cuda_graphs = self.speedups.cuda_graphs and not draft_kv_bytes_per_block  # a draft mirrors eager steps
        self.resolved = resolve(config, model, num_blocks, self.speedups, cuda_graphs)
        self.kv_cache = self.allocate_kv_cache()
        r = self.resolved  # room for twice a step's sequences, each as long as a request may be
        self.block_tables = BlockTables(2 * r.scheduler.max_num_seqs, r.max_blocks_per_seq + 1)
        if cuda_graphs:  # once the pool the graphs read exists
            self.start_decode_graphs()

    @classmethod
    def for_model(cls, model, **settings) -> ModelRunner:
        """A runner from engine settings by name (``EngineConfig.from_settings``), without an engine: tests,
        notebooks, benchmarks. The model is prepared for its device here, as the engine does."""
        config = EngineConfig.from_settings(model=model, **settings)
        return cls(model, config, prepare_for_device(model, config))

    # ------------------------------------------------------------------ start-up steps
    @torch.no_grad()
    def profile_kv_blocks(self, config: EngineConfig, draft_bytes_per_block: int) -> int:
        """KV blocks that fit in ``gpu_memory_utilization`` × the device after the weights and the peak
        workspace of the largest step the scheduler may send (one prefill of the step's token budget over
        ``max_num_seqs`` sequences, measured over a small scratch pool); chapter 05's ``plan_memory``."""
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        per_block = kv_bytes_per_block(self.model.config, self.model.dtype, config.block_size, config.kv_cache_dtype)
        weights = torch.cuda.memory_allocated()
        tokens, seqs = config.max_num_batched_tokens or DEFAULT_STEP_TOKENS, config.max_num_seqs
        scratch_blocks = math.ceil(tokens / config.block_size) + seqs
        scratch = PagedKVCache.for_model(
            self.model.config, scratch_blocks, config.block_size, self.model.dtype, self.device
        )
        torch.cuda.reset_peak_memory_stats()
        seqs = max(1, min(seqs, tokens))
        lengths = [tokens // seqs + (1 if i < tokens % seqs else 0) for i in range(seqs)]
        self.run_model(*synthetic_step(self.model, scratch, lengths, backend=self.speedups.attention))
        torch.cuda.synchronize()
        activations = torch.cuda.max_memory_allocated() - weights - scratch.nbytes
        del scratch
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        non_torch = max(0, (total - free) - torch.cuda.memory_reserved())
        self.memory_plan = plan_memory(
            self.model.config,
            self.model.dtype,
            total,
            config.gpu_memory_utilization,
            config.block_size,
            weights=weights,
            activations=activations + non_torch,
            activations_measured=True,
            kv_dtype=config.kv_cache_dtype,
        )
        blocks = self.memory_plan.num_gpu_blocks * per_block // (per_block + draft_bytes_per_block)
        if blocks < 1:
            raise OutOfMemoryError("speculative_config['model']: the draft leaves no room for one KV block")
        return blocks

    def allocate_kv_cache(self) -> PagedKVCache:
        """The pool itself, once every choice is made: its size is the resolved block count."""
        r = self.resolved
        config = self.model.config
        return PagedKVCache.for_model(
            config, r.num_kv_blocks, r.block_size, self.model.dtype, self.device, r.kv_cache_dtype
        )

    def calibrate_kv_cache(self, ids: list[int]) -> None:
        """An fp8 pool's per-layer key and value scales, from one forward of ``ids`` (the engine gives the
        shipped evaluation text's tokens: ``kv_cache_formats.fp8_scales``)."""
        if self.kv_cache.kv_dtype == "fp8":
            self.kv_cache.scales.copy_(fp8_scales(self.model, ids))
        if self.draft is not None and self.draft.kv_cache.kv_dtype == "fp8":  # the draft's own layers
            self.draft.kv_cache.scales.copy_(fp8_scales(self.draft.model, ids))

    def start_decode_graphs(self, capture: bool = True) -> None:
        """Decode steps through static buffers, replayed from CUDA graphs (``capture=False``: the same padded
        computation run eagerly). A tensor-parallel shard cannot capture alone: every rank captures its own
        graphs, and each step's inputs go to them from these buffers (``distributed/rank_graphs.py``)."""
        every_rank = hasattr(self.model, "start_decode_graphs")
        self.graphs = DecodeGraphs(self, capture=capture and not every_rank)
        self.graphs.on_every_rank = every_rank
        if every_rank:
            self.model.start_decode_graphs(self, capture)

    # ------------------------------------------------------------------ one step
    def prepare(self, seqs: list[Sequence], num_scheduled_tokens: list[int]):
        """Flat ``input_ids``, ``positions`` and the paged metadata of one step (built on the host, copied once)."""
        ids, positions, query_lens, seq_lens, logits_rows, seq_of_row = [], [], [], [], [], []
        for b, (seq, n) in enumerate(zip(seqs, num_scheduled_tokens)):
            start = seq.num_computed_tokens
            ids.extend(seq.tokens_in(start, start + n))
            positions.extend(range(start, start + n))
            seq_of_row.extend([b] * n)
            query_lens.append(n)
            seq_lens.append(start + n)
            if start + n == len(seq) + len(seq.spec_token_ids):  # a verify wants every row it checks: the last 1 + k
                logits_rows.extend(range(len(ids) - 1 - len(seq.spec_token_ids), len(ids)))
        cache = self.kv_cache
        block_tables = self.block_tables.for_step(seqs)  # kept between steps, written where they changed
        # On a GPU the step's fresh host tensors sit in pinned pages, as nano-vllm's do: a copy from them
        # runs beside the host instead of waiting for it (the block tables' buffer, rewritten in place
        # between steps, stays pageable: its copy finishes before the host goes on).
        pin = self.device.type == "cuda"
        pos = torch.tensor(positions, dtype=torch.long, pin_memory=pin)
        rows = torch.tensor(seq_of_row, dtype=torch.long)
        block_size = cache.block_size
        slots = block_tables[rows, pos // block_size].long() * block_size + pos % block_size
        slots = slots.pin_memory() if pin else slots
        logits_indices = torch.tensor(logits_rows, dtype=torch.long, pin_memory=pin)
        meta = PagedCacheMetadata.for_batch(
            query_lens, seq_lens, block_tables, slots, cache, self.speedups.attention, self.device, logits_indices
        )
        input_ids = torch.tensor(ids, dtype=torch.long, pin_memory=pin).to(self.device, non_blocking=True)
        return input_ids, pos.to(self.device, non_blocking=True), meta

    def run_model(self, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        """The model's forward (on a CPU, its own C step takes a small step: ``model/llama.py: hidden_states``)."""
        return self.model(input_ids, positions, meta)

    @staticmethod
    def is_decode(seqs: list[Sequence], num_scheduled_tokens: list[int]) -> bool:
        """Every sequence runs exactly its one newest token (the shape CUDA graphs serve)."""
        return all(n == 1 and s.num_computed_tokens + 1 == len(s) for s, n in zip(seqs, num_scheduled_tokens))

    @torch.no_grad()
    def forward_step(self, seqs: list[Sequence], num_scheduled_tokens: list[int]) -> tuple[torch.Tensor, Launch]:
        """Logits ``[rows that sample, vocab]`` of one step and how it ran: graph replay for decode, else eager."""
        if self.graphs is not None and self.draft is None and self.is_decode(seqs, num_scheduled_tokens):
            size = padded_batch_size(len(seqs), self.graphs.graph_sizes)  # a draft mirrors eager steps only
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
        self.graphs.fill(seqs, size)
        if self.graphs.on_every_rank:
            from ..distributed.rank_graphs import replay_payload

            logits = self.model.replay_decode(size, replay_payload(self.graphs, size))
            mode = "CUDA graph replay" if self.model.decode_graphs.graphs else "padded eager decode"
            return logits[: len(seqs)], self.launch(mode + " on every rank", len(seqs), size)
        mode = "CUDA graph replay" if size in self.graphs.graphs else "padded eager decode"
        return self.graphs.run(size)[: len(seqs)], self.launch(mode, len(seqs), size)

    def launch(self, mode: str, rows: int, padded_to: int | None = None) -> Launch:
        """How a step of ``rows`` rows ran, for its trace."""
        return Launch(mode, rows, padded_to, self.speedups.backend, self.forward_taken())

    def forward_taken(self) -> str:
        """Which way the model's layers ran the step just run: its C step (and the layout, as the model
        noted it: ``model/llama.py: c_step_layout``), the layers' fused kernels (a GPU:
        ``model/layers.py``) or the torch layers."""
        layout = getattr(self.model, "c_step_layout", None)
        if layout is not None:
            return f"c-step ({layout})"
        return "fused" if self.speedups.fused_kernels else "torch"

    @torch.no_grad()
    def execute(self, seqs: list[Sequence], num_scheduled_tokens: list[int]) -> StepOutput:
        """Run one step: its tokens, logprobs and failures, and how it ran (``step_output.py``)."""
        if any(seq.prompt_logprobs is not None for seq in seqs):  # a request that scores its prompt
            prompt_rows = plan_prompt_rows(seqs, num_scheduled_tokens)  # None unless this step has its rows
            if prompt_rows is not None:
                return self.scoring_step(seqs, num_scheduled_tokens, prompt_rows)
        logits, launch = self.forward_step(seqs, num_scheduled_tokens)
        return self.sample_step(seqs, num_scheduled_tokens, logits, launch)

    @torch.no_grad()
    def scoring_step(self, seqs: list[Sequence], num_scheduled_tokens: list[int], prompt_rows) -> StepOutput:
        """``execute`` for a step with prompt rows to score (``prompt_logprobs.py``): always eager, the hidden
        states of every row kept, the sampling rows' logits taken from them, then the prompt rows scored in
        slices. Only such steps pay for it; the others never come here."""
        if not hasattr(self.model, "hidden_states"):  # a split model's ranks hold the hidden states
            raise RequestFailedError("prompt_logprobs needs the whole model in one process")
        input_ids, positions, meta = self.prepare(seqs, num_scheduled_tokens)
        rows = input_ids.shape[0]
        hidden = self.model.hidden_states(input_ids, positions, meta)
        if self.draft is not None:
            self.draft.mirror(input_ids, positions, meta)
        logits = self.model.lm_head(hidden[meta.logits_indices]).float()
        out = self.sample_step(seqs, num_scheduled_tokens, logits, self.launch("eager, prompt rows scored", rows))
        out.prompt_logprobs = score_prompt_rows(self.model.lm_head, hidden, prompt_rows)
        return out

    @torch.no_grad()
    def submit(self, seqs: list[Sequence], num_scheduled_tokens: list[int]):
        """Start one step on a pipelined model (P > 1) and return before its logits are back.

        Stage 0 runs its layers here and sends the step on (``ShardedLlamaForCausalLM.submit``);
        ``collect`` waits for the logits and samples. Always eager: a step in the pipe keeps no
        static buffer, so another step can be prepared while it runs.
        """
        input_ids, positions, meta = self.prepare(seqs, num_scheduled_tokens)
        return self.model.submit(input_ids, positions, meta), self.launch("pipelined eager", input_ids.shape[0])

    @torch.no_grad()
    def collect(self, pending, seqs: list[Sequence], num_scheduled_tokens: list[int]) -> StepOutput:
        """The end of a ``submit``ted step: its logits, then exactly ``execute``'s sampling."""
        logits_on_the_way, launch = pending
        return self.sample_step(seqs, num_scheduled_tokens, logits_on_the_way.wait(), launch)

    def sample_step(
        self, seqs: list[Sequence], num_scheduled_tokens: list[int], logits, launch, samples=None
    ) -> StepOutput:
        """``execute``'s second half: the step's tokens from its logits (``step_output.sample_step``;
        ``samples``: which sequences sample, as scheduled, where the scheduler already counted the step)."""
        out = sample_step(self.sampler, seqs, num_scheduled_tokens, logits, self.eos_token_ids, samples)
        out.launch = launch
        return out


@torch.no_grad()
def fp8_scales(model, ids: list[int]) -> torch.Tensor:
    """``[num_layers, 2]``: each layer's largest key and value magnitude over one forward of ``ids`` (the
    shipped evaluation text), over 448, so that those land at e4m3's largest value. Deterministic: the same
    text and weights give the same scales, whatever the first requests are."""
    largest = torch.zeros(model.config.num_layers, 2)

    class Recording(NoCacheMetadata):
        def attend(self, layer_idx, q, k, v):
            largest[layer_idx, 0] = k.abs().max().float()
            largest[layer_idx, 1] = v.abs().max().float()
            return super().attend(layer_idx, q, k, v)

    own_step, model.cpu_step = getattr(model, "cpu_step", None), None  # the torch layers, which call attend
    try:
        tokens = torch.tensor(ids, device=model.device)
        model.hidden_states(tokens, torch.arange(len(ids), device=model.device), Recording.for_lengths([len(ids)]))
    finally:
        model.cpu_step = own_step
    return (largest / FP8_MAX).clamp_min(1e-8)

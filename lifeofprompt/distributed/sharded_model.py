"""The existing Llama, split Megatron-style: one model implementation, built from a shard's shapes.

``ShardPlan.config`` is the full model's config with ``num_heads / T`` query heads, its KV
heads, ``intermediate / T`` columns and ``vocab / T`` rows. ``LlamaForCausalLM`` built from it
has exactly the shapes of one rank's shard, and runs it with its own attention code (the KV
pool built from the same config holds only this rank's heads). Three modules change:

* ``o_proj`` and ``down_proj`` become ``RowParallelLinear``: each rank multiplies its columns,
  and one all-reduce sums the partial results (two all-reduces a layer);
* the embedding becomes ``VocabParallelEmbedding``: each rank looks up the ids in its rows,
  zeros the others, and one all-reduce sums them (the LM head shares the same shard when the
  weights are tied; its logits are gathered to rank 0, see ``step.gather_logits``).

q/k/v and gate/up stay the plain fused ``Linear``: column-parallel needs no communication,
only the right rows of the full weight (``shard_weights``).

Vocab-parallel rather than replicated: SmolLM2's tied 49152 × 576 embedding is a fifth of
its weights, so replicating it would leave each of 3 ranks ~47% of the model instead of a
third; the price is one all-reduce of ``[tokens, hidden]`` and one gather of ``[rows, vocab / T]``
logits a step. (A choice from the bytes, not a timing.)

Pipeline stages: the config's ``num_layers`` is the stage's share, so its layers (and its KV
pool) are numbered from 0; the first stage keeps the embedding, the last the final norm and
the LM head (a copy of the embedding's shard when they are tied). A stage receives the step and
the hidden states of the one before it and sends them on (``pipeline.py``); the last stage's
tensor-parallel rank 0 sends the logits to rank 0, which samples. On rank 0, ``submit`` runs
stage 0's part and returns the logits still on their way (P > 1), so the engine can keep
several steps in the pipe; ``forward`` is ``submit`` and wait.
"""

from __future__ import annotations

import contextlib
import time

import torch
from torch import nn

from ..model.linear import Linear
from ..model.llama import LlamaForCausalLM
from . import collectives, pipeline, step
from .sizes import ShardPlan


class RowParallelLinear(Linear):
    """``x[:, my columns] @ W[:, my columns].T``, summed over the tensor-parallel ranks by one all-reduce."""

    group = None  # this stage's tensor-parallel group (None: every rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        collectives.all_reduce(out, group=self.group)
        return out


class VocabParallelEmbedding(nn.Embedding):
    """Rows ``[start, start + num_embeddings)`` of the vocabulary; ids elsewhere look up zeros, then one all-reduce."""

    group = None

    def __init__(self, num_embeddings: int, embedding_dim: int, start: int):
        super().__init__(num_embeddings, embedding_dim)
        self.start = start

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        mine = (local >= 0) & (local < self.num_embeddings)
        out = super().forward(local.clamp(0, self.num_embeddings - 1)) * mine.unsqueeze(-1).to(self.weight.dtype)
        collectives.all_reduce(out, group=self.group)
        return out


class ShardedLlamaForCausalLM(LlamaForCausalLM):
    """One rank's shard. On rank 0 (the driver) a forward first broadcasts its inputs, so every
    rank runs the same step, and returns the full logits; on the others it returns None."""

    def __init__(self, plan: ShardPlan, collective_guard=None):
        super().__init__(plan.config)
        self.plan = plan
        self.full_config = plan.full
        self.collective_guard = collective_guard  # the driver's fault handling around each step
        self.last_block_tables = None  # what the last paged step ran (tests compare ranks)
        self.decode_graphs = None  # rank_graphs.RankDecodeGraphs, once the runner starts them
        self.tp_group = None
        self.stage_clock = pipeline.StageClock()  # when this rank ran its layers, step by step (P > 1)
        c = plan.config
        self.embed_tokens = VocabParallelEmbedding(c.vocab_size, c.hidden_size, plan.vocab[0])
        if c.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            attn.o_proj = RowParallelLinear(attn.q_size, c.hidden_size, bias=False)
            mlp.down_proj = RowParallelLinear(c.intermediate_size, c.hidden_size, bias=False)
        if not plan.is_last_stage:
            del self.norm, self.lm_head
        elif not plan.is_first_stage and c.tie_word_embeddings:
            self.lm_head = Linear(c.hidden_size, c.vocab_size, bias=False)  # its own copy of the tied shard
        if not plan.is_first_stage:
            del self.embed_tokens

    @classmethod
    def empty(cls, plan: ShardPlan, device, dtype, collective_guard=None) -> ShardedLlamaForCausalLM:
        """The shard's modules on ``device``, their weights to be overwritten (``load_shard``, ``dist.recv``).

        Built on the device itself, not on "meta": a shard is small, and torch's meta
        initialisers import its compiler (and Triton) on the way.
        """
        with torch.device(device):
            model = cls(plan, collective_guard).to(dtype)
        assert [n for n, _ in model.named_parameters()] == shard_names(plan)
        return model.eval()

    def set_tp_group(self, group) -> None:
        """The group this stage's all-reduces and logits gather run in (None: the whole world, P = 1)."""
        self.tp_group = group
        for module in self.modules():
            if isinstance(module, (RowParallelLinear, VocabParallelEmbedding)):
                module.group = group

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    @property
    def is_driver(self) -> bool:
        return self.plan.world_rank == 0

    def forward(self, input_ids, positions=None, meta=None):
        if input_ids.dim() == 2 and meta is None:  # the convenience form: flattened, then below
            return super().forward(input_ids, positions, meta)
        if not self.is_driver:
            return self.shard_forward(input_ids, positions, meta)
        if self.plan.num_stages > 1:
            return self.submit(input_ids, positions, meta).wait()
        guard = self.collective_guard
        with guard() if guard is not None else contextlib.nullcontext():
            step.broadcast_step(input_ids, positions, meta)
            return self.shard_forward(input_ids, positions, meta)

    def submit(self, input_ids, positions, meta) -> pipeline.PendingLogits:
        """Rank 0 with P > 1: stage 0's part of one step, sent down the pipe; its logits come back later.

        The receive of the logits is posted first, so the last stage can always send them, whatever
        rank 0 is doing when they are ready (``pipeline.py``).
        """
        plan = self.plan
        guard = self.collective_guard or contextlib.nullcontext
        with guard():
            header, payload = step.pack(input_ids, positions, meta)
            pipeline.first_hop(plan, header, payload, self.tp_group)
            rows = input_ids.shape[0] if meta.logits_indices is None else meta.logits_indices.shape[0]
            pending = pipeline.PendingLogits(
                rows,
                plan.full.vocab_size,
                plan.peer(plan.num_stages - 1) - plan.rank,
                pipeline.logits_tag(self.stage_clock.num_steps),
                self.device,
                guard,
            )
            self.shard_forward(input_ids, positions, meta, wire=(header, payload))
        return pending

    def hidden_states(self, input_ids, positions, meta):
        """This stage's layers: from the embedding or the previous stage, to the final norm (last stage) or not."""
        plan = self.plan
        if plan.num_stages == 1:
            return super().hidden_states(input_ids, positions, meta)
        hidden = None
        if not plan.is_first_stage:
            hidden = torch.empty(input_ids.shape[0], plan.full.hidden_size, dtype=self.dtype, device=self.device)
            collectives.recv(hidden, src=plan.peer(plan.stage - 1))
        start = time.monotonic()
        hidden = super().hidden_states(input_ids, positions, meta, hidden=hidden, last=plan.is_last_stage)
        self.stage_clock.note(start)
        return hidden

    def shard_forward(self, input_ids, positions, meta, wire=None):
        """This rank's part of one forward; the full logits on rank 0 with one stage, None elsewhere.

        ``wire`` (P > 1): the step's header and payload as rank 0 packed them, sent on to the next
        stage ahead of this stage's hidden states.
        """
        self.last_block_tables = getattr(meta, "block_tables", None)
        plan = self.plan
        hidden = self.hidden_states(input_ids, positions, meta)
        if not plan.is_last_stage:
            pipeline.send_on(plan, *wire, hidden)
            return None
        logits = self.gather_logits(self.logits_of(hidden, meta))
        if logits is not None and plan.num_stages > 1:  # the step this rank just counted
            collectives.send(logits.contiguous(), dst=0, tag=pipeline.logits_tag(self.stage_clock.num_steps - 1))
            return None
        return logits

    def logits_of(self, hidden: torch.Tensor, meta) -> torch.Tensor:
        """The last stage's ``[rows, vocab / T]`` slice of the logits, for the rows that want them."""
        if meta.logits_indices is not None:
            hidden = hidden[meta.logits_indices]
        return self.lm_head(hidden).float()

    def gather_logits(self, local: torch.Tensor) -> torch.Tensor | None:
        """Every tensor-parallel rank's slice to this stage's rank 0, whole there; None on the others."""
        plan = self.plan
        first = plan.peer(plan.stage) - plan.rank  # this stage's tensor-parallel rank 0
        return step.gather_logits(local, plan.full.vocab_size, plan.size, group=self.tp_group, dst=first)

    # ------------------------------------------------------------------ decode graphs, one per rank (P = 1)

    def local_logits(self, input_ids, positions, meta) -> torch.Tensor:
        """One stage's whole step up to its slice of the logits: no broadcast before, no gather after.
        What each rank's CUDA graph holds (``rank_graphs.py``)."""
        return self.logits_of(self.hidden_states(input_ids, positions, meta), meta)

    def start_decode_graphs(self, runner, capture: bool = True) -> None:
        """Rank 0: every rank, this one too, sets up its static decode buffers and captures its graphs
        of the runner's batch sizes (``capture=False``: runs the same padded steps eagerly)."""
        from .rank_graphs import RankDecodeGraphs

        if self.plan.num_stages > 1:
            raise NotImplementedError("decode graphs with pipeline stages: a stage's graph would wait on a receive")
        guard = self.collective_guard or contextlib.nullcontext
        r = runner.resolved
        settings = dict(
            sizes=runner.graphs.graph_sizes,
            max_num_seqs=r.max_num_seqs,
            max_blocks=r.max_blocks_per_seq,
            max_model_len=r.max_model_len,
            backend=r.attention_backend,
            capture=capture,
        )
        with guard():
            step.send_capture(device=self.device, **settings)
            self.decode_graphs = RankDecodeGraphs(self, runner.kv_cache, **settings)

    def replay_decode(self, size: int, payload: torch.Tensor) -> torch.Tensor:
        """Rank 0: one padded decode step through every rank's graph of ``size`` rows; the full logits."""
        guard = self.collective_guard or contextlib.nullcontext
        with guard():
            step.send_replay(size, payload)
            return self.decode_graphs.run(size, payload)


# ----------------------------------------------------------------------------- weights


LAYER_PARAMETERS = (
    "input_layernorm.weight",
    "self_attn.qkv_proj.weight",
    "self_attn.o_proj.weight",
    "post_attention_layernorm.weight",
    "mlp.gate_up_proj.weight",
    "mlp.down_proj.weight",
)


def shard_names(plan: ShardPlan) -> list[str]:
    """The parameters a shard holds, in its own order (what is sent, and received, one after another)."""
    names = ["embed_tokens.weight"] if plan.is_first_stage else []
    for j in range(plan.layers[1] - plan.layers[0]):
        names += [f"layers.{j}.{name}" for name in LAYER_PARAMETERS]
    if plan.is_last_stage:
        names.append("norm.weight")
        if not (plan.full.tie_word_embeddings and plan.is_first_stage):
            names.append("lm_head.weight")
    return names


def _source_name(name: str, plan: ShardPlan) -> str:
    """The full model's parameter behind a shard's: local layer j is layer ``layers[0] + j``; tied head: embedding."""
    if name.startswith("layers."):
        _, j, rest = name.split(".", 2)
        return f"layers.{plan.layers[0] + int(j)}.{rest}"
    if name == "lm_head.weight" and plan.full.tie_word_embeddings:
        return "embed_tokens.weight"
    return name


@torch.no_grad()
def shard_weights(full: LlamaForCausalLM, plan: ShardPlan) -> dict[str, torch.Tensor]:
    """Rank ``plan``'s slice of every parameter it holds, by the sharded model's names."""
    c, d = plan.full, plan.full.head_dim
    q0, q1 = (h * d for h in plan.heads)
    k0, k1 = (h * d for h in plan.kv_heads)
    i0, i1 = plan.intermediate
    params = dict(full.named_parameters())
    out = {}
    for name in shard_names(plan):
        weight = params[_source_name(name, plan)]
        if name.endswith("qkv_proj.weight"):
            q_all, kv_all = c.num_heads * d, c.num_kv_heads * d
            out[name] = torch.cat(
                [weight[q0:q1], weight[q_all + k0 : q_all + k1], weight[q_all + kv_all + k0 : q_all + kv_all + k1]]
            )
        elif name.endswith("o_proj.weight"):
            out[name] = weight[:, q0:q1]
        elif name.endswith("gate_up_proj.weight"):
            out[name] = torch.cat([weight[i0:i1], weight[c.intermediate_size + i0 : c.intermediate_size + i1]])
        elif name.endswith("down_proj.weight"):
            out[name] = weight[:, i0:i1]
        elif name in ("embed_tokens.weight", "lm_head.weight"):
            v0, v1 = plan.vocab
            rows = weight[v0 : min(v1, c.vocab_size)]
            pad = (v1 - v0) - rows.shape[0]
            out[name] = torch.cat([rows, rows.new_zeros(pad, rows.shape[1])]) if pad else rows
        else:  # norms: replicated
            out[name] = weight
    return {name: t.detach().contiguous() for name, t in out.items()}


@torch.no_grad()
def load_shard(model: ShardedLlamaForCausalLM, tensors: dict[str, torch.Tensor]) -> None:
    for name, param in model.named_parameters():
        param.copy_(tensors[name])


def weight_report(model: nn.Module) -> dict:
    """Shape, bytes and sum of every parameter (tied ones once): what a test checks rank by rank."""
    params = dict(model.named_parameters())
    return dict(
        shapes={n: tuple(p.shape) for n, p in params.items()},
        sums={n: float(p.detach().double().sum()) for n, p in params.items()},
        nbytes=sum(p.numel() * p.element_size() for p in params.values()),
    )

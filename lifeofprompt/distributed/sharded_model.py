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
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..model.linear import Linear
from ..model.llama import LlamaForCausalLM
from . import step
from .sizes import ShardPlan


class RowParallelLinear(Linear):
    """``x[:, my columns] @ W[:, my columns].T``, summed over the ranks by one all-reduce."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        dist.all_reduce(out)
        return out


class VocabParallelEmbedding(nn.Embedding):
    """Rows ``[start, start + num_embeddings)`` of the vocabulary; ids elsewhere look up zeros, then one all-reduce."""

    def __init__(self, num_embeddings: int, embedding_dim: int, start: int):
        super().__init__(num_embeddings, embedding_dim)
        self.start = start

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        mine = (local >= 0) & (local < self.num_embeddings)
        out = super().forward(local.clamp(0, self.num_embeddings - 1)) * mine.unsqueeze(-1).to(self.weight.dtype)
        dist.all_reduce(out)
        return out


class ShardedLlamaForCausalLM(LlamaForCausalLM):
    """One rank's shard. On rank 0 (the driver) a forward first broadcasts its inputs, so every
    rank runs the same step, and returns the full logits; on the others it returns None."""

    def __init__(self, plan: ShardPlan, collective_guard=None):
        super().__init__(plan.config)
        self.plan = plan
        self.full_config = plan.full
        self.collective_guard = collective_guard      # the driver's fault handling around each step
        self.last_block_tables = None                 # what the last paged step ran (tests compare ranks)
        c = plan.config
        self.embed_tokens = VocabParallelEmbedding(c.vocab_size, c.hidden_size, plan.vocab[0])
        if c.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            attn.o_proj = RowParallelLinear(attn.q_size, c.hidden_size, bias=False)
            mlp.down_proj = RowParallelLinear(c.intermediate_size, c.hidden_size, bias=False)

    @classmethod
    def empty(cls, plan: ShardPlan, device, dtype, collective_guard=None) -> "ShardedLlamaForCausalLM":
        """The shard's modules with uninitialised weights on ``device`` (filled by ``load_shard``)."""
        with torch.device("meta"):
            model = cls(plan, collective_guard)
        model = model.to_empty(device=device).to(dtype)
        c = plan.config
        model.rotary = type(model.rotary)(c.head_dim, c.max_position_embeddings, c.rope_theta).to(device)
        if c.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
        return model.eval()

    @property
    def is_driver(self) -> bool:
        return self.plan.rank == 0

    def forward(self, input_ids, positions=None, meta=None, fused_kernels=False):
        if input_ids.dim() == 2 and meta is None:          # the convenience form: flattened, then below
            return super().forward(input_ids, positions, meta, fused_kernels)
        if not self.is_driver:
            return self.shard_forward(input_ids, positions, meta, fused_kernels)
        guard = self.collective_guard
        with guard() if guard is not None else _nothing():
            step.broadcast_step(input_ids, positions, meta, fused_kernels)
            return self.shard_forward(input_ids, positions, meta, fused_kernels)

    def shard_forward(self, input_ids, positions, meta, fused_kernels=False):
        """This rank's part of one forward; the full logits on rank 0, None elsewhere."""
        self.last_block_tables = getattr(meta, "block_tables", None)
        hidden = self.hidden_states(input_ids, positions, meta, fused_kernels)
        if meta.logits_indices is not None:
            hidden = hidden[meta.logits_indices]
        return step.gather_logits(self.lm_head(hidden).float(), self.full_config.vocab_size, self.plan.size)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# ----------------------------------------------------------------------------- weights


@torch.no_grad()
def shard_weights(full: LlamaForCausalLM, plan: ShardPlan) -> dict[str, torch.Tensor]:
    """Rank ``plan.rank``'s slice of every parameter of the full model, by the sharded model's names."""
    c, d = plan.full, plan.full.head_dim
    q0, q1 = (h * d for h in plan.heads)
    k0, k1 = (h * d for h in plan.kv_heads)
    i0, i1 = plan.intermediate
    out = {}
    for name, weight in full.named_parameters():
        if name.endswith("qkv_proj.weight"):
            q_all, kv_all = c.num_heads * d, c.num_kv_heads * d
            out[name] = torch.cat([weight[q0:q1], weight[q_all + k0:q_all + k1], weight[q_all + kv_all + k0:q_all + kv_all + k1]])
        elif name.endswith("o_proj.weight"):
            out[name] = weight[:, q0:q1]
        elif name.endswith("gate_up_proj.weight"):
            out[name] = torch.cat([weight[i0:i1], weight[c.intermediate_size + i0:c.intermediate_size + i1]])
        elif name.endswith("down_proj.weight"):
            out[name] = weight[:, i0:i1]
        elif name in ("embed_tokens.weight", "lm_head.weight"):
            v0, v1 = plan.vocab
            rows = weight[v0:min(v1, c.vocab_size)]
            pad = (v1 - v0) - rows.shape[0]
            out[name] = torch.cat([rows, rows.new_zeros(pad, rows.shape[1])]) if pad else rows
        else:                                       # norms: replicated
            out[name] = weight
    return {name: t.detach().contiguous() for name, t in out.items()}


@torch.no_grad()
def load_shard(model: ShardedLlamaForCausalLM, tensors: dict[str, torch.Tensor]) -> None:
    for name, param in model.named_parameters():
        param.copy_(tensors[name])


def weight_report(model: nn.Module) -> dict:
    """Shape, bytes and sum of every parameter (tied ones once): what a test checks rank by rank."""
    params = dict(model.named_parameters())
    return dict(shapes={n: tuple(p.shape) for n, p in params.items()},
                sums={n: float(p.detach().double().sum()) for n, p in params.items()},
                nbytes=sum(p.numel() * p.element_size() for p in params.values()))

"""Floating-point operations of one forward, counted from the shapes (notebooks 03–05, the roofline).

A matrix product ``[m, k] @ [k, n]`` costs ``2·m·k·n`` operations (one multiply, one add).
Per layer a forward over ``T`` new token rows does:

* q/k/v projections: ``2·T·hidden·(heads + 2·kv_heads)·head_dim``;
* attention scores ``Q·Kᵀ`` and context ``weights·V``: ``2·heads·head_dim`` each, per
  (query, visible key) pair, so they grow with how much context each query sees;
* output projection ``2·T·heads·head_dim·hidden`` and the SwiGLU MLP ``6·T·hidden·intermediate``;

and once per forward the LM head, ``2·rows·hidden·vocab`` for the rows whose logits are wanted.
Norms, rotary embeddings and the softmax are a few operations per element: left out.

Counts are of *useful* work: a causal query sees only the keys at or before its position.
(The torch path, ``scaled_dot_product_attention`` with an explicit mask, computes the masked
square too, at most twice the useful score operations; the Triton kernel skips it.)

``matrix_shapes`` lists the matrices themselves, as the model holds them fused: the block-product
kernel's tests and benchmark (``benchmarks/gpu_block_step.py``) run TinyLlama's.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..model.config import ModelConfig


def matrix_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """``(out, in)`` of each matrix a step multiplies by, fused as the model holds them, and the LM head."""
    h, d = config.hidden_size, config.head_dim
    return {
        "qkv": ((config.num_heads + 2 * config.num_kv_heads) * d, h),
        "o": (h, config.num_heads * d),
        "gate_up": (2 * config.intermediate_size, h),
        "down": (h, config.intermediate_size),
        "head": (config.vocab_size, h),
    }


@dataclass(frozen=True)
class ForwardFlops:
    """Operations of one forward, by kind, summed over layers (the LM head once)."""

    qkv: int
    o: int
    scores: int
    context: int
    mlp: int
    lm_head: int

    @property
    def total(self) -> int:
        return self.qkv + self.o + self.scores + self.context + self.mlp + self.lm_head

    @property
    def attention(self) -> int:
        """The part that depends on context length: scores and context."""
        return self.scores + self.context

    def as_dict(self) -> dict:
        return {**asdict(self), "total": self.total}


def attention_pairs(num_tokens: int, context_tokens: int = 0, num_seqs: int = 1) -> int:
    """(query, visible key) pairs when ``num_seqs`` sequences each add ``num_tokens / num_seqs`` rows.

    ``context_tokens`` is the total already cached before this forward (summed over sequences).
    One sequence with ``c`` cached tokens and ``q`` new ones: ``q·c`` pairs with the cache plus
    ``q(q+1)/2`` causal pairs among the new rows. Sequences are assumed equal in size.
    """
    if num_tokens < 0 or context_tokens < 0 or num_seqs <= 0:
        raise ValueError("num_tokens and context_tokens must be >= 0 and num_seqs >= 1")
    q = num_tokens / num_seqs
    pairs = num_tokens * context_tokens / num_seqs + num_seqs * q * (q + 1) / 2
    return int(round(pairs))


def forward_flops(
    config: ModelConfig, num_tokens: int, context_tokens: int = 0, num_seqs: int = 1, logits_rows: int | None = None
) -> ForwardFlops:
    """Operations of one forward over ``num_tokens`` new rows that also read ``context_tokens`` cached ones.

    ``logits_rows`` defaults to one row per sequence, as every generator here asks for.
    """
    h, d, layers = config.hidden_size, config.head_dim, config.num_layers
    q_size, kv_size = config.num_heads * d, config.num_kv_heads * d
    pairs = attention_pairs(num_tokens, context_tokens, num_seqs)
    rows = num_seqs if logits_rows is None else logits_rows
    return ForwardFlops(
        qkv=layers * 2 * num_tokens * h * (q_size + 2 * kv_size),
        o=layers * 2 * num_tokens * q_size * h,
        scores=layers * 2 * config.num_heads * d * pairs,
        context=layers * 2 * config.num_heads * d * pairs,
        mlp=layers * 6 * num_tokens * h * config.intermediate_size,
        lm_head=2 * rows * h * config.vocab_size,
    )


def naive_step_flops(config: ModelConfig, seq_len: int) -> ForwardFlops:
    """One step of ``generate_naive`` on a sequence of ``seq_len`` tokens: all rows again, one logits row."""
    return forward_flops(config, seq_len, 0, logits_rows=1)


def cached_step_flops(config: ModelConfig, seq_len: int) -> ForwardFlops:
    """One decode step of ``generate_cached`` once ``seq_len - 1`` tokens are cached: one new row."""
    return forward_flops(config, 1, seq_len - 1, logits_rows=1)


def generation_flops(config: ModelConfig, prompt_len: int, max_new_tokens: int, cached: bool) -> list[int]:
    """Operations of each forward that makes ``max_new_tokens`` tokens after a ``prompt_len`` prompt.

    Forward ``i`` produces new token ``i``; it sees ``prompt_len + i`` tokens. With a cache,
    forward 0 is the prefill (the whole prompt) and every later one a single row.
    """
    steps = []
    for i in range(max_new_tokens):
        n = prompt_len + i
        if not cached:
            steps.append(naive_step_flops(config, n).total)
        elif i == 0:
            steps.append(forward_flops(config, prompt_len, 0, logits_rows=1).total)
        else:
            steps.append(cached_step_flops(config, n).total)
    return steps

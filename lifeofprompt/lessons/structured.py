"""Structured output, step by step: what the model wanted, and what the grammar let it say.

The engine applies the grammar's mask inside the sampler (``engine/structured_output.py``) and
keeps nothing of it. To draw it, ``replay_mask`` walks a finished answer again: one forward of
the model over prompt + answer gives the unconstrained logits at every step at once (each row
predicts the next token), and a fresh matcher of the same grammar, fed the answer token by
token, gives the allowed set at each of those steps. Chapter 12 draws the result.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class MaskStep:
    """One step of a constrained answer."""

    index: int  # which output token
    num_allowed: int  # tokens of the vocabulary the grammar allowed here
    chosen: int  # the token the engine produced
    wanted: list[tuple[int, float, bool]]  # the model's top tokens without the mask: (id, probability, allowed?)
    allowed_mass: float  # the probability the unconstrained model gave the allowed set
    best_allowed: list[tuple[int, float]]  # the allowed tokens the model liked best: (id, probability)

    @property
    def overridden(self) -> bool:
        """The model's own first choice was not allowed: the grammar, not the model, chose the token."""
        return not self.wanted[0][2]


def allowed_tokens(bitmask_row: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """A bool per token from one row of xgrammar's bitmask (int32 words; bit j of word w is token 32 w + j)."""
    bits = (bitmask_row.to(torch.int64).unsqueeze(1) >> torch.arange(32)) & 1
    return bits.flatten()[:vocab_size].bool()


@torch.no_grad()
def replay_mask(engine, prompt_ids, output_ids, structured_outputs, top_k: int = 8) -> list[MaskStep]:
    """The mask at every step of ``output_ids``, an answer ``engine`` produced under ``structured_outputs``."""
    backend = engine.grammar_backend()
    state = backend.matcher(structured_outputs)
    prompt_ids, output_ids = list(prompt_ids), list(output_ids)
    ids = torch.tensor([prompt_ids + output_ids], device=engine.model.device)
    logits = engine.model(ids)[0, len(prompt_ids) - 1 :].float().cpu()  # row i scores output token i
    probs = torch.softmax(logits, dim=-1)
    steps = []
    for i, token in enumerate(output_ids):
        bitmask = backend.new_bitmask(1)
        state.fill(bitmask, 0)
        allowed = allowed_tokens(bitmask[0], backend.vocab_size)
        top = torch.topk(probs[i], top_k)
        wanted = [(int(t), float(p), bool(allowed[t])) for p, t in zip(top.values, top.indices)]
        masked = probs[i].masked_fill(~allowed, -1.0)
        best = torch.topk(masked, min(3, int(allowed.sum())))
        best_allowed = [(int(t), float(p)) for p, t in zip(best.values, best.indices)]
        steps.append(MaskStep(i, int(allowed.sum()), token, wanted, float(probs[i][allowed].sum()), best_allowed))
        if not state.accept(token):
            raise ValueError(f"token {token} at output position {i} breaks the grammar: not an answer of this grammar")
    return steps

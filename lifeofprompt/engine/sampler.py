"""The sampler: from one row of logits per sequence to one next token per sequence, on the device.

Everything is batched: the per-request knobs (temperature, top_k, top_p, min_p) become
tensors of length B and one set of tensor operations filters every row at once. Nothing here
copies to the host; the step reads the chosen ids back once (``step_output.sample_plain``).

Order of operations (as in vLLM):

0. rows whose request asks for min_tokens, logit_bias or penalties get them first
   (``logits_processors.py``; they need the request's prompt and output ids), and rows that
   follow a grammar lose every token it does not allow (``structured_output.py``);
1. greedy rows (temperature 0) take the argmax of those logits;
2. the other rows divide by their temperature, then drop tokens outside the top_k, outside the
   smallest set whose probability reaches top_p, and below min_p × the top probability;
3. a draw from what is left. Each seeded request owns a ``torch.Generator``, so its draws depend
   only on its seed and how many tokens it has drawn — not on what else shares the batch — and
   the same prompt, parameters and seed give the same tokens run after run.

The draw uses the "exponential race": ``argmax(p / E)`` with ``E ~ Exp(1)`` picks token ``i``
with probability ``p_i`` and needs one noise vector per row, which a per-row generator can fill.

One row must not fail the batch: if the batched call raises, every seeded generator is put back
as it was and the rows are sampled one by one; a row that fails again is reported in
``SamplerOutput.failed`` (the engine ends that request alone) and the others keep the very
tokens the batched call would have given them.

Log-probabilities (when asked) are those of the raw model distribution, before temperature and
filtering (vLLM's default "raw_logprobs"): the chosen token's, and the top N.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .logits_processors import process_logits
from .sampling_params import SamplingParams


@dataclass
class SamplerOutput:
    """Device tensors for one step; ``None`` fields were not asked for."""

    token_ids: torch.Tensor  # [B] long
    logprobs: torch.Tensor | None = None  # [B] float: log p(chosen token)
    top_ids: torch.Tensor | None = None  # [B, N] long
    top_logprobs: torch.Tensor | None = None  # [B, N] float
    failed: dict[int, BaseException] = field(default_factory=dict)  # row -> why it could not be sampled


def apply_filters(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None, min_p: torch.Tensor | None
) -> torch.Tensor:
    """Logits ``[B, V]`` with every token outside a row's top_k / top_p / min_p set at ``-inf``.

    ``top_k`` is ``[B]`` long (a value >= V, or -1, keeps all), ``top_p`` and ``min_p`` ``[B]``
    float (1.0 and 0.0 keep all). Any of them may be None to skip that filter. The most likely
    token of a row always survives, so a row never ends up empty.
    """
    if min_p is not None:
        probs = torch.softmax(logits, dim=-1)
        threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    if top_k is None and top_p is None:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if top_k is not None:
        k = torch.where(top_k < 1, logits.shape[-1], top_k)
        drop |= rank >= k[:, None]
    if top_p is not None:
        sorted_probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
        before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass of the tokens ranked above
        drop |= before >= top_p[:, None]  # already reached top_p without me
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def exponential_noise(shape: tuple[int, int], generators: list[torch.Generator | None], device) -> torch.Tensor:
    """``Exp(1)`` noise ``[B, V]``: row ``b`` from ``generators[b]`` when it has one, else the global stream."""
    noise = torch.empty(shape, device=device).exponential_()
    for row, generator in enumerate(generators):
        if generator is not None:
            noise[row].exponential_(generator=generator)
    return noise


class Sampler:
    """Batched sampling for a list of requests' ``SamplingParams`` (one logits row each)."""

    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None] | None = None,
        history=None,
        grammar=None,
    ) -> SamplerOutput:
        """``history``: ``(prompts, outputs, eos_token_ids)`` per row, read only for the rows with penalties,
        min_tokens or logit_bias (``logits_processors.py``); None when no row needs it. ``grammar``:
        ``(apply, bitmask)``, the step's allowed-token bitmask and the function that applies it."""
        generators = generators or [None] * logits.shape[0]
        states = [None if g is None else g.get_state() for g in generators]
        try:
            return self.sample(logits, params, generators, history=history, grammar=grammar)
        except Exception:
            for generator, state in zip(generators, states):  # undo the draws of the failed attempt
                if generator is not None:
                    generator.set_state(state)
            return self.sample_row_by_row(logits, params, generators, history, grammar)

    def sample_row_by_row(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        history=None,
        grammar=None,
    ) -> SamplerOutput:
        """One row at a time, so that a failing row is found and the others still get their token."""
        num_logprobs = max((p.logprobs or 0) for p in params)
        wants_logprobs = any(p.logprobs is not None for p in params)
        rows, failed = [], {}
        for b in range(logits.shape[0]):
            try:
                one = None if history is None else (history[0][b : b + 1], history[1][b : b + 1], history[2])
                mask = None if grammar is None else (grammar[0], grammar[1][b : b + 1])
                rows.append(
                    self.sample(
                        logits[b : b + 1],
                        params[b : b + 1],
                        generators[b : b + 1],
                        num_logprobs,
                        wants_logprobs,
                        one,
                        mask,
                    )
                )
            except Exception as exc:
                failed[b] = exc
                rows.append(None)
        good = next((r for r in rows if r is not None), None)

        def stack(name):
            if good is None or getattr(good, name) is None:
                return None
            blank = torch.zeros_like(getattr(good, name))
            return torch.cat([blank if r is None else getattr(r, name) for r in rows])

        token_ids = stack("token_ids")
        if token_ids is None:
            token_ids = torch.zeros(len(rows), dtype=torch.long, device=logits.device)
        return SamplerOutput(
            token_ids=token_ids,
            logprobs=stack("logprobs"),
            top_ids=stack("top_ids"),
            top_logprobs=stack("top_logprobs"),
            failed=failed,
        )

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        num_logprobs: int | None = None,
        wants_logprobs: bool | None = None,
        history=None,
        grammar=None,
    ) -> SamplerOutput:
        """The batched computation (``num_logprobs``/``wants_logprobs``: the whole batch's, when sampling one row)."""
        raw = logits = logits.float()
        if any(p.needs_history for p in params):
            prompts, outputs, eos = history if history is not None else (None, None, ())
            logits = process_logits(logits, params, prompts, outputs, eos)
        if grammar is not None:
            apply, bitmask = grammar
            logits = logits.clone() if logits is raw else logits
            apply(logits, bitmask)
        batch, vocab = logits.shape
        if batch == 0:  # a step of prompt chunks only: nothing to sample
            return SamplerOutput(token_ids=torch.empty(0, dtype=torch.long, device=logits.device))
        device = logits.device
        greedy_ids = logits.argmax(dim=-1)
        if num_logprobs is None:
            num_logprobs = max((p.logprobs or 0) for p in params)
        if wants_logprobs is None:
            wants_logprobs = any(p.logprobs is not None for p in params)

        if all(p.temperature == 0 for p in params):
            token_ids = greedy_ids
        else:
            temperature = torch.tensor(
                [p.temperature if p.temperature > 0 else 1.0 for p in params], dtype=torch.float32, device=device
            )
            top_k = top_p = min_p = None
            if any(0 < p.top_k < vocab for p in params):
                top_k = torch.tensor([p.top_k for p in params], dtype=torch.long, device=device)
            if any(p.top_p < 1.0 for p in params):
                top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
            if any(p.min_p > 0.0 for p in params):
                min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device)
            filtered = apply_filters(logits / temperature[:, None], top_k, top_p, min_p)
            probs = torch.softmax(filtered, dim=-1)
            sampled = (probs / exponential_noise((batch, vocab), generators, device)).argmax(dim=-1)
            is_greedy = torch.tensor([p.temperature == 0 for p in params], device=device)
            token_ids = torch.where(is_greedy, greedy_ids, sampled)

        out = SamplerOutput(token_ids=token_ids)
        if wants_logprobs:
            logprobs = torch.log_softmax(raw, dim=-1)
            out.logprobs = logprobs.gather(-1, token_ids[:, None])[:, 0]
            if num_logprobs > 0:
                out.top_logprobs, out.top_ids = logprobs.topk(num_logprobs, dim=-1)
        return out


def make_generator(seed: int | None, device) -> torch.Generator | None:
    """A request's own random stream (None when it has no seed)."""
    if seed is None:
        return None
    return torch.Generator(device=device).manual_seed(seed)

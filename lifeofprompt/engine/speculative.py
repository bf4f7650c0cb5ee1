"""Speculative decoding: what to draft, and the counts that say how well it went.

A decode step reads every weight to produce one token per request; while that memory traffic
dominates (chapter 05's roofline), checking k + 1 tokens in the same forward costs about as much
as producing one. So a cheap *drafter* guesses the next k tokens, the model runs one verify step
over ``[last token, d1 .. dk]`` (k + 1 query rows over the paged cache, the same attention path as
a prefill chunk), and the longest prefix it agrees with is kept, plus the model's own next token
(``rejection_sampler.py``). Every verify step yields at least the one token a plain decode would.

``speculative_config`` (vLLM's names) picks the drafter:

* ``{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": n, "prompt_lookup_min": m}``:
  prompt lookup (``NgramProposer``), no second model;
* ``{"model": NAME_OR_PATH_OR_LOADED_MODEL, "num_speculative_tokens": k}``: a small draft model
  with the same tokenizer (``draft_model.py``).

This file holds the configuration, the n-gram drafter, and ``SpecDecodeStats``, the counters
behind ``RequestOutput.metrics`` and ``/metrics``.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

from ..errors import SpeculativeConfigError

METHODS = ("ngram", "draft_model")
DEFAULT_PROMPT_LOOKUP_MIN = 2  # a 1-token match fires on every common token and mostly proposes noise
DEFAULT_PROMPT_LOOKUP_MAX = 5


@dataclass
class SpeculativeConfig:
    """Validated ``speculative_config``; ``from_user`` turns the user's dict into one."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP_MIN
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP_MAX
    model: object = None  # draft_model: a name, a path, or a loaded LlamaForCausalLM
    draft_tokenizer: object = None  # draft_model given loaded: its tokenizer (checked against the target's)

    @property
    def k(self) -> int:
        return self.num_speculative_tokens

    @classmethod
    def from_user(cls, value) -> SpeculativeConfig | None:
        """None → no speculation; a dict (or a ``SpeculativeConfig``) → checked, else a typed error naming the field."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise SpeculativeConfigError(
                f"speculative_config must be a dict, got {type(value).__name__}", param="speculative_config"
            )
        known = {
            "method",
            "num_speculative_tokens",
            "prompt_lookup_min",
            "prompt_lookup_max",
            "model",
            "draft_tokenizer",
        }
        for key in value:
            if key not in known:
                raise SpeculativeConfigError(f"unknown field (known: {sorted(known)})", param=str(key))
        method = value.get("method")
        if method is None:
            method = "draft_model" if value.get("model") is not None else None
        if method not in METHODS:
            raise SpeculativeConfigError(
                f"unknown method {method!r}: use 'ngram' or 'draft_model' (or give 'model')", param="method"
            )
        k = value.get("num_speculative_tokens")
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise SpeculativeConfigError(f"must be an integer >= 1, got {k!r}", param="num_speculative_tokens")
        config = cls(method, k, model=value.get("model"), draft_tokenizer=value.get("draft_tokenizer"))
        if method == "ngram":
            config._set_lookup(value.get("prompt_lookup_min"), value.get("prompt_lookup_max"))
        elif config.model is None:
            raise SpeculativeConfigError("method 'draft_model' needs a draft model", param="model")
        return config

    def _set_lookup(self, low, high) -> None:
        """vLLM's rule: give one bound and the other follows it; give none and both take the defaults."""
        for name, v in (("prompt_lookup_min", low), ("prompt_lookup_max", high)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise SpeculativeConfigError(f"must be an integer >= 1, got {v!r}", param=name)
        if low is None and high is None:
            low, high = DEFAULT_PROMPT_LOOKUP_MIN, DEFAULT_PROMPT_LOOKUP_MAX
        low = high if low is None else low
        high = low if high is None else high
        if low > high:
            raise SpeculativeConfigError(
                f"prompt_lookup_min ({low}) is larger than prompt_lookup_max ({high})", param="prompt_lookup_min"
            )
        self.prompt_lookup_min, self.prompt_lookup_max = low, high

    def describe(self) -> str:
        if self.method == "ngram":
            return (
                f"speculative decoding: n-gram prompt lookup, {self.k} draft tokens a step, "
                f"suffixes of {self.prompt_lookup_min}..{self.prompt_lookup_max} tokens (earliest match)"
            )
        name = self.model if isinstance(self.model, str) else getattr(self.model, "source", type(self.model).__name__)
        return f"speculative decoding: draft model {name}, {self.k} draft tokens a step"


# ----------------------------------------------------------------------------- the n-gram drafter


def find_ngram(tokens: array, n: int, latest: bool = False) -> int:
    """Start of the earliest (or ``latest``) earlier occurrence of the last ``n`` tokens of ``tokens`` (-1: none).

    The search runs over the bytes of an ``array("l")``: ``bytes.find`` is C-fast, and a hit that
    does not start on an item boundary is skipped.
    """
    size = tokens.itemsize
    data = tokens.tobytes()
    suffix = data[-n * size :]
    end = len(data) - size  # the occurrence must end before the last token: something follows it
    if latest:
        at = data.rfind(suffix, 0, end)
        while at != -1 and at % size:
            at = data.rfind(suffix, 0, at + len(suffix) - 1)
    else:
        at = data.find(suffix, 0, end)
        while at != -1 and at % size:
            at = data.find(suffix, at + 1, end)
    return -1 if at == -1 else at // size


class NgramProposer:
    """Prompt lookup: the longest suffix (``prompt_lookup_max`` down to ``prompt_lookup_min`` tokens)
    of the request's tokens that occurred earlier in its prompt and output, and the tokens that
    followed that occurrence, at most k of them.

    Among several occurrences of that suffix it takes the *earliest*, as vLLM does, and we measured
    that the latest (``latest=True``) does not accept more. On ``benchmarks/bench_spec.py``'s
    code-editing set (8 chat requests, greedy, up to 96 tokens, k = 4, suffixes of 2..5 tokens),
    the earliest kept 234 of 362 drafted tokens (64.6%, 3.57 tokens per verify), the latest 231 of
    378 (61.1%, 3.43). On its open-ended set both kept 21%. In code editing the prompt's copy of
    the text being edited comes first, and a long run follows it. The latest occurrence is often
    the output's own recent line. No occurrence: no draft, and the step is a plain decode.
    """

    def __init__(self, config: SpeculativeConfig, latest: bool = False):
        self.k = config.k
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max
        self.latest = latest  # take the latest occurrence instead (to measure the choice against)

    def propose(self, token_ids: list[int], max_draft: int | None = None) -> list[int]:
        k = self.k if max_draft is None else min(self.k, max_draft)
        if k < 1 or len(token_ids) < self.min_n + 1:
            return []
        tokens = array("l", token_ids)
        for n in range(min(self.max_n, len(token_ids) - 1), self.min_n - 1, -1):
            start = find_ngram(tokens, n, self.latest)
            if start != -1:
                return list(token_ids[start + n : start + n + k])
        return []


# ----------------------------------------------------------------------------- counting


@dataclass
class SpecDecodeStats:
    """What speculation did: drafts, draft tokens, accepted tokens (overall and per draft position), times.

    One in the engine (for ``/metrics``, vLLM's ``spec_decode_*`` counters) and one per request
    (``RequestOutput.metrics.spec``). ``num_accepted_tokens_per_pos[i]`` counts the verify steps
    whose draft token ``i`` (0-based) was accepted: the raw material for a per-token acceptance
    rate, since position ``i`` is only reached when every position before it was accepted.
    """

    num_speculative_tokens: int = 0
    num_drafts: int = 0  # verify steps with at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    num_reached_per_pos: list[int] = field(default_factory=list)  # drafted at i, and 0..i-1 all accepted
    draft_time: float = 0.0  # seconds spent proposing
    verify_time: float = 0.0  # seconds of the target steps that held a verify

    def __post_init__(self):
        k = self.num_speculative_tokens
        self.num_accepted_tokens_per_pos = self.num_accepted_tokens_per_pos or [0] * k
        self.num_reached_per_pos = self.num_reached_per_pos or [0] * k

    def observe(self, num_draft: int, num_accepted: int) -> None:
        """One verify step: ``num_draft`` tokens proposed, the first ``num_accepted`` of them kept."""
        if num_draft == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        for i in range(min(num_draft, num_accepted + 1)):
            self.num_reached_per_pos[i] += 1
        for i in range(num_accepted):
            self.num_accepted_tokens_per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted over drafted tokens. Not the per-token rate α: see ``alpha``."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def alpha(self) -> float:
        """One per-token acceptance rate α for all positions: accepted over *reached* draft positions.

        If each draft token is accepted with the same probability α once the ones before it were,
        every reached position is one trial of it, so this ratio is α's estimate. (Accepted over
        drafted tokens, ``acceptance_rate``, is smaller: (α − α^(k+1)) / (k(1 − α)) for full drafts.)
        """
        reached = sum(self.num_reached_per_pos)
        return self.num_accepted_tokens / reached if reached else float("nan")

    def as_dict(self) -> dict:
        return dict(
            num_drafts=self.num_drafts,
            num_draft_tokens=self.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens,
            num_accepted_tokens_per_pos=list(self.num_accepted_tokens_per_pos),
            draft_time=self.draft_time,
            verify_time=self.verify_time,
            acceptance_rate=self.acceptance_rate,
            alpha=self.alpha,
        )

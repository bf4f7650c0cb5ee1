"""``SamplingParams``: how to pick each next token, with vLLM's names and defaults.

Validated when built, so a bad value fails at ``generate`` time with a typed error naming
the field, before any work starts and without disturbing other requests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..errors import InvalidRequestError
from .structured_output import StructuredOutputsParams

# torch.Generator.manual_seed takes any integer in [-2**63, 2**64): a request's n answers use seed ... seed + n - 1
MIN_SEED, MAX_SEED = -(2**63), 2**64 - 1
MAX_PROMPT_LOGPROBS = 20  # vLLM's default max_logprobs: top-k of every prompt token costs a [rows, k] read-back
GREEDY_BELOW, MIN_TEMPERATURE = 1e-5, 1e-2


@dataclass
class SamplingParams:
    n: int = 1  # completions per prompt (they share the prompt's blocks)
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # keep the smallest set of tokens whose probability reaches top_p
    top_k: int = -1  # keep the k most likely tokens; -1 = all
    min_p: float = 0.0  # drop tokens less likely than min_p × the most likely one
    seed: int | None = None  # same prompt + params + seed → same tokens, run after run
    max_tokens: int | None = 16  # new tokens at most (None: up to the context length; 0: score the prompt only)
    stop: list[str] | str | None = None  # stop strings (not included in the output text)
    stop_token_ids: list[int] | None = None  # extra token ids that end generation
    ignore_eos: bool = False  # keep going past EOS (benchmarks)
    logprobs: int | None = None  # top-N log-probabilities per generated token
    prompt_logprobs: int | None = None  # top-N log-probabilities per prompt token (prompt_logprobs.py), 0..20
    presence_penalty: float = 0.0  # minus this from every token already in the output, in [-2, 2]
    frequency_penalty: float = 0.0  # minus this × its count in the output, in [-2, 2]
    repetition_penalty: float = 1.0  # tokens in prompt or output: positive logits ÷ it, negative × it
    min_tokens: int = 0  # EOS, stop ids and stop strings wait until this many tokens
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    structured_outputs: StructuredOutputsParams | None = None  # a grammar the output must follow (structured_output.py)
    skip_special_tokens: bool = True
    extra: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        if (
            isinstance(self.temperature, (int, float))
            and not isinstance(self.temperature, bool)
            and math.isfinite(self.temperature)
            and 0 < self.temperature < MIN_TEMPERATURE
        ):
            # as vLLM: below 1e-5 is greedy (1/T would overflow the logits: temperature 1e-320 gave id-0 garbage),
            # and up to 0.01 is clamped to 0.01 (sharper than that is greedy in all but rounding)
            self.temperature = 0.0 if self.temperature < GREEDY_BELOW else MIN_TEMPERATURE
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        self.validate()

    def validate(self) -> None:
        def bad(param, message):
            raise InvalidRequestError(message, param=param)

        if not isinstance(self.n, int) or self.n < 1:
            bad("n", f"n must be an integer >= 1, got {self.n!r}")
        if (
            not isinstance(self.temperature, (int, float))
            or not math.isfinite(self.temperature)
            or self.temperature < 0
        ):
            bad("temperature", f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            bad("top_p", f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or (self.top_k < 1 and self.top_k != -1):
            bad("top_k", f"top_k must be -1 (off) or >= 1, got {self.top_k!r}")
        if not isinstance(self.min_p, (int, float)) or not 0 <= self.min_p <= 1:
            bad("min_p", f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.max_tokens is not None and (
            isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 0
        ):
            bad("max_tokens", f"max_tokens must be an integer >= 0 (0: the prompt only), got {self.max_tokens!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            bad("logprobs", f"logprobs must be an integer >= 0, got {self.logprobs!r}")
        pl = self.prompt_logprobs
        if pl is not None and (isinstance(pl, bool) or not isinstance(pl, int) or not 0 <= pl <= MAX_PROMPT_LOGPROBS):
            bad("prompt_logprobs", f"prompt_logprobs must be an integer in [0, {MAX_PROMPT_LOGPROBS}], got {pl!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            bad("seed", f"seed must be an integer, got {self.seed!r}")
        if self.seed is not None and not MIN_SEED <= self.seed <= self.seed + self.n - 1 <= MAX_SEED:
            bad(
                "seed",
                f"seed must be in [{MIN_SEED}, {MAX_SEED - self.n + 1}] (each of the n={self.n} answers "
                f"seeds its own generator with seed + i), got {self.seed}",
            )
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "stop must be a non-empty string or a list of them")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not -2 <= value <= 2:
                bad(name, f"{name} must be a number in [-2, 2], got {value!r}")
        rp = self.repetition_penalty
        if isinstance(rp, bool) or not isinstance(rp, (int, float)) or not math.isfinite(rp) or rp <= 0:
            bad("repetition_penalty", f"repetition_penalty must be a finite number > 0 (1 = off), got {rp!r}")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            bad("min_tokens", f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            bad("structured_outputs", "structured_outputs must be a StructuredOutputsParams (or a dict of its fields)")
        for token, bias in (self.logit_bias or {}).items():
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                bad("logit_bias", f"logit_bias keys are token ids (integers >= 0), got {token!r}")
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
                bad("logit_bias", f"logit_bias values must be in [-100, 100], got {bias!r} for token {token}")

    @property
    def needs_history(self) -> bool:
        """Whether sampling reads the request's tokens so far (penalties, min_tokens) or edits logits (logit_bias)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1
            or self.min_tokens
            or self.logit_bias
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

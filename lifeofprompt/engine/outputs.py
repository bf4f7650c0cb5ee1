"""What the engine hands back: ``RequestOutput``, ``CompletionOutput``, ``RequestMetrics`` (vLLM's names).

A ``RequestOutput`` is a snapshot of one request after a step: the cumulative text and token
ids so far (``outputs[0].text``, ``outputs[0].token_ids``), plus what this step added
(``outputs[0].new_text``, ``outputs[0].new_token_ids``) for streaming. The ids and logprobs so far
are views of the answer's own lists while it runs, which only grow, so a snapshot costs nothing and
stays true (``output_processor.Prefix``; ``list(...)`` makes a copy); the last output holds plain
lists. ``metrics`` holds the
request's timestamps on one monotonic clock (``time.monotonic``), the raw material of
``lifeofprompt.latency``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .speculative import SpecDecodeStats


@dataclass
class SpecStep:
    """One verify step of a request: where it started, what was drafted, how much was kept."""

    position: int  # the position of the verify's first row (its last verified token)
    draft_token_ids: list[int]  # the drafts checked, in order
    num_accepted: int  # the first num_accepted drafts were kept; the model added one token more
    token_ids: list[int] = field(default_factory=list)  # what the step appended (kept drafts + the model's)


@dataclass
class RequestMetrics:
    arrival_time: float  # when add_request saw it (or the time it was given)
    first_scheduled_time: float | None = None  # start of the first step that ran any of its tokens
    first_token_time: float | None = None  # end of the step that sampled its first new token
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # end of the step that sampled each token
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at (first) admission
    num_preemptions: int = 0  # times it was evicted and recomputed
    spec_decode: SpecDecodeStats | None = None  # speculative decoding: this request's drafts and acceptances
    spec_steps: list[SpecStep] = field(default_factory=list)  # each verify step, in order

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_times)

    @property
    def last_token_time(self) -> float | None:
        return self.token_times[-1] if self.token_times else None

    @property
    def time_in_queue(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]  # while it runs, a view of the answer's own list (output_processor.Prefix); at the end a list
    finish_reason: str | None = None  # "stop" (EOS, stop string, stop token), "length", "abort", "error"
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    logprobs: list[dict[int, float]] | None = None  # per generated token: {token_id: logprob} (top-N + the sampled one)
    cumulative_logprob: float | None = None
    new_token_ids: list[int] = field(default_factory=list)  # the tokens this step added
    new_text: str = ""  # the text this step added (for streaming)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    random_weights: bool = False  # the model had seeded random weights: the text means nothing
    error: Exception | None = None  # this request alone failed in a step (finish_reason "error")
    # prompt_logprobs asked: None for the first prompt token, then {token_id: logprob} per prompt token (the
    # token itself and the top N, the shape of CompletionOutput.logprobs), as far as its prefill has come
    prompt_logprobs: list[dict[int, float] | None] | None = None

    def __repr__(self) -> str:
        out = self.outputs[0] if self.outputs else None
        note = ", RANDOM WEIGHTS (text meaningless)" if self.random_weights else ""
        return (
            f"RequestOutput({self.request_id!r}, prompt={self.prompt!r}, "
            f"text={out.text if out else None!r}, finished={self.finished}, "
            f"finish_reason={out.finish_reason if out else None!r}{note})"
        )

"""One request's state inside the engine: its answers' sequences and the text made from them, a token at a time.

``LLMEngine`` keeps a ``_Request`` per request id, with one ``_Completion`` per answer (``n`` of
them): its ``Sequence`` (the scheduler's side) and what the caller sees of it (the output processor's
side): the text, made a token at a time by an ``IncrementalDetokenizer``, the ids shown, the end.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import LifeOfPromptError
from .outputs import RequestMetrics
from .sampling_params import SamplingParams
from .sequence import Sequence

DETOKENIZE_CONTEXT = 5  # prompt tokens kept as context so the first output token decodes with its space


# ----------------------------------------------------------------------------- text, a token at a time


class IncrementalDetokenizer:
    """Turns one new token id at a time into the text it adds (vLLM's prefix/read offsets).

    Decoding a growing list from scratch each step costs O(n²); decoding only the new token
    breaks words that span tokens and multi-byte characters. So we decode a short window twice,
    with and without the new tokens, and emit the difference — holding it back while it ends in
    an incomplete UTF-8 character ("\\ufffd").
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_token_ids[-DETOKENIZE_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        delta = new_text[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta


# ----------------------------------------------------------------------------- one request's state


@dataclass
class _Completion:
    """One of the ``n`` answers of a request: its sequence and the text made from it so far."""

    index: int
    seq: Sequence
    detokenizer: IncrementalDetokenizer
    text: str = ""  # the output text (stop strings cut off)
    emitted_text_len: int = 0  # how much of ``text`` earlier outputs already carried
    logprobs: list | None = None
    cumulative_logprob: float | None = None
    token_ids: list[int] = field(default_factory=list)  # the output's tokens as shown (none after a stop string)
    new_token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # as the caller sees it (the output processor sets it)
    stop_reason: str | int | None = None

    @property
    def finished(self) -> bool:
        """Finished as the caller sees it; its sequence may still be in the scheduler until the next step."""
        return self.finish_reason is not None


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    completions: list[_Completion]
    pending: list[_Completion] = field(default_factory=list)  # n > 1: waiting for the first one's prompt
    error: LifeOfPromptError | None = None  # set when this request alone failed in a step

    @property
    def finished(self) -> bool:
        return not self.pending and all(c.finished for c in self.completions)


def _unpack_logprobs(entry):
    """The runner's per-token logprob entry: ``(logprob, {id: logprob})`` or None."""
    if entry is None:
        return None, None
    if isinstance(entry, tuple) and len(entry) == 2:
        return entry
    return None, entry

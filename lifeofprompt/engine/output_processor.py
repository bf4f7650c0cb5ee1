"""``OutputProcessor``: after each step, outside its critical section, new token ids become text and outputs.

Each request's state lives here, as in vLLM's ``output_processor.py``: a ``_Request`` per request id
(the engine keeps them), one ``_Completion`` per answer (``n`` of them) holding its ``Sequence`` (the
scheduler's side) and what the caller sees of it: the text (``IncrementalDetokenizer``, vLLM's ``detokenizer.py``),
the ids shown, the end.

The step (``llm_engine.py: LLMEngine.step``) leaves token ids: the scheduler appended them and ended
the answers that stopped on a token (``Scheduler.update_from_output``). What is left is per request
and slower: each token's time and logprobs, its text (``IncrementalDetokenizer``), and the stop
strings, which only the text can show. A stop string ends the answer's output at once: the text is
cut before it and no later token is emitted. The engine then ends the sequence in the scheduler at
its next step (``Scheduler.finish_requests``), as vLLM's output processor has the engine core abort
the request. A verify's kept tokens go through one by one, so a stop string inside an accepted run
ends the output there.

``make_output`` takes the snapshot a caller sees, holding back text that could be the start of a
stop string. While an answer runs, its ``token_ids`` and ``logprobs`` are views of the answer's own
lists (``Prefix``), which only grow: a snapshot stays true, and no step copies a list as long as its
context. The answer's last output holds plain lists (one copy per answer, at its end).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field

from ..errors import LifeOfPromptError, RequestFailedError
from .outputs import CompletionOutput, RequestMetrics, RequestOutput
from .sampling_params import SamplingParams
from .sequence import Sequence

logger = logging.getLogger("lifeofprompt.engine")


# ----------------------------------------------------------------------------- one answer's text


DETOKENIZE_CONTEXT = 5  # prompt tokens kept as context so the first output token decodes with its space


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
    detokenizer: IncrementalDetokenizer | None = None  # made with its first token (a prompt-only answer needs none)
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


# ----------------------------------------------------------------------------- what the caller sees


class Prefix(SequenceABC):
    """The first ``length`` items of a list that only grows: a snapshot that copies nothing."""

    __slots__ = ("items", "length")

    def __init__(self, items: list, length: int | None = None):
        self.items, self.length = items, len(items) if length is None else length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index):
        if isinstance(index, slice):
            start, stop, step = index.indices(self.length)
            return self.items[start:stop] if step == 1 else self.items[: self.length][index]
        if not -self.length <= index < self.length:
            raise IndexError("Prefix index out of range")
        return self.items[index % self.length]

    def __eq__(self, other) -> bool:
        if isinstance(other, (list, tuple, Prefix)):
            return len(other) == self.length and all(a == b for a, b in zip(self, other))
        return NotImplemented

    def __add__(self, other) -> list:
        return self.items[: self.length] + list(other)

    def __radd__(self, other) -> list:  # prompt + output.token_ids
        return list(other) + self.items[: self.length]

    def __repr__(self) -> str:
        return repr(self.items[: self.length])


@dataclass
class NewTokens:
    """One answer's share of a step, as the step hands it over."""

    request: _Request
    completion: _Completion
    tokens: list[int]
    logprobs: object  # the runner's entry for the last token, or a verify's list of them
    finish: tuple[str, object] | None  # (reason, stop token id): the scheduler ended it on a token
    time: float  # the end of the step that sampled them: the tokens' time, and a finish's


class OutputProcessor:
    """Text, stop strings and outputs, from what the steps hand over (``process``)."""

    def __init__(self, tokenizer, tokenizer_lock, random_weights: bool):
        """``tokenizer_lock``: held while a token is decoded (HF fast tokenizers dislike concurrent use)."""
        self.tokenizer, self.tokenizer_lock, self.random_weights = tokenizer, tokenizer_lock, random_weights

    def process(self, updates: list[NewTokens], ended: list[tuple[_Request, str]]):
        """The outputs of every request that changed (those ended outside the step first), and the ends
        found here that the scheduler must still apply: ``(request, completion, reason)``, the completion
        None for the whole request (an error)."""
        changed, ends = {}, []
        for request, reason in ended:  # an abort, or an error in the step: every open answer ends
            for c in request.completions:
                if not c.finished:
                    c.finish_reason = reason
            changed[request.request_id] = request
        for update in updates:
            request, completion = update.request, update.completion
            if request.error is not None or completion.finished:
                continue  # ended already: no token after its end is shown
            changed[request.request_id] = request
            try:
                if self.take_tokens(request, completion, update.tokens, update.logprobs, update.time):
                    ends.append((request, completion, "stop"))
                elif update.finish is not None:
                    completion.finish_reason, completion.stop_reason = update.finish
            except Exception as exc:  # this request's detokenizer or stop check: it alone ends
                request.error = failed(request, exc, "while turning its token into text")
                logger.warning("request %s failed while turning its token into text: %r", request.request_id, exc)
                for c in request.completions:
                    c.finish_reason = c.finish_reason or "error"
                ends.append((request, None, "error"))
            if request.finished and request.metrics.finished_time is None:
                request.metrics.finished_time = update.time
        return [self.make_output(request) for request in changed.values()], ends

    def take_tokens(self, request: _Request, completion: _Completion, tokens: list[int], entries, now: float) -> bool:
        """A step's new tokens, one by one: time, logprobs, text. True when a stop string ended the output."""
        for j, token in enumerate(tokens):
            last = j == len(tokens) - 1
            entry = entries[j] if isinstance(entries, list) else (entries if last else None)
            self.take_token(request, completion, token, entry, now)
            if self.find_stop_string(completion):
                return True
        return False

    def take_token(self, request: _Request, completion: _Completion, token: int, logprob_entry, now: float) -> None:
        """One new token: its time, its logprobs and the text it adds."""
        metrics = request.metrics
        metrics.token_times.append(now)
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        completion.token_ids.append(token)
        completion.new_token_ids.append(token)
        if completion.logprobs is not None:
            chosen, top = _unpack_logprobs(logprob_entry)
            completion.logprobs.append(dict(top or {}) | ({token: chosen} if chosen is not None else {}))
            if chosen is not None:
                completion.cumulative_logprob += chosen
        if completion.detokenizer is None:
            skip = completion.seq.sampling_params.skip_special_tokens
            completion.detokenizer = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, skip)
        with self.tokenizer_lock:
            completion.detokenizer.add(token)

    @staticmethod
    def find_stop_string(completion: _Completion) -> bool:
        """Whether the text now holds a stop string (once ``min_tokens`` are out): then it is cut before it."""
        params = completion.seq.sampling_params
        text = completion.detokenizer.text
        if len(completion.token_ids) >= params.min_tokens:
            for stop in params.stop:
                at = text.find(stop, max(0, len(completion.text) - len(stop) + 1))
                if at != -1:
                    completion.text = text[:at]
                    completion.finish_reason, completion.stop_reason = "stop", stop
                    return True
        completion.text = text
        return False

    def make_output(self, request: _Request) -> RequestOutput:
        """A snapshot: every answer's text and ids so far, plus what changed since the last snapshot."""
        completions = []
        for c in request.completions:
            visible = len(c.text)
            if not c.finished and request.params.stop:  # hold back what could be the start of a stop string
                visible = max(c.emitted_text_len, len(c.text) - max(map(len, request.params.stop)) + 1)
            new_text = c.text[c.emitted_text_len : visible]
            c.emitted_text_len = visible
            new_ids, c.new_token_ids = c.new_token_ids, []
            completions.append(
                CompletionOutput(
                    index=c.index,
                    text=c.text[:visible],
                    token_ids=list(c.token_ids) if c.finished else Prefix(c.token_ids),
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                    logprobs=None if c.logprobs is None else list(c.logprobs) if c.finished else Prefix(c.logprobs),
                    cumulative_logprob=c.cumulative_logprob,
                    new_token_ids=new_ids,
                    new_text=new_text,
                )
            )
        return RequestOutput(
            request.request_id,
            request.prompt,
            request.prompt_token_ids,
            completions,
            request.finished,
            request.metrics,
            num_cached_tokens=request.completions[0].seq.num_cached_tokens,
            random_weights=self.random_weights,
            error=request.error,
            prompt_logprobs=_prompt_logprobs_of(request),
        )


def failed(request: _Request, error: BaseException, where: str) -> LifeOfPromptError:
    """The error a request that failed alone carries: its own input's fault stays typed (a 4xx), anything
    else becomes a ``RequestFailedError`` (a 500) naming where."""
    if isinstance(error, LifeOfPromptError):
        return error
    return RequestFailedError(f"request {request.request_id!r} failed {where}: {type(error).__name__}: {error}")


def _prompt_logprobs_of(request: _Request) -> list | None:
    """vLLM's shape: None for the first prompt token (nothing predicts it), then one entry per scored token."""
    scored = request.completions[0].seq.prompt_logprobs
    return None if scored is None else [None, *scored]

"""``CompletionUpdates``: what the engine does with each new token of a request.

Its time, text and logprobs are recorded, and the token is checked against every way an answer
ends: ``max_tokens`` or the context limit, EOS (unless ``ignore_eos``), a stop token id, a stop
string (the text is cut before it), all held back until ``min_tokens``. A verify's kept tokens go
through one by one, so a stop inside an accepted run ends the output there. ``_make_output``
takes the snapshot a caller sees, holding back text that could be the start of a stop string.
``LLMEngine`` inherits this.
"""

from __future__ import annotations

from .outputs import CompletionOutput, RequestOutput
from .request_state import _Completion, _Request, _unpack_logprobs


class CompletionUpdates:
    def _on_tokens(
        self, request: _Request, completion: _Completion, tokens: list[int], logprob_entry, now: float
    ) -> None:
        """A step's new tokens, one by one; a stop among them ends the output there and drops the rest."""
        seq = completion.seq
        base = len(seq.output_token_ids) - len(tokens)
        for j, token in enumerate(tokens):
            last = j == len(tokens) - 1
            entry = logprob_entry[j] if isinstance(logprob_entry, list) else (logprob_entry if last else None)
            self._on_token(request, completion, token, entry, now, base + j + 1)
            if completion.finished and not last:
                del seq.output_token_ids[base + j + 1 :]
                break

    def _on_token(
        self,
        request: _Request,
        completion: _Completion,
        token: int,
        logprob_entry,
        now: float,
        num_output: int | None = None,
    ) -> None:
        """One new token: its time, text and logprobs, and whether it ends the request.

        ``num_output``: the output's length counting this token (a verify appends several at once).
        """
        seq, params, metrics = completion.seq, completion.seq.sampling_params, request.metrics
        num_output = len(seq.output_token_ids) if num_output is None else num_output
        metrics.token_times.append(now)
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        completion.new_token_ids.append(token)
        if completion.logprobs is not None:
            chosen, top = _unpack_logprobs(logprob_entry)
            completion.logprobs.append(dict(top or {}) | ({token: chosen} if chosen is not None else {}))
            if chosen is not None:
                completion.cumulative_logprob += chosen
        with self._tokenizer_lock:
            completion.detokenizer.add(token)
        reason, stop_reason = None, None
        may_stop = num_output >= params.min_tokens  # min_tokens holds every stop back
        if (
            num_output >= (params.max_tokens or self.max_model_len)
            or seq.num_prompt_tokens + num_output >= self.max_model_len
        ):
            reason = "length"
        elif may_stop and not params.ignore_eos and token in self.eos_token_ids:
            reason, stop_reason = "stop", None
        elif may_stop and token in params.stop_token_ids:
            reason, stop_reason = "stop", token
        text = completion.detokenizer.text
        for stop in params.stop if may_stop else ():
            at = text.find(stop, max(0, len(completion.text) - len(stop) + 1))
            if at != -1:
                text, reason, stop_reason = text[:at], "stop", stop
                break
        completion.text = text
        if reason is not None:
            seq.stop_reason = stop_reason
            self.scheduler.finish(seq, reason)
            if request.finished:
                metrics.finished_time = now

    def _make_output(self, request: _Request) -> RequestOutput:
        """A snapshot: cumulative text and ids of every answer, plus what changed since the last snapshot."""
        completions = []
        for c in request.completions:
            seq = c.seq
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
                    token_ids=list(seq.output_token_ids),
                    finish_reason=seq.finish_reason if c.finished else None,
                    stop_reason=seq.stop_reason,
                    logprobs=list(c.logprobs) if c.logprobs is not None else None,
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
            random_weights=self.model.is_random,
            error=request.error,
            prompt_logprobs=_prompt_logprobs_of(request),
        )


def _prompt_logprobs_of(request: _Request) -> list | None:
    """vLLM's shape: None for the first prompt token (nothing predicts it), then one entry per scored token."""
    scored = request.completions[0].seq.prompt_logprobs
    return None if scored is None else [None, *scored]

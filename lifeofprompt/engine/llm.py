"""``LLM``: the offline front door, with vLLM's names.

    from lifeofprompt import LLM, SamplingParams
    llm = LLM()                                     # the embedded SmolLM2-135M, on the CPU here
    outputs = llm.generate(["hi my name is", "hello there"], SamplingParams(temperature=0, max_tokens=16))
    print(outputs[0].outputs[0].text)

``tensor_parallel_size=T`` / ``pipeline_parallel_size=P`` split the model over T×P processes
(``lifeofprompt.distributed``; this one is rank 0 and keeps the scheduler); ``shutdown()`` ends
them, as garbage collection and interpreter exit do. With P > 1 up to P steps are in flight, one per
group of requests, so the stages overlap (``pipeline_overlap=False``: one step at a time).
``distributed_executor_backend="mp"`` takes that path even with T = P = 1 (a process group of one
rank, to measure what it costs); ``"uni"`` insists on one process.

``generate`` checks every request before any work starts (a bad one raises a typed error that
names its index, and nothing runs), adds them all to an ``LLMEngine`` and steps it until they
finish; outputs come back in the order of the prompts. ``stream`` yields what each step adds,
``chat`` applies the tokenizer's chat template first.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from collections.abc import Sequence as Seq

from ..errors import InvalidRequestError
from ..model.loader import DEFAULT_MODEL
from .llm_engine import LLMEngine
from .outputs import RequestOutput
from .sampling_params import SamplingParams

TQDM_MIN_REQUESTS = 16  # a progress bar only for runs long enough to want one


class LLM:
    def __init__(self, model=DEFAULT_MODEL, **settings):
        """The engine for ``model`` (a name, a folder, or a loaded model with ``tokenizer=``), with any of the
        engine's settings by vLLM's names (``engine/config.py``: ``max_num_seqs``, ``num_kv_blocks``,
        ``speculative_config``, ``tensor_parallel_size``, ...); a bad one is a ``ConfigError`` naming it."""
        self.engine = LLMEngine(model, **settings)
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """End the tensor-parallel worker processes now (garbage collection and exit also do)."""
        self.engine.shutdown()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_tokenizer(self):
        return self.engine.tokenizer

    # ---------------------------------------------------------------- requests
    @staticmethod
    def _as_list(prompts) -> list:
        """A string, a list of strings, a list of token-id lists (or one token-id list) → a list of prompts."""
        if isinstance(prompts, (str, dict)):
            return [prompts]
        if (
            isinstance(prompts, (list, tuple))
            and prompts
            and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts)
        ):
            return [list(prompts)]
        if not isinstance(prompts, (list, tuple)):
            raise InvalidRequestError(
                f"prompts must be a string or a list, got {type(prompts).__name__}", param="prompt"
            )
        return list(prompts)

    def _submit(self, prompts, sampling_params) -> list[str]:
        """Every prompt checked and made a request (``LLMEngine.make_request``) before any is queued, so a
        bad one raises, naming its index, with nothing left behind; then all are queued. Their ids, in order."""
        prompts = self._as_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise InvalidRequestError(
                    f"{len(params)} sampling_params for {len(prompts)} prompts: give one, or one per prompt",
                    param="sampling_params",
                )
        requests = [
            self.engine.make_request(str(next(self._ids)), prompt, p, index=i)
            for i, (prompt, p) in enumerate(zip(prompts, params))
        ]
        for request in requests:
            self.engine.add(request)
        return [request.request_id for request in requests]

    # ---------------------------------------------------------------- generation
    def generate(
        self, prompts, sampling_params: SamplingParams | Seq[SamplingParams] | None = None, use_tqdm: bool = True
    ) -> list[RequestOutput]:
        """Complete every prompt; one ``RequestOutput`` per prompt, in order."""
        ids = self._submit(prompts, sampling_params)
        position = {rid: i for i, rid in enumerate(ids)}
        results: list[RequestOutput | None] = [None] * len(ids)
        bar = None
        if use_tqdm and len(ids) >= TQDM_MIN_REQUESTS:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="Processed prompts", unit="req")
        try:
            while any(r is None for r in results):
                for out in self.engine.step():
                    if out.error is not None and out.request_id in position:
                        raise out.error  # that request failed alone; the others are aborted below
                    if out.finished and out.request_id in position:
                        results[position[out.request_id]] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            for rid in ids:  # leave the engine clean for the next call
                self.engine.abort(rid)
            self.engine.step()
            raise
        finally:
            if bar is not None:
                bar.close()
        return results

    def stream(self, prompts, sampling_params=None) -> Iterator[RequestOutput]:
        """Yield each step's changes, request by request: ``out.outputs[0].new_text`` is the delta.

        Stopping the iteration early (``break``, ``close()``) aborts the requests still running.
        """
        ids = self._submit(prompts, sampling_params)
        pending = set(ids)
        try:
            while pending:
                for out in self.engine.step():
                    if out.request_id in pending:
                        if out.finished:
                            pending.discard(out.request_id)
                        yield out
        finally:
            for rid in pending:
                self.engine.abort(rid)
            if pending:
                self.engine.step()

    def chat(
        self, messages, sampling_params=None, use_tqdm: bool = True, add_generation_prompt: bool = True
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation (a list of
        ``{"role", "content"}`` dicts) or a list of them, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.apply_chat_template(c, add_generation_prompt) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def apply_chat_template(self, conversation, add_generation_prompt: bool = True) -> dict:
        """The conversation as the token ids the model was trained to continue."""
        if not isinstance(conversation, list) or not all(
            isinstance(m, dict) and "role" in m and "content" in m for m in conversation
        ):
            raise InvalidRequestError(
                "a conversation is a list of {'role': ..., 'content': ...} messages", param="messages"
            )
        text, ids = render_chat(self.engine.tokenizer, conversation, add_generation_prompt, self.engine.model_name)
        return {"prompt": text, "prompt_token_ids": ids}


def render_chat(
    tokenizer,
    conversation: list[dict],
    add_generation_prompt: bool = True,
    model_name: str = "this model",
    tools: list[dict] | None = None,
) -> tuple[str, list[int]]:
    """A conversation through the tokenizer's own chat template: the text and its token ids.

    Shared by ``LLM.chat`` and the server's ``/v1/chat/completions`` (and ``/tokenize``); ``tools``
    (OpenAI's function definitions) go to templates that read them.
    """
    if getattr(tokenizer, "chat_template", None) is None:
        raise InvalidRequestError(f"the tokenizer of {model_name} has no chat template", param="messages")
    extra = {"tools": tools} if tools else {}
    text = tokenizer.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=add_generation_prompt, **extra
    )
    return text, list(tokenizer.encode(text, add_special_tokens=False))

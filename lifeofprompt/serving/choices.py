"""The engine's answers as OpenAI's ``choices``: whole, or as stream deltas.

One ``Choices`` per HTTP request knows what the request asked for beyond text: ``n`` answers per
prompt (choice ``prompt index × n + answer index``, OpenAI's order), log-probabilities
(``openai_logprobs.py``), a tool call (``tools.py``) and vLLM's ``return_token_ids``. Token texts for
logprobs are decoded on the server's own tokenizer, in its worker thread (``limits.PromptTokenizer``).

Completions' ``echo`` puts the prompt before each answer: its text (token-id prompts decoded) and,
with ``logprobs: N``, its tokens' logprobs (the first null) before the generated ones, as vLLM does.
Every one of the ``n`` answers of a prompt echoes it; a stream sends the prompt in each choice's first
chunk, and only there (``echo_in_stream``); ``max_tokens: 0`` gives the prompt alone.

With tools in play, each answer's text goes through a ``tool_calls.ToolCallParser``: whole, it
becomes ``content`` and ``tool_calls``; streamed, each piece becomes the content and ``tool_calls``
deltas it settles (a call's name first, then its arguments as they are generated), holding back
what could still be the start of a call.
"""

from __future__ import annotations

from .openai_logprobs import chat_logprobs, completion_logprobs, vllm_prompt_logprobs
from .openai_protocol import openai_finish_reason
from .tool_calls import ToolCallParser, deltas_from, message_from


class Choices:
    def __init__(
        self,
        prompt_tokenizer,
        *,
        chat: bool,
        n: int = 1,
        num_logprobs: int | None = None,
        tool_mode: str | None = None,
        return_token_ids: bool = False,
        echo: bool = False,
        prompt_logprobs: int | None = None,
    ):
        self.prompt_tokenizer, self.chat, self.n = prompt_tokenizer, chat, n
        self.num_logprobs, self.return_token_ids, self.echo = num_logprobs, return_token_ids, echo
        self.prompt_logprobs = prompt_logprobs  # vLLM's field (its N): the choice carries the prompt's scores
        self.echoes: dict[int, tuple[str, list, list | None]] = {}  # a stream's prompts not yet sent, by choice
        self.tool_mode = tool_mode
        self.text_offset: dict[int, int] = {}  # completions' logprobs: characters so far
        self.parsers: dict[int, ToolCallParser] = {}  # streamed answers with tools: one parser per choice

    async def logprobs(self, index: int, token_ids: list[int], entries: list | None):
        if self.num_logprobs is None or entries is None:
            return None
        if self.chat:
            return await self.prompt_tokenizer.run(chat_logprobs, list(token_ids), list(entries), self.num_logprobs)
        offset = self.text_offset.get(index, 0)
        out = await self.prompt_tokenizer.run(completion_logprobs, list(token_ids), list(entries), offset)
        self.text_offset[index] = offset + sum(len(t) for t in out["tokens"])
        return out

    async def prompt_of(self, output) -> tuple[str, list[int], list | None]:
        """What ``echo`` puts before an answer: the prompt's text (decoded when it came as token ids), its ids,
        and (with logprobs) their entries from the engine's ``prompt_logprobs``, the first None."""
        text = output.prompt
        if text is None:
            text = await self.prompt_tokenizer.run(_decode, list(output.prompt_token_ids))
        wanted = self.num_logprobs is not None and output.prompt_logprobs is not None
        return text, list(output.prompt_token_ids), list(output.prompt_logprobs) if wanted else None

    async def echo_in_stream(self, prompt_index: int, output) -> None:
        """A streamed prompt's first output: its echo waits for each of its choices' first chunk."""
        if self.echo:
            echo = await self.prompt_of(output)
            for answer in range(self.n):
                self.echoes[prompt_index * self.n + answer] = echo

    def message(self, text: str, finish_reason):
        """The chat message fields and finish reason: with tools, the calls parsed out of the text."""
        if self.tool_mode is None:
            return {"content": text}, finish_reason
        return message_from(text, finish_reason, text_allowed=self.tool_mode == "auto")

    # ------------------------------------------------------------------ whole answers
    async def whole(self, finals: dict) -> list[dict]:
        choices = []
        for prompt_index, output in sorted(finals.items()):
            for completion in output.outputs:
                index = prompt_index * self.n + completion.index
                finish = openai_finish_reason(completion)
                if self.chat:
                    message, finish = self.message(completion.text, finish)
                    choice = {"index": index, "message": {"role": "assistant", **message}}
                    ids, entries = completion.token_ids, completion.logprobs
                else:
                    text, ids, entries = await self.echoed(output, completion)
                    choice = {"index": index, "text": text}
                choice["logprobs"] = await self.logprobs(index, ids, entries)
                choice["finish_reason"] = finish
                if self.return_token_ids:
                    choice["token_ids"] = list(completion.token_ids)
                if self.prompt_logprobs is not None and output.prompt_logprobs is not None:
                    entries, top = list(output.prompt_logprobs), self.prompt_logprobs
                    choice["prompt_logprobs"] = await self.prompt_tokenizer.run(vllm_prompt_logprobs, entries, top)
                choices.append(choice)
        return sorted(choices, key=lambda c: c["index"])

    async def echoed(self, output, completion) -> tuple[str, list[int], list | None]:
        """A completions answer's text, ids and logprob entries, the prompt's first with ``echo``."""
        text, ids, entries = completion.text, list(completion.token_ids), completion.logprobs
        if not self.echo:
            return text, ids, entries
        prompt_text, prompt_ids, prompt_entries = await self.prompt_of(output)
        both = None if entries is None or prompt_entries is None else prompt_entries + list(entries)
        return prompt_text + text, prompt_ids + ids, both

    # ------------------------------------------------------------------ stream deltas
    def openings(self, num_prompts: int = 1) -> list[dict]:
        """Chat: a first chunk per choice with the role, before any text."""
        return [
            {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            for i in range(num_prompts * self.n)
        ]

    async def deltas(self, index: int, text: str, new_ids: list[int], entries, finish_reason) -> list[dict]:
        """The stream choices for what an answer added: usually one; none when it settles nothing to send yet;
        two when a tool call opens and its first arguments arrive in the same piece (``tool_calls.deltas_from``).
        The first carries the logprobs and token ids, the last the finish reason."""
        generated_ids = list(new_ids)
        if index in self.echoes:  # echo: this choice's first chunk carries its prompt
            prompt_text, prompt_ids, prompt_entries = self.echoes.pop(index)
            text, new_ids = prompt_text + text, prompt_ids + generated_ids
            entries = None if entries is None or prompt_entries is None else prompt_entries + list(entries)
        logprobs = await self.logprobs(index, new_ids, entries)
        if not self.chat:
            choices = [{"index": index, "text": text}]
        elif self.tool_mode is None:
            choices = [{"index": index, "delta": {"content": text} if text else {}}]
        else:
            parser = self.parsers.setdefault(index, ToolCallParser(text_allowed=self.tool_mode == "auto"))
            deltas = deltas_from(parser.feed(text, final=finish_reason is not None))
            if finish_reason is not None:
                finish_reason = parser.finish_reason(finish_reason)
                del self.parsers[index]
            elif deltas == [{}] and logprobs is None and not self.return_token_ids:
                return []
            choices = [{"index": index, "delta": delta} for delta in deltas]
        for choice in choices:
            choice.update(logprobs=None, finish_reason=None)
        choices[0]["logprobs"], choices[-1]["finish_reason"] = logprobs, finish_reason
        if self.return_token_ids:
            choices[0]["token_ids"] = generated_ids
            for choice in choices[1:]:
                choice["token_ids"] = []
        return choices


def _decode(tokenizer, token_ids: list[int]) -> str:
    return tokenizer.decode(token_ids, skip_special_tokens=False)

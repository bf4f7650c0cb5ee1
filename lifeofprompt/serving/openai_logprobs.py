"""Log-probabilities in OpenAI's two shapes, from the engine's per-token ``{token_id: logprob}`` entries.

The numbers are the **raw model's**: log-softmax of the logits before penalties, ``logit_bias``,
a grammar's mask, temperature and top-k/top-p (vLLM's default, ``raw_logprobs``). So they say what
the model thought, and a token a grammar forced can carry a low logprob. ``-inf`` (never produced
by finite logits, but JSON cannot carry it) is sent as -9999.0, as vLLM does.

* ``/v1/completions`` with ``logprobs: N`` (0-20): ``{"tokens", "token_logprobs", "top_logprobs",
  "text_offset"}``; each ``top_logprobs`` entry maps token text to logprob for the N most likely
  tokens *and* the sampled one (so N + 1 entries when it was not among them; N = 0 gives just it);
  ``text_offset`` counts characters into the choice's text. With ``echo`` the prompt's tokens come
  first, from the prefill's scores (the engine's ``prompt_logprobs``); the first has nothing before
  it, so its logprob and top_logprobs are null, as OpenAI's legacy completions and vLLM send them.
* vLLM's ``prompt_logprobs: N`` on completions: the choice's ``prompt_logprobs``, per prompt token None
  (the first) or ``{"token id": {"logprob", "rank", "decoded_token"}}`` for its top N and itself;
  ``rank`` is the place among them (1: the most likely), null for a prompt token below the top N
  (the engine does not rank the whole vocabulary).
* ``/v1/chat/completions`` with ``logprobs: true`` and ``top_logprobs: N``: ``{"content": [{"token",
  "logprob", "bytes", "top_logprobs": [N × {"token", "logprob", "bytes"}]}]}``.

A token's text is the tokenizer's decoding of that one id, and its ``bytes`` that text's UTF-8
(a token holding part of a character decodes to U+FFFD there).
"""

from __future__ import annotations

from pydantic import BaseModel

LOGPROB_FLOOR = -9999.0


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


def _finite(value: float) -> float:
    return max(float(value), LOGPROB_FLOOR)


def _text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def completion_logprobs(tokenizer, token_ids: list[int], entries: list[dict], text_offset: int = 0) -> dict:
    """The completions shape for these tokens (``text_offset``: characters already sent in this choice)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, entry in zip(token_ids, entries):
        text = _text(tokenizer, token)
        out["tokens"].append(text)
        out["text_offset"].append(text_offset)
        text_offset += len(text)
        if entry is None:  # an echoed prompt's first token: nothing before it predicts it
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(_finite(entry[token]) if token in entry else None)
        top: dict[str, float] = {}
        for tid, lp in sorted(entry.items(), key=lambda kv: -kv[1]):
            top.setdefault(_text(tokenizer, tid), _finite(lp))
        out["top_logprobs"].append(top)
    return out


def chat_logprobs(tokenizer, token_ids: list[int], entries: list[dict], num_top: int) -> dict:
    """The chat shape: each token with its logprob and exactly ``num_top`` alternatives (most likely first)."""

    def item(tid, lp):
        text = _text(tokenizer, tid)
        return {"token": text, "logprob": _finite(lp), "bytes": list(text.encode("utf-8"))}

    content = []
    for token, entry in zip(token_ids, entries):
        ranked = sorted(entry.items(), key=lambda kv: -kv[1])[:num_top]
        content.append(
            {**item(token, entry.get(token, LOGPROB_FLOOR)), "top_logprobs": [item(t, lp) for t, lp in ranked]}
        )
    return {"content": content}


def vllm_prompt_logprobs(tokenizer, entries: list, num_top: int) -> list:
    """vLLM's ``prompt_logprobs`` field from the engine's entries (``{token_id: logprob}``: the top ``num_top``
    and the prompt token; None first). Ranked by logprob; a prompt token outside the top ``num_top`` comes
    last in its entry, and its rank is null."""
    out = []
    for entry in entries:
        ranked = sorted(entry.items(), key=lambda kv: -kv[1]) if entry is not None else None
        out.append(
            None
            if ranked is None
            else {
                str(tid): {
                    "logprob": _finite(lp),
                    "rank": i + 1 if i < num_top else None,
                    "decoded_token": _text(tokenizer, tid),
                }
                for i, (tid, lp) in enumerate(ranked)
            }
        )
    return out

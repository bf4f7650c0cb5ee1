"""``IncrementalDetokenizer``: one answer's text, made a token at a time (vLLM's ``detokenizer.py``).

The output processor (``output_processor.py``) feeds it each new token after the step; the engine
makes one per answer when the request is checked (``LLMEngine.make_request``).
"""

from __future__ import annotations

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

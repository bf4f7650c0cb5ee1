"""Structured output: the next token is chosen only among those a grammar allows, so JSON comes out as JSON.

A request asks with vLLM's names, ``SamplingParams(structured_outputs=StructuredOutputsParams(json=schema))``
(or ``regex=``, ``choice=``, ``grammar=`` in EBNF, ``json_object=True``, or ``structural_tag=``: xgrammar's
structural tag as JSON, free text with tagged regions such as tool calls, see ``serving/tools.py``), or over
HTTP with OpenAI's ``response_format``. The grammar library, xgrammar, does the hard part: it compiles the
grammar once against the tokenizer's vocabulary, and for each sequence keeps a matcher that knows
where in the grammar the output stands. Each step:

1. the matcher fills the sequence's row of a bitmask (one bit per token: may it come next?);
2. the sampler sets every disallowed token's logit to ``-inf`` before greedy or sampling, so every
   sampling mode respects it;
3. the chosen token is fed back to the matcher (``accept``), which moves on.

When the grammar is complete the matcher allows only the end-of-sequence token, and the engine's
usual EOS rule ends the answer.

With speculative decoding the drafts are cut to what the grammar allows (``valid_prefix``), and
each of the verify's k + 1 rows is masked with the state after the drafts before it: the matcher
takes the drafts tentatively, filling one bitmask row after each, then rolls back
(``verify_bitmask``); the rejection rule then runs on the masked rows, and only the tokens it
keeps are accepted for real (``rejection_sampler.verify_sequence``). The mask costs a fraction of a millisecond per row
(``benchmarks/bench_structured.py`` times it against the step). Prompting plays no part: with
random weights the output still parses, which is how the tests check that the mask, not the
model, makes it valid.

Why xgrammar: vLLM's default backend, with wheels for Linux x86-64 and aarch64 on CPython 3.9 and up
(checked on 3.11 here and on 3.12, ``benchmarks/results/py312_structured_output_*.json``), the same
code on CPU and GPU, and a mask that costs 1.4% of a batch-1 CPU decode step here. llguidance and
outlines-core were not measured: with the mask this cheap, a faster one could not move the step.

xgrammar is imported only when a request asks for structure; where it cannot be imported (no wheel
for this Python, or not installed) such a request gets a ``StructuredOutputUnavailableError`` (a
``MissingDependencyError``; a 400 over HTTP) that names the package and the command to install it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from ..errors import InvalidRequestError, StructuredOutputUnavailableError

KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
# JSON may be laid out with spaces and newlines as models like to, but a run of whitespace is capped:
# an unbounded one lets a model (random weights above all) pad until max_tokens and never close the object.
MAX_WHITESPACE = 8
LOOSE_STRING_CHARACTER = r"[^\"\\\r\n]"  # as xgrammar writes a length-bounded string's characters
STRICT_STRING_CHARACTER = r"[^\0-\x1f\"\\\r\n]"  # ... and as JSON allows them


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of: a JSON schema (dict or JSON text), a regex, a list of choices, EBNF, any JSON object,
    or an xgrammar structural tag (dict or JSON text, vLLM's ``structural_tag``)."""

    json: dict | str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    structural_tag: dict | str | None = None

    def __post_init__(self):
        given = [k for k in KINDS if getattr(self, k) is not None and getattr(self, k) is not False]
        if len(given) != 1:
            raise InvalidRequestError(
                f"structured_outputs needs exactly one of {', '.join(KINDS)}; got {', '.join(given) or 'none'}",
                param="structured_outputs",
            )
        if self.choice is not None:
            if (
                not isinstance(self.choice, (list, tuple))
                or not self.choice
                or not all(isinstance(c, str) and c for c in self.choice)
            ):
                raise InvalidRequestError(
                    "structured_outputs.choice must be a non-empty list of non-empty strings",
                    param="structured_outputs.choice",
                )
            object.__setattr__(self, "choice", tuple(self.choice))
        for name in ("regex", "grammar"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise InvalidRequestError(
                    f"structured_outputs.{name} must be a string", param=f"structured_outputs.{name}"
                )
        if not isinstance(self.json_object, bool):
            raise InvalidRequestError(
                "structured_outputs.json_object must be true or false", param="structured_outputs.json_object"
            )
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise InvalidRequestError(
                "structured_outputs.json must be a JSON schema (an object or its JSON text)",
                param="structured_outputs.json",
            )
        if self.structural_tag is not None and not isinstance(self.structural_tag, (dict, str)):
            raise InvalidRequestError(
                "structured_outputs.structural_tag must be an xgrammar structural tag (an object or its JSON text)",
                param="structured_outputs.structural_tag",
            )

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) is not None and getattr(self, k) is not False)

    def key(self) -> tuple[str, str]:
        """A hashable description, so a grammar asked for twice is compiled once."""
        value = getattr(self, self.kind)
        if isinstance(value, dict):
            value = json.dumps(value, sort_keys=True)
        return self.kind, value if isinstance(value, str) else repr(value)


def _xgrammar():
    try:
        import xgrammar
    except ImportError as exc:
        raise StructuredOutputUnavailableError(
            f"structured output (structured_outputs, response_format, tool calls) needs the xgrammar package, which "
            f"cannot be imported here ({exc}): pip install xgrammar (it is in lifeofprompt's serve and dev "
            "extras)"
        ) from exc
    return xgrammar


def _tokenizer_info(xgr, tokenizer, vocab_size: int, stop_token_ids: list[int]):
    """xgrammar's view of the vocabulary: from a Hugging Face tokenizer, or byte by byte for the random twin's."""
    if getattr(tokenizer, "is_stand_in", False):
        # loader.ByteTokenizer (the random twin's): id = byte + 3. Only its ASCII bytes are offered:
        # its other bytes are pieces of characters that a grammar over text cannot place (empty
        # entries are tokens a grammar never allows).
        vocab = [b""] * 3 + [bytes([b]) if b < 0x80 else b"" for b in range(256)]
        vocab += [b""] * (vocab_size - len(vocab))
        return xgr.TokenizerInfo(
            vocab[:vocab_size], vocab_type=xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=stop_token_ids
        )
    return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)


class GrammarBackend:
    """One per engine: the compiler for this tokenizer, and every grammar compiled so far."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids):
        self.xgr = _xgrammar()
        self.vocab_size = vocab_size
        self.info = _tokenizer_info(self.xgr, tokenizer, vocab_size, sorted(stop_token_ids))
        self.compiler = self.xgr.GrammarCompiler(self.info)
        self.compiled: dict = {}

    def compile(self, params: StructuredOutputsParams):
        key = params.key()
        if key not in self.compiled:
            try:
                self.compiled[key] = self._compile(params)
            except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar's message says what it could not parse
                raise InvalidRequestError(
                    f"structured_outputs.{params.kind} could not be compiled: {exc}",
                    param=f"structured_outputs.{params.kind}",
                ) from None
        return self.compiled[key]

    def _compile(self, params: StructuredOutputsParams):
        c, kind = self.compiler, params.kind
        if kind in ("json", "json_object"):  # OpenAI's json_object: any JSON *object*, not any value
            schema = {"type": "object"} if kind == "json_object" else params.json
            return c.compile_grammar(self.json_grammar(schema if isinstance(schema, str) else json.dumps(schema)))
        if kind == "regex":
            return c.compile_regex(params.regex)
        if kind == "choice":
            return c.compile_regex("|".join(_escape(choice) for choice in params.choice))
        if kind == "structural_tag":
            return c.compile_grammar(self.structural_tag_grammar(params.structural_tag))
        return c.compile_grammar(params.grammar)

    def structural_tag_grammar(self, tag: dict | str) -> str:
        """A structural tag's grammar in EBNF, strings held to JSON's rule as in ``json_grammar``."""
        text = tag if isinstance(tag, str) else json.dumps(tag)
        return str(self.xgr.Grammar.from_structural_tag(text)).replace(LOOSE_STRING_CHARACTER, STRICT_STRING_CHARACTER)

    def json_grammar(self, schema: str) -> str:
        """The schema's grammar in EBNF, with JSON's ban on raw control characters in strings enforced.

        RFC 8259 lets a string hold U+0000-U+001F only escaped. xgrammar's rule for the characters
        of a length-bounded string (``maxLength``) leaves that out, and random weights found it: a
        raw backspace inside a name, which strict parsers (Python's ``json.loads``) refuse.
        """
        text = str(self.xgr.Grammar.from_json_schema(schema, max_whitespace_cnt=MAX_WHITESPACE))
        return text.replace(LOOSE_STRING_CHARACTER, STRICT_STRING_CHARACTER)

    def matcher(self, params: StructuredOutputsParams) -> GrammarState:
        return GrammarState(self.xgr.GrammarMatcher(self.compile(params)), self)

    def new_bitmask(self, rows: int) -> torch.Tensor:
        """``[rows, ceil(vocab / 32)]`` int32, every bit set (every token allowed)."""
        return self.xgr.allocate_token_bitmask(rows, self.vocab_size)

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        """Disallowed tokens' logits to ``-inf``, in place (rows whose bits are all set are unchanged)."""
        self.xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device))


def grammar_bitmask(states: list[GrammarState | None]) -> torch.Tensor | None:
    """The step's bitmask, a row per sequence (all bits set for those without a grammar), or None if none has one."""
    first = next((s for s in states if s is not None), None)
    if first is None:
        return None
    bitmask = first.backend.new_bitmask(len(states))
    for row, state in enumerate(states):
        if state is not None:
            state.fill(bitmask, row)
    return bitmask


def _escape(text: str) -> str:
    """``text`` as a regex that matches only itself."""
    import re

    return re.escape(text)


class GrammarState:
    """One sequence's place in its grammar."""

    def __init__(self, matcher, backend: GrammarBackend):
        self.matcher, self.backend = matcher, backend

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> bool:
        """Move past ``token``; False if the grammar does not allow it (the mask should have prevented that)."""
        return self.matcher.accept_token(token)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens > 0:
            self.matcher.rollback(num_tokens)

    # ---------------------------------------------------------------- speculative decoding
    def valid_prefix(self, draft: list[int]) -> int:
        """How many of ``draft`` the grammar takes in a row, stopping before one that would end it
        (nothing may be verified after the end). Tried, then rolled back: the state is unchanged."""
        tried = keep = 0
        for token in draft:
            if not self.matcher.accept_token(token):
                break
            tried += 1
            if self.matcher.is_terminated():
                break
            keep = tried
        self.rollback(tried)
        return keep

    def verify_bitmask(self, draft: list[int]) -> torch.Tensor:
        """``[k + 1, words]``: row ``i`` allows what may follow the drafts before it, so each verify row is
        masked as a plain decode at its position would be. The drafts are advanced tentatively, one by one,
        then rolled back; the caller accepts the kept ones for real. ``draft`` must be a ``valid_prefix``."""
        bitmask = self.backend.new_bitmask(len(draft) + 1)
        self.fill(bitmask, 0)
        accepted = 0
        try:
            for i, token in enumerate(draft):
                if not self.matcher.accept_token(token):
                    raise ValueError(f"draft token {token} is outside the grammar (call valid_prefix first)")
                accepted += 1
                self.fill(bitmask, i + 1)
        finally:
            self.rollback(accepted)
        return bitmask

    @property
    def finished(self) -> bool:
        return self.matcher.is_terminated()

"""Tokenization, opened up: text → bytes → byte-level BPE merges → token ids (notebook 01).

A byte-level BPE tokenizer (SmolLM2's, GPT-2's) does three things:

1. *pre-tokenize*: split the text into word-like pieces with a regular expression and write
   each piece's UTF-8 bytes as printable characters (a space becomes ``Ġ``);
2. *merge*: start from single bytes and repeatedly join the adjacent pair that comes first
   in the tokenizer's ranked merge list, until no listed pair is left;
3. *look up*: each remaining symbol is a vocabulary entry with an integer id.

``bpe_encode`` redoes step 2 and 3 in plain Python from the tokenizer's own merge list and
is tested to give exactly the ids of ``tokenizer.encode``; ``bpe_steps`` records every merge
so a notebook can show one word being built. The rest makes the tables and the figure of
notebook 01.
"""

from __future__ import annotations

import html
import json
import weakref
from dataclasses import dataclass
from functools import lru_cache

from ..story import STORY_PROMPTS

# What the article "Life of a prompt" reports for its three prompts in TinyLlama's tokens (SentencePiece,
# <s> first). load_llama_spm_tokenizer() computes them: 5, 7 and 3 with <s>; the article's 2 for
# "hello there" is the count without it.
STORY_TINYLLAMA_COUNTS = {"hi my name is": 5, "today is a beautiful summer day": 7, "hello there": 2}

# ----------------------------------------------------------------------------- bytes as characters


@lru_cache(maxsize=1)
def byte_to_unicode() -> dict[int, str]:
    """GPT-2's table from the 256 byte values to 256 printable characters.

    Bytes that already print as themselves (``!``..``~``, ``¡``..``¬``, ``®``..``ÿ``) keep their
    character; the other 68 (space, control bytes, ...) are moved to code points 256 onwards, in
    order. So the space byte 0x20 becomes ``chr(256 + 32) = 'Ġ'`` and newline becomes ``'Ċ'``.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, shifted = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


def bytes_as_symbols(text: str) -> list[str]:
    """The UTF-8 bytes of ``text`` as printable one-character symbols (BPE's starting point)."""
    table = byte_to_unicode()
    return [table[b] for b in text.encode("utf-8")]


# ----------------------------------------------------------------------------- the merge list


def _tokenizer_json(tokenizer) -> dict:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise TypeError("a fast (Rust-backed) Hugging Face tokenizer is needed to read its merge list")
    return json.loads(backend.to_str())


def merge_ranks(tokenizer) -> dict[tuple[str, str], int]:
    """The tokenizer's merge list as ``{(left, right): rank}``; a lower rank is merged earlier."""
    model = _tokenizer_json(tokenizer)["model"]
    if model.get("type") != "BPE":
        raise TypeError(f"expected a BPE tokenizer, got {model.get('type')!r}")
    ranks = {}
    for rank, merge in enumerate(model["merges"]):
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge  # old and new tokenizer.json
        ranks[(left, right)] = rank
    return ranks


def pretokenize(tokenizer, text: str) -> list[str]:
    """The tokenizer's own first step: word-like pieces, bytes already written as symbols."""
    return [piece for piece, _ in tokenizer.backend_tokenizer.pre_tokenizer.pre_tokenize_str(text)]


# ----------------------------------------------------------------------------- BPE, step by step


@dataclass(frozen=True)
class MergeStep:
    """One merge: the pair joined, its rank in the merge list, and the symbols after it."""

    step: int
    pair: tuple[str, str]
    rank: int
    symbols: tuple[str, ...]


def bpe_steps(symbols: list[str], ranks: dict[tuple[str, str], int]) -> list[MergeStep]:
    """Merge a piece the way the tokenizer does: always the best-ranked adjacent pair first.

    Each step finds, among all adjacent pairs, the one with the lowest rank and joins every
    occurrence of it, left to right. It stops when no adjacent pair is in the merge list.
    """
    symbols = list(symbols)
    steps: list[MergeStep] = []
    while len(symbols) > 1:
        pairs = {(a, b) for a, b in zip(symbols, symbols[1:]) if (a, b) in ranks}
        if not pairs:
            break
        best = min(pairs, key=ranks.__getitem__)
        merged, i = [], 0
        while i < len(symbols):
            if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == best:
                merged.append(symbols[i] + symbols[i + 1])
                i += 2
            else:
                merged.append(symbols[i])
                i += 1
        symbols = merged
        steps.append(MergeStep(len(steps) + 1, best, ranks[best], tuple(symbols)))
    return steps


def bpe_encode(tokenizer, text: str) -> list[int]:
    """Token ids computed by our own merge loop; equal to ``tokenizer.encode(text)`` (tested).

    Special tokens written in the text (``<|im_start|>``) are not recognised here: this is
    the plain-text path, the one the story's prompts take. A byte missing from the vocabulary
    (see ``missing_bytes``) is dropped before merging, as the real tokenizer drops it, so its
    neighbours may merge across the gap.
    """
    ranks = _cached_ranks(tokenizer)
    vocab = tokenizer.get_vocab()
    ids = []
    for piece in pretokenize(tokenizer, text):
        symbols = [ch for ch in piece if ch in vocab]
        steps = bpe_steps(symbols, ranks)
        ids += [vocab[symbol] for symbol in (steps[-1].symbols if steps else symbols)]
    return ids


def missing_bytes(tokenizer) -> list[int]:
    """Byte values with no token of their own; text containing them loses them silently.

    A byte-level vocabulary is meant to hold all 256 bytes, but SmolLM2's lacks 21 (six control
    bytes, bytes never valid in UTF-8, and 0xF1/0xF2 that start rare 4-byte characters), and
    with no unknown token the tokenizer simply drops them.
    """
    vocab = tokenizer.get_vocab()
    return [b for b, symbol in byte_to_unicode().items() if symbol not in vocab]


_RANKS_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _cached_ranks(tokenizer) -> dict[tuple[str, str], int]:
    """``merge_ranks`` read once per tokenizer object (the list has ~49k entries)."""
    if tokenizer not in _RANKS_CACHE:
        _RANKS_CACHE[tokenizer] = merge_ranks(tokenizer)
    return _RANKS_CACHE[tokenizer]


@dataclass(frozen=True)
class Walkthrough:
    """One word from text to ids: its bytes, its starting symbols, every merge, the ids."""

    text: str
    utf8: tuple[int, ...]
    start: tuple[str, ...]
    steps: tuple[MergeStep, ...]
    tokens: tuple[str, ...]
    ids: tuple[int, ...]


def bpe_walkthrough(tokenizer, word: str) -> Walkthrough:
    """Take ``word`` (one pre-tokenizer piece, e.g. ``" beautiful"``) through the merge list."""
    pieces = pretokenize(tokenizer, word)
    if len(pieces) != 1:
        raise ValueError(
            f"{word!r} is split into {len(pieces)} pieces by the pre-tokenizer; give one word "
            "(a leading space belongs to the word)"
        )
    start = bytes_as_symbols(word)
    steps = bpe_steps(start, _cached_ranks(tokenizer))
    tokens = steps[-1].symbols if steps else tuple(start)
    vocab = tokenizer.get_vocab()
    return Walkthrough(
        word, tuple(word.encode("utf-8")), tuple(start), tuple(steps), tuple(tokens), tuple(vocab[t] for t in tokens)
    )


def format_walkthrough(walk: Walkthrough) -> str:
    """The walkthrough as plain text: one line per merge, then the ids."""
    lines = [
        f"text      {walk.text!r}",
        f"UTF-8     {list(walk.utf8)}",
        f"symbols   {' '.join(walk.start)}   ({len(walk.start)} single bytes)",
    ]
    for s in walk.steps:
        lines.append(
            f"merge {s.step:>2}  {s.pair[0]!s:>8} + {s.pair[1]!s:<8} (rank {s.rank:>5})  ->  {' '.join(s.symbols)}"
        )
    lines.append(f"tokens    {list(walk.tokens)}  ids {list(walk.ids)}")
    return "\n".join(lines)


def plot_walkthrough(walk: Walkthrough, ax=None):
    """One row per state of the word, its symbols drawn as boxes; the pair just merged is shaded."""
    import matplotlib.pyplot as plt

    states = [(f"{len(walk.start)} bytes", walk.start, None)]
    states += [(f"merge {s.step} (rank {s.rank})", s.symbols, s.pair[0] + s.pair[1]) for s in walk.steps]
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 0.45 * len(states) + 1.2))
    width = sum(len(sym) for sym in walk.start)
    for row, (label, symbols, new) in enumerate(states):
        x = 0.0
        for sym in symbols:
            shaded = new is not None and sym == new
            ax.add_patch(
                plt.Rectangle(
                    (x, -row - 0.4),
                    len(sym),
                    0.8,
                    facecolor="#f4a261" if shaded else "#e9f1fa",
                    edgecolor="#264653",
                    linewidth=1,
                )
            )
            ax.text(x + len(sym) / 2, -row, sym, ha="center", va="center", fontsize=10, family="DejaVu Sans Mono")
            x += len(sym)
        ax.text(-0.3, -row, label, ha="right", va="center", fontsize=9)
    ax.text(
        width + 0.3,
        -(len(states) - 1),
        "ids " + ", ".join(map(str, walk.ids)),
        va="center",
        fontsize=10,
        fontweight="bold",
    )
    ax.set_xlim(-6, width + 6)
    ax.set_ylim(-len(states) + 0.4, 0.8)
    ax.axis("off")
    ax.set_title(
        f"Byte-level BPE: {walk.text!r} built from its bytes by the tokenizer's merge list "
        "(shaded: the pair merged at that step)",
        fontsize=10,
    )
    return ax


# ----------------------------------------------------------------------------- tables


@dataclass(frozen=True)
class TokenRow:
    text: str
    ids: tuple[int, ...]
    tokens: tuple[str, ...]

    @property
    def count(self) -> int:
        return len(self.ids)


def token_table(tokenizer, prompts=STORY_PROMPTS) -> list[TokenRow]:
    """Each prompt with its ids and token strings, as the engine sees it (no special tokens added by us)."""
    rows = []
    for text in prompts:
        ids = tokenizer.encode(text)
        rows.append(TokenRow(text, tuple(ids), tuple(tokenizer.convert_ids_to_tokens(ids))))
    return rows


def format_token_table(rows: list[TokenRow]) -> str:
    """Plain text, stable across runs (nbval checks it)."""
    width = max(len(repr(r.text)) for r in rows)
    lines = [f"{'prompt':<{width}}  count  ids"]
    for r in rows:
        lines.append(f"{r.text!r:<{width}}  {r.count:>5}  {list(r.ids)}")
        lines.append(f"{'':<{width}}         {list(r.tokens)}")
    return "\n".join(lines)


def token_table_html(rows: list[TokenRow], story_counts: dict[str, int] | None = None) -> str:
    """An HTML table: prompt, count, each token as a chip with its id underneath."""
    head = "<tr><th style='text-align:left'>prompt</th><th style='text-align:left'>tokens</th><th>count</th>"
    head += "<th>story's TinyLlama count</th></tr>" if story_counts else "</tr>"
    body = []
    for r in rows:
        chips = "".join(
            f"<span style='display:inline-block;margin:1px 3px;padding:1px 5px;border:1px solid #8ab;"
            f"border-radius:4px;text-align:center;font-family:monospace'>{html.escape(t)}<br>"
            f"<small class='token-id'>{i}</small></span>"
            for t, i in zip(r.tokens, r.ids)
        )
        cells = (
            f"<td style='text-align:left'><code>{html.escape(repr(r.text))}</code></td>"
            f"<td style='text-align:left'>{chips}</td><td>{r.count}</td>"
        )
        if story_counts:
            cells += f"<td>{story_counts.get(r.text, '')}</td>"
        body.append(f"<tr>{cells}</tr>")
    return f"<table class='lop-token-table'>{head}{''.join(body)}</table>"


def special_tokens(tokenizer) -> list[tuple[int, str, bool]]:
    """``(id, text, is_special)`` for the tokens added on top of the BPE vocabulary, by id."""
    added = tokenizer.get_added_vocab()
    specials = set(tokenizer.all_special_tokens)
    return sorted((i, t, t in specials) for t, i in added.items())


def chat_prompt(tokenizer, user_text: str, system: str | None = None) -> tuple[str, list[int]]:
    """The text and ids the Instruct model expects for one user turn (its chat template, generation prompt on)."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user_text}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return text, tokenizer.encode(text)


# ----------------------------------------------------------------------------- TinyLlama's tokenizer, offline


def load_llama_spm_tokenizer(fetch: bool = False):
    """TinyLlama's tokenizer (the LLaMA SentencePiece vocabulary), or None where it is not available.

    It comes from a vocabulary-only GGUF inside the pinned llama-cpp-python sdist
    (``llama_cpp_sdist.llama_spm_vocab``; set-up fetches it once), which transformers reads with
    ``gguf_file=``. The story's seed counts its prompts in these tokens, not in SmolLM2's. With
    ``fetch=False`` nothing is downloaded: a notebook without the file says so instead.
    """
    from .llama_cpp_sdist import SPM_VOCAB, llama_spm_vocab

    folder = llama_spm_vocab(fetch=fetch)
    if folder is None:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), gguf_file=SPM_VOCAB)

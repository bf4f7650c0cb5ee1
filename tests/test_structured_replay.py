"""lessons/structured.replay_mask (chapter 12's mask figure): the grammar's allowed set at every step
of a finished answer, and what the model wanted there without it."""

from __future__ import annotations

import pytest
import torch

from lifeofprompt import LLM, SamplingParams
from lifeofprompt.engine.structured_output import StructuredOutputsParams
from lifeofprompt.lessons.structured import allowed_tokens, replay_mask

pytest.importorskip("xgrammar")

VOCAB = 300  # tests/tiny_models.py: the byte tokenizer, token id = byte + 3


@pytest.fixture(scope="module")
def tiny_llm(tiny_model):
    model, tokenizer = tiny_model
    return LLM(model, tokenizer=tokenizer, log_stats=False, num_kv_blocks=64, max_num_seqs=4)


def answer(llm, structure, prompt="hello"):
    out = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=32, structured_outputs=structure), use_tqdm=False
    )[0]
    return out.prompt_token_ids, out.outputs[0].token_ids


def test_the_bitmask_unpacks_bit_j_of_word_w_to_token_32w_plus_j():
    row = torch.zeros(3, dtype=torch.int32)
    row[0] = 1 << 5  # token 5
    row[1] = -(2**31)  # bit 31 of word 1 (the sign bit): token 63
    row[2] = 0b11  # tokens 64 and 65
    assert allowed_tokens(row, 70).nonzero().flatten().tolist() == [5, 63, 64, 65]
    assert allowed_tokens(row, 65).nonzero().flatten().tolist() == [5, 63, 64]  # cut at the vocabulary


def test_a_choice_allows_exactly_its_first_letters_then_one_token(tiny_llm):
    structure = StructuredOutputsParams(choice=["yes", "no"])
    prompt, output = answer(tiny_llm, structure)
    steps = replay_mask(tiny_llm.engine, prompt, output, structure, top_k=VOCAB)
    assert steps[0].num_allowed == 2  # "y" or "n"
    assert {t for t, _ in steps[0].best_allowed} == {ord("y") + 3, ord("n") + 3}
    assert all(s.num_allowed == 1 for s in steps[1:])  # then the rest of the word, then EOS
    text = bytes(t - 3 for t in output if 3 <= t < 259).decode()
    assert text in ("yes", "no")
    for s in steps:
        by_id = {t: ok for t, _, ok in s.wanted}
        assert by_id[s.chosen]  # what the engine chose was allowed
        assert s.allowed_mass == pytest.approx(sum(p for _, p, ok in s.wanted if ok), abs=1e-5)
        assert s.overridden == (not s.wanted[0][2])


def test_a_json_answer_replays_and_a_foreign_token_is_refused(tiny_llm):
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}},
        "required": ["a"],
        "additionalProperties": False,
    }
    structure = StructuredOutputsParams(json=schema)
    prompt, output = answer(tiny_llm, structure)
    steps = replay_mask(tiny_llm.engine, prompt, output, structure)
    assert len(steps) == len(output) and steps[0].num_allowed < VOCAB
    assert any(s.num_allowed > 5 for s in steps)  # whitespace or digits: more than one way on
    with pytest.raises(ValueError, match="breaks the grammar"):
        replay_mask(tiny_llm.engine, prompt, [ord("x") + 3], structure)


def test_the_mask_figure_names_the_machine_and_marks_the_refused_choice(tiny_llm):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from lifeofprompt.figures.structured import plot_mask

    structure = StructuredOutputsParams(choice=["yes", "no"])
    prompt, output = answer(tiny_llm, structure)
    steps = replay_mask(tiny_llm.engine, prompt, output, structure, top_k=6)
    fig = plot_mask(steps, lambda t: tiny_llm.engine.tokenizer.decode([t]), VOCAB, at=0, title="t", label="machine X")
    assert any(t.get_text() == "machine X" for t in fig.texts)
    left, right = fig.axes
    assert [p.get_height() for p in left.patches] == [s.num_allowed for s in steps]
    wanted = steps[0].wanted
    assert [p.get_width() for p in right.patches[: len(wanted)]] == [max(p, 1e-12) for _, p, _ in wanted]
    assert len(right.patches) == len(wanted) + len({t for t, _ in steps[0].best_allowed} - {t for t, _, _ in wanted})
    assert sum(1 for t in right.texts if "refused" in t.get_text()) == sum(1 for *_, ok in wanted if not ok)
    assert sum(1 for t in right.texts if "chosen" in t.get_text()) == 1  # greedy: the best allowed token
    for ax in fig.axes:
        assert ax.get_xlabel() and ax.get_title()
    plt.close(fig)

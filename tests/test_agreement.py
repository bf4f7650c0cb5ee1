"""The margin-aware comparisons themselves: they pass on rounding, and fail on a wrong answer or on saying nothing."""

from __future__ import annotations

import pytest
import torch

from lifeofprompt.lessons.agreement import (
    assert_argmax_agrees,
    assert_greedy_agrees,
    teacher_forced_logits,
    top2_margins,
)


def reference_rows(rows=12, vocab=50, seed=0):
    """Logits whose best token leads by at least 1 in every row."""
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed))
    best = logits.argmax(-1)
    logits[torch.arange(rows), best] = logits.max(-1).values + 1.0
    return logits


def test_margins():
    logits = torch.tensor([[1.0, 3.0, 2.5], [0.0, 0.0, -1.0]])
    assert top2_margins(logits).tolist() == [0.5, 0.0]


def test_rounding_passes_and_returns_the_decided_rows():
    ref = reference_rows()
    noisy = ref + 1e-4 * torch.randn(ref.shape, generator=torch.Generator().manual_seed(1))
    assert assert_argmax_agrees(noisy, ref, 1e-2, min_decided=12) == 12
    assert assert_argmax_agrees(ref.argmax(-1).tolist(), ref, 1e-2, min_decided=12) == 12  # token ids work too


def test_a_changed_decided_argmax_fails():
    ref = reference_rows()
    broken = ref.clone()
    broken[5, (ref[5].argmax() + 1) % ref.shape[1]] += 10.0  # row 5 now picks another token
    with pytest.raises(AssertionError, match="row 5"):
        assert_argmax_agrees(broken, ref, 1e-2, min_decided=10)
    ids = ref.argmax(-1)
    ids[3] = (ids[3] + 1) % ref.shape[1]
    with pytest.raises(AssertionError, match="row 3"):
        assert_argmax_agrees(ids, ref, 1e-2, min_decided=10)


def test_a_flip_at_a_near_tie_is_allowed():
    ref = reference_rows()
    second = ref[7].clone()
    second[ref[7].argmax()] = float("-inf")
    ref[7, second.argmax()] = ref[7].max() - 1e-3  # row 7: a near tie
    flipped = ref.clone()
    flipped[7, second.argmax()] += 2e-3
    assert assert_argmax_agrees(flipped, ref, 1e-2, min_decided=10) == 11
    per_row = torch.full((12,), 1e-2)
    per_row[0] = 100.0  # a tolerance per row: row 0 undecided too
    assert assert_argmax_agrees(flipped, ref, per_row, min_decided=10) == 10


def test_all_ties_say_nothing_and_fail():
    ties = torch.zeros(12, 50)
    ties[:, :2] = 1.0  # every row: ids 0 and 1 tied
    with pytest.raises(AssertionError, match="only 0 of 12 rows decided"):
        assert_argmax_agrees(ties, ties, 1e-2, min_decided=10)


def test_shapes_must_match():
    with pytest.raises(AssertionError, match="choices"):
        assert_argmax_agrees([1, 2], reference_rows(), 1e-2, min_decided=0)


def test_greedy_sequences_part_only_at_near_ties():
    want = [[5, 6, 7, 8, 9], [1, 2, 3, 4, 5]]
    margins = [[1.0, 1.0, 1e-4, 1.0, 1.0], [1.0] * 5]
    assert assert_greedy_agrees(want, want, margins, 1e-2, min_steps=10) == [5, 5]
    parted = [[5, 6, 70, 80, 90], [1, 2, 3, 4, 5]]  # parts at the near tie, then anything
    assert assert_greedy_agrees(parted, want, margins, 1e-2, min_steps=7) == [2, 5]
    with pytest.raises(AssertionError, match="only 7 steps compared"):
        assert_greedy_agrees(parted, want, margins, 1e-2, min_steps=9)
    wrong = [[5, 6, 7, 8, 9], [1, 2, 30, 4, 5]]  # parts where the reference was sure
    with pytest.raises(AssertionError, match="sequence 1 parts from the reference at step 2"):
        assert_greedy_agrees(wrong, want, margins, 1e-2, min_steps=0)
    ties = [[0.0] * 5, [0.0] * 5]
    with pytest.raises(AssertionError, match="only 0 steps"):
        assert_greedy_agrees([[9] * 5, [9] * 5], want, ties, 1e-2, min_steps=5)


def test_teacher_forced_rows_predict_each_new_token():
    from lifeofprompt.model.config import ModelConfig
    from lifeofprompt.model.llama import LlamaForCausalLM

    config = ModelConfig(
        name="tiny",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    prompt, new = [3, 4, 5], [6, 7]
    rows = teacher_forced_logits(model, prompt, new)
    with torch.no_grad():
        full = model(torch.tensor([prompt + new]))[0]
    assert rows.shape == (2, 64)
    torch.testing.assert_close(rows, full[2:4])  # after 3 prompt tokens, then after 3 + 1

"""Greedy decoding without and with a KV cache (notebooks 03 and 04): same tokens as transformers, pinned."""

from __future__ import annotations

import pytest
import torch

from lifeofprompt.errors import InvalidRequestError
from lifeofprompt.lessons.generate import (compare_old_rows, generate_cached, generate_cached_batch, generate_naive,
                                   record_forward)
from lifeofprompt.lessons.reference import hf_greedy

# SmolLM2-135M-Instruct (embedded, fp32, CPU), 64 greedy tokens after each story prompt, EOS ignored.
PINNED_64 = [
    [2026, 365, 10905, 6176, 28, 4836, 260, 3589, 25, 198, 198, 57, 5248, 441, 2090, 732, 288, 1643, 28, 564, 339, 5248, 2090, 339, 416, 724, 30, 339, 5248, 253, 3241, 282, 253, 2026, 365, 6832, 741, 288, 260, 9192, 281, 3433, 282, 260, 5700, 25, 339, 5248, 253, 3241, 282, 253, 2026, 365, 10905, 6176, 1163, 25, 339, 5248, 253, 3241, 282, 253],
    [281, 260, 216, 34, 33, 302, 2070, 30, 2, 198, 1, 4093, 198, 1780, 314, 260, 768, 2378, 1114, 281, 260, 905, 47, 2, 198, 1, 520, 9531, 198, 504, 768, 2378, 1114, 281, 260, 905, 314, 1129, 23145, 28, 564, 339, 6737, 7440, 338, 357, 506, 260, 1114, 282, 260, 9734, 30, 533, 3201, 4963, 14566, 28, 260, 768, 2378, 1114, 436, 441],
    [506, 787, 737, 288, 536, 357, 30, 198, 198, 504, 2988, 314, 42, 216, 33, 30, 198, 198, 504, 2988, 314, 42, 216, 34, 30, 2, 198, 1, 520, 9531, 198, 504, 2988, 314, 216, 34, 30, 2, 198, 2, 1, 9690, 198, 2, 198, 1, 4093, 198, 57, 5248, 3946, 288, 7198, 253, 725, 1406, 28, 253, 5069, 17732, 351, 5646, 29, 14519],
]


def test_cached_tokens_are_pinned(smollm2, story_ids):
    model, _ = smollm2
    assert [generate_cached(model, ids, 64) for ids in story_ids] == PINNED_64


def test_naive_gives_the_same_tokens(smollm2, story_ids):
    model, _ = smollm2
    assert [generate_naive(model, ids, 64) for ids in story_ids] == PINNED_64


def test_transformers_gives_the_same_tokens(smollm2_reference, story_ids):
    assert [hf_greedy(smollm2_reference, ids, 64) for ids in story_ids] == PINNED_64


def test_a_batch_of_different_lengths(smollm2, story_ids):
    model, _ = smollm2
    assert [len(ids) for ids in story_ids] == [4, 6, 2]
    assert generate_cached_batch(model, story_ids, 64) == PINNED_64
    # the order of the batch does not matter
    assert generate_cached_batch(model, story_ids[::-1], 16) == [p[:16] for p in PINNED_64[::-1]]


def test_zero_new_tokens_and_step_times(smollm2, story_ids):
    model, _ = smollm2
    assert generate_cached(model, story_ids[0], 0) == [] == generate_naive(model, story_ids[0], 0)
    naive_times, cached_times = [], []
    assert generate_naive(model, story_ids[2], 3, step_times=naive_times) == PINNED_64[2][:3]
    assert generate_cached(model, story_ids[2], 3, step_times=cached_times) == PINNED_64[2][:3]
    assert len(naive_times) == len(cached_times) == 3 and all(t > 0 for t in naive_times + cached_times)


@pytest.mark.parametrize("generate", [generate_naive, generate_cached])
@pytest.mark.parametrize("ids, max_new, param", [([6004], -1, "max_new_tokens"), ([6004], 2.5, "max_new_tokens"),
                                                 ([6004], True, "max_new_tokens"), ([], 4, "token_ids"),
                                                 ([6004, 49152], 4, "token_ids"), ([-1], 4, "token_ids")])
def test_bad_input_is_a_typed_error(smollm2, generate, ids, max_new, param):
    model, _ = smollm2
    with pytest.raises(InvalidRequestError) as info:
        generate(model, ids, max_new)
    assert info.value.param == param


def test_empty_batch(smollm2):
    model, _ = smollm2
    with pytest.raises(InvalidRequestError):
        generate_cached_batch(model, [], 4)


def test_old_rows_are_recomputed_unchanged(smollm2, story_ids):
    """A naive step recomputes K, V and context rows that the previous step already had."""
    model, _ = smollm2
    sequence = story_ids[1] + PINNED_64[1][:6]
    shorter, longer = record_forward(model, sequence[:-1]), record_forward(model, sequence)
    assert sorted(longer) == list(range(model.config.num_layers))
    assert longer[0]["k"].shape == (len(sequence), model.config.num_kv_heads, model.config.head_dim)
    assert longer[0]["context"].shape == (len(sequence), model.config.num_heads, model.config.head_dim)
    for name in ("k", "v", "context"):
        same = compare_old_rows(shorter, longer, name)
        assert same["rows"] == len(sequence) - 1
        assert same["max_rel_diff"] < 1e-5       # equal up to the order floating-point sums are taken in
    assert compare_old_rows(longer, longer, "k")["bit_equal"]
    # the new row is new: the last key differs from every old one
    assert not torch.allclose(longer[5]["k"][-1], longer[5]["k"][-2])

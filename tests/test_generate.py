"""Greedy decoding without and with a KV cache (notebooks 03 and 04): same tokens as transformers, pinned."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lifeofprompt.errors import InvalidRequestError
from lifeofprompt.lessons.agreement import FP32_TOLERANCE, assert_greedy_agrees
from lifeofprompt.lessons.generate import (
    compare_old_rows,
    generate_cached,
    generate_cached_batch,
    generate_naive,
    record_forward,
)
from lifeofprompt.lessons.reference import hf_greedy
from lifeofprompt.story import STORY_PROMPTS

# SmolLM2-135M-Instruct (embedded, fp32, CPU), 64 greedy tokens after each story prompt, EOS ignored:
# transformers' tokens and the top-2 margin of every step (tests/data/make_engine_parity.py).
_PARITY = json.loads((Path(__file__).parent / "data" / "engine_parity_smollm2.json").read_text())
STORY = list(STORY_PROMPTS)
PINNED_64 = [_PARITY["tokens"][p] for p in STORY]
MARGINS_64 = [_PARITY["margins"][p] for p in STORY]

pytestmark = pytest.mark.usefixtures("one_thread")


def assert_follows_the_pin(sequences, order=(0, 1, 2)):
    """Another computation than the pin's (and perhaps another CPU): equal up to the first near tie.

    None of the story's 192 pinned steps is that close (tests/test_pins.py), so today all must match.
    """
    pins, margins = [PINNED_64[i] for i in order], [MARGINS_64[i] for i in order]
    steps = sum(min(len(s), len(p)) for s, p in zip(sequences, pins))
    assert_greedy_agrees(sequences, pins, margins, FP32_TOLERANCE, min_steps=int(0.9 * steps))


@pytest.mark.slow
@pytest.mark.numerics
def test_cached_tokens_are_pinned(smollm2, story_ids):
    model, _ = smollm2
    assert_follows_the_pin([generate_cached(model, ids, 64) for ids in story_ids])


@pytest.mark.slow
@pytest.mark.numerics
def test_naive_gives_the_same_tokens(smollm2, story_ids):
    model, _ = smollm2
    assert_follows_the_pin([generate_naive(model, ids, 64) for ids in story_ids])


@pytest.mark.slow
@pytest.mark.numerics
def test_transformers_gives_the_same_tokens(smollm2_reference, story_ids):
    assert_follows_the_pin([hf_greedy(smollm2_reference, ids, 64) for ids in story_ids])


@pytest.mark.slow
@pytest.mark.numerics
def test_a_batch_of_different_lengths(smollm2, story_ids):
    model, _ = smollm2
    assert [len(ids) for ids in story_ids] == [4, 6, 2]
    assert_follows_the_pin(generate_cached_batch(model, story_ids, 64))
    # the order of the batch does not matter
    assert_follows_the_pin(generate_cached_batch(model, story_ids[::-1], 16), order=(2, 1, 0))


@pytest.mark.numerics
def test_zero_new_tokens_and_step_times(smollm2, story_ids):
    model, _ = smollm2
    assert generate_cached(model, story_ids[0], 0) == [] == generate_naive(model, story_ids[0], 0)
    naive_times, cached_times = [], []
    assert generate_naive(model, story_ids[2], 3, step_times=naive_times) == PINNED_64[2][:3]
    assert generate_cached(model, story_ids[2], 3, step_times=cached_times) == PINNED_64[2][:3]
    assert len(naive_times) == len(cached_times) == 3 and all(t > 0 for t in naive_times + cached_times)


@pytest.mark.parametrize("generate", [generate_naive, generate_cached])
@pytest.mark.parametrize(
    "ids, max_new, param",
    [
        ([6004], -1, "max_new_tokens"),
        ([6004], 2.5, "max_new_tokens"),
        ([6004], True, "max_new_tokens"),
        ([], 4, "token_ids"),
        ([6004, 49152], 4, "token_ids"),
        ([-1], 4, "token_ids"),
    ],
)
def test_bad_input_is_a_typed_error(smollm2, generate, ids, max_new, param):
    model, _ = smollm2
    with pytest.raises(InvalidRequestError) as info:
        generate(model, ids, max_new)
    assert info.value.param == param


def test_empty_batch(smollm2):
    model, _ = smollm2
    with pytest.raises(InvalidRequestError):
        generate_cached_batch(model, [], 4)


@pytest.mark.numerics
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
        assert same["max_rel_diff"] < 1e-5  # equal up to the order floating-point sums are taken in
    assert compare_old_rows(longer, longer, "k")["bit_equal"]
    # the new row is new: the last key differs from every old one
    assert not torch.allclose(longer[5]["k"][-1], longer[5]["k"][-2])

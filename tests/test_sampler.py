"""The sampler on crafted logits: exact masks, greedy, seeds, logprobs, and SamplingParams validation."""

from __future__ import annotations

import math

import pytest
import torch

from lifeofprompt.engine.sampler import Sampler, apply_filters, make_generator
from lifeofprompt.engine.sampling_params import SamplingParams
from lifeofprompt.errors import InvalidRequestError

# probabilities 0.4, 0.3, 0.15, 0.1, 0.05 (as logits: their logs), in a shuffled order
PROBS = torch.tensor([0.1, 0.4, 0.05, 0.3, 0.15])
LOGITS = PROBS.log()[None, :]


def kept(logits):
    return sorted(torch.isfinite(logits[0]).nonzero().flatten().tolist())


def test_top_k_keeps_exactly_the_k_most_likely():
    assert kept(apply_filters(LOGITS, torch.tensor([2]), None, None)) == [1, 3]
    assert kept(apply_filters(LOGITS, torch.tensor([-1]), None, None)) == [0, 1, 2, 3, 4]


def test_top_p_keeps_the_smallest_set_reaching_p():
    # 0.4 < 0.5 → need 0.3 too (0.7 ≥ 0.5); 0.7 reaches 0.7 exactly → stop; 0.71 needs 0.15 too
    assert kept(apply_filters(LOGITS, None, torch.tensor([0.5]), None)) == [1, 3]
    assert kept(apply_filters(LOGITS, None, torch.tensor([0.71]), None)) == [1, 3, 4]
    assert kept(apply_filters(LOGITS, None, torch.tensor([0.01]), None)) == [1]
    assert kept(apply_filters(LOGITS, None, torch.tensor([1.0]), None)) == [0, 1, 2, 3, 4]


def test_min_p_drops_tokens_below_a_fraction_of_the_top():
    # threshold 0.5 × 0.4 = 0.2 keeps 0.4 and 0.3; 0.25 × 0.4 = 0.1 keeps 0.1 too
    assert kept(apply_filters(LOGITS, None, None, torch.tensor([0.5]))) == [1, 3]
    assert kept(apply_filters(LOGITS, None, None, torch.tensor([0.25]))) == [0, 1, 3, 4]


def test_filters_are_per_row_and_kept_values_unchanged():
    logits = LOGITS.repeat(3, 1)
    out = apply_filters(logits, torch.tensor([1, 3, -1]), torch.tensor([1.0, 1.0, 0.5]), None)
    assert [sorted(torch.isfinite(r).nonzero().flatten().tolist()) for r in out] == [[1], [1, 3, 4], [1, 3]]
    assert torch.equal(out[torch.isfinite(out)], logits[torch.isfinite(out)])


def test_greedy_is_the_argmax_and_mixes_with_sampling():
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0]])
    out = Sampler()(logits, [SamplingParams(temperature=0), SamplingParams(temperature=0)])
    assert out.token_ids.tolist() == [1, 0]
    # a sampled row restricted to one token by top_k must pick it, beside a greedy row
    out = Sampler()(logits, [SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_k=1)])
    assert out.token_ids.tolist() == [1, 0]


def test_seeded_draws_repeat_and_ignore_the_batch():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    params = [
        SamplingParams(temperature=1.0, seed=11),
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.0, seed=5),
    ]

    def draws(rows, ps, n=8):
        gens = [make_generator(p.seed, "cpu") for p in ps]
        return [Sampler()(rows, ps, gens).token_ids.tolist() for _ in range(n)]

    a, b = draws(logits, params), draws(logits, params)
    assert [r[0] for r in a] == [r[0] for r in b] and [r[2] for r in a] == [r[2] for r in b]
    alone = draws(logits[:1], params[:1])  # the seeded request alone: same draws
    assert [r[0] for r in alone] == [r[0] for r in a]
    assert len({r[0] for r in a}) > 1  # and it is really sampling


def test_sampling_follows_the_distribution():
    logits = LOGITS.repeat(4000, 1)
    params = [SamplingParams(temperature=1.0)] * 4000
    torch.manual_seed(0)
    counts = torch.bincount(Sampler()(logits, params).token_ids, minlength=5).float() / 4000
    assert torch.allclose(counts, PROBS, atol=0.03)
    counts = torch.bincount(Sampler()(logits, [SamplingParams(temperature=1.0, top_k=2)] * 4000).token_ids, minlength=5)
    assert counts[[0, 2, 4]].sum() == 0 and abs(counts[1] / 4000 - 0.4 / 0.7) < 0.03


def test_logprobs_are_raw_log_softmax_of_chosen_and_top_n():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    out = Sampler()(logits, [SamplingParams(temperature=0, logprobs=2)])
    expected = torch.log_softmax(logits, -1)[0]
    assert out.token_ids.tolist() == [1]
    assert math.isclose(out.logprobs.item(), expected[1].item(), rel_tol=1e-6)
    assert out.top_ids.tolist() == [[1, 2]]
    assert torch.allclose(out.top_logprobs[0], expected[[1, 2]])
    assert Sampler()(logits, [SamplingParams(temperature=0)]).logprobs is None


@pytest.mark.parametrize(
    "kwargs,param",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(max_tokens=-1), "max_tokens"),
        (dict(prompt_logprobs=21), "prompt_logprobs"),
        (dict(top_k=0), "top_k"),
        (dict(min_p=1.5), "min_p"),
        (dict(n=0), "n"),
        (dict(logprobs=-1), "logprobs"),
        (dict(seed="x"), "seed"),
        (dict(stop=[""]), "stop"),
    ],
)
def test_bad_sampling_params_raise_typed_errors(kwargs, param):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param


def test_vllm_defaults():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens, p.ignore_eos, p.logprobs, p.seed) == (
        1,
        1.0,
        1.0,
        -1,
        0.0,
        16,
        False,
        None,
        None,
    )
    assert SamplingParams(stop="x").stop == ["x"]

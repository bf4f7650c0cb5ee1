"""Speculative sampling keeps the model's distribution: a chi-square test on a tiny random model.

With a vocabulary of 16 the exact distribution of the first three output tokens is computable
(16 × 16 contexts), so thousands of seeded samples drawn through the engine with the n-gram drafter
(whose q is one-hot) are compared, per position and per pair of positions, with it. The correct rule
must pass (p >= 1e-3); a deliberately broken one (accept every draft the model does not rule out)
must fail the same test by far (p < 1e-6), which shows the test can see a wrong rule.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch

from lifeofprompt.engine import rejection_sampler
from lifeofprompt.engine.llm_engine import LLMEngine
from lifeofprompt.engine.sampling_params import SamplingParams
from lifeofprompt.lessons.speculation import first_layers
from lifeofprompt.model.config import TINYLLAMA_1_1B
from lifeofprompt.model.llama import LlamaForCausalLM
from lifeofprompt.model.loader import ByteTokenizer

VOCAB = 16
NUM_SAMPLES = 3000  # for the right rule: a subtle error must show
# A broken rule is far off: at 600 samples its p-values were already below 1e-14 (the residual drawn from p) and 0
# (every draft accepted); 1,000 keep a margin of many orders of magnitude over the test's 1e-6 at a third of the time.
BROKEN_SAMPLES = 1000
PROMPT = list(range(VOCAB)) + [0, 1, 2, 3]  # every token occurs in it: prompt lookup always finds a draft
TINY = replace(
    TINYLLAMA_1_1B,
    name="tiny16",
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    head_dim=16,
    max_position_embeddings=64,
)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
PARAMS = {
    "plain": dict(temperature=1.0),
    "filtered": dict(temperature=0.8, top_k=8, top_p=0.9, min_p=0.05),
}

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(1)
    model = LlamaForCausalLM(TINY).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(6.0)  # peaked distributions: p(draft) spans (0, 1), not all ~1/16
    return model, ByteTokenizer(VOCAB)


def exact_joint(model, params: SamplingParams) -> torch.Tensor:
    """P(t1, t2, t3) ``[V, V, V]`` after ``PROMPT``, with the sampler's temperature and filters."""

    def next_probs(contexts):
        with torch.no_grad():
            logits = model(torch.tensor(contexts))[:, -1]
        return rejection_sampler.filtered_probs(logits, params).double()

    p1 = next_probs([PROMPT])[0]
    p2 = next_probs([PROMPT + [a] for a in range(VOCAB)])
    p3 = next_probs([PROMPT + [a, b] for a, b in itertools.product(range(VOCAB), repeat=2)]).view(VOCAB, VOCAB, VOCAB)
    return p1[:, None, None] * p2[:, :, None] * p3


class GreedyOracle:
    """A one-hot drafter that proposes the model's own greedy continuation: the rule then accepts often
    (p of the argmax is high here), where prompt lookup's guesses are mostly rejected."""

    def __init__(self, model, k: int = 3):
        self.model, self.k, self.memo = model, k, {}

    def propose(self, token_ids, max_draft=None):
        key = tuple(token_ids)
        if key not in self.memo:
            context, draft = list(token_ids), []
            with torch.no_grad():
                for _ in range(self.k):
                    draft.append(int(self.model(torch.tensor([context]))[0, -1].argmax()))
                    context.append(draft[-1])
            self.memo[key] = draft
        return self.memo[key][:max_draft]


def sample_first_three(model, tokenizer, params: dict, proposer=None, num: int = NUM_SAMPLES, spec=NGRAM):
    engine = LLMEngine(
        model,
        tokenizer=tokenizer,
        num_kv_blocks=num + 8,
        block_size=16,
        max_num_seqs=256,
        log_stats=False,
        speculative_config=spec,
    )
    if proposer is not None:
        engine.proposer = proposer
    for i in range(num):
        engine.add_request(str(i), PROMPT, SamplingParams(max_tokens=5, ignore_eos=True, seed=i, **params))
    outs = {o.request_id: o.outputs[0].token_ids for o in engine.run_until_done()}
    return torch.tensor([outs[str(i)][:3] for i in range(num)]), engine


def chi_square_p(counts: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson's test; cells expected below 5 are pooled into one. The p-value is Q(df / 2, stat / 2)."""
    counts, expected = counts.flatten().double(), expected.flatten().double()
    small = expected < 5
    counts = torch.cat([counts[~small], counts[small].sum()[None]])
    expected = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = expected > 0
    assert int(counts[~keep].sum()) == 0, "a sample the model gives probability 0"
    counts, expected = counts[keep], expected[keep]
    stat = ((counts - expected) ** 2 / expected).sum()
    df = len(counts) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def p_values(samples: torch.Tensor, joint: torch.Tensor) -> dict[str, float]:
    """Per-position marginals and every pair of positions against the exact distribution."""
    n = len(samples)
    result = {}
    for pos in range(3):
        marginal = joint.sum(dim=tuple(d for d in range(3) if d != pos))
        result[f"t{pos + 1}"] = chi_square_p(torch.bincount(samples[:, pos], minlength=VOCAB), n * marginal)
    for a, b in itertools.combinations(range(3), 2):
        pair = joint.sum(dim=3 - a - b)
        counts = torch.bincount(samples[:, a] * VOCAB + samples[:, b], minlength=VOCAB * VOCAB)
        result[f"t{a + 1}t{b + 1}"] = chi_square_p(counts, n * pair)
    return result


@pytest.mark.parametrize(
    "drafter, case",
    [
        ("ngram", "plain"),
        ("greedy oracle", "filtered"),
        pytest.param("draft model", "filtered", marks=pytest.mark.slow),
    ],
)
def test_speculation_keeps_the_distribution_of_the_first_three_tokens(tiny, drafter, case):
    """The draft model (the tiny model's first layer, norm and head) has a q of its own, not one-hot."""
    model, tokenizer = tiny
    spec = {"model": first_layers(model, 1), "num_speculative_tokens": 3} if drafter == "draft model" else NGRAM
    samples, engine = sample_first_three(
        model, tokenizer, PARAMS[case], GreedyOracle(model) if drafter == "greedy oracle" else None, spec=spec
    )
    spec = engine.spec_stats
    rejected = spec.num_draft_tokens - spec.num_accepted_tokens
    assert spec.num_accepted_tokens > 200 and rejected > 200, "the rule must both accept and reject to be tested"
    assert spec.num_drafts >= NUM_SAMPLES
    pvals = p_values(samples, exact_joint(model, SamplingParams(**PARAMS[case])))
    assert min(pvals.values()) >= 1e-3, pvals


@pytest.mark.parametrize("broken", ["accept whenever p(x) > 0", "on a rejection draw from p, not p - q"])
def test_a_broken_rule_fails_the_same_test(tiny, monkeypatch, broken):
    model, tokenizer = tiny
    if broken == "accept whenever p(x) > 0":
        monkeypatch.setattr(rejection_sampler, "accept_probability", lambda p_x, q_x: (p_x > 0).to(p_x.dtype))
        spec, case = NGRAM, "plain"
    else:  # subtler: right only where q is one-hot or the draft is accepted
        monkeypatch.setattr(rejection_sampler, "residual_distribution", lambda p, q, rejected: p)
        spec, case = {"model": first_layers(model, 1), "num_speculative_tokens": 3}, "filtered"
    samples, _ = sample_first_three(model, tokenizer, PARAMS[case], spec=spec, num=BROKEN_SAMPLES)
    pvals = p_values(samples, exact_joint(model, SamplingParams(**PARAMS[case])))
    assert pvals["t1"] >= 1e-3  # the first token comes from the prefill: no draft touches it
    assert min(pvals.values()) < 1e-6, pvals


def test_seeded_speculative_runs_repeat_themselves(tiny):
    model, tokenizer = tiny
    first, _ = sample_first_three(model, tokenizer, PARAMS["filtered"], num=64)
    again, _ = sample_first_three(model, tokenizer, PARAMS["filtered"], num=64)
    assert torch.equal(first, again)
    assert len({tuple(r) for r in first.tolist()}) > 8  # and the seeds do differ


def test_n_answers_speculate_apart(tiny):
    model, tokenizer = tiny
    engine = LLMEngine(
        model, tokenizer=tokenizer, num_kv_blocks=16, log_stats=False, check_invariants=True, speculative_config=NGRAM
    )
    engine.add_request("n", PROMPT, SamplingParams(n=3, max_tokens=8, seed=5, ignore_eos=True, **PARAMS["plain"]))
    out = engine.run_until_done()[0]
    answers = [c.token_ids for c in out.outputs]
    assert len(answers) == 3 and all(len(a) == 8 for a in answers) and len({tuple(a) for a in answers}) == 3
    assert out.metrics.spec_decode.num_drafts > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_verify_that_fails_ends_its_request_alone(tiny, monkeypatch):
    """Fault isolation: a request whose verify raises ends with finish_reason "error"; the others finish."""
    model, tokenizer = tiny
    verify = rejection_sampler.verify_sequence

    def failing(seq, logits, target_ids):
        if seq.sampling_params.seed == 13:
            raise RuntimeError("a broken verify")
        return verify(seq, logits, target_ids)

    monkeypatch.setattr(rejection_sampler, "verify_sequence", failing)
    engine = LLMEngine(
        model, tokenizer=tokenizer, num_kv_blocks=16, log_stats=False, check_invariants=True, speculative_config=NGRAM
    )
    for seed in (12, 13, 14):
        engine.add_request(str(seed), PROMPT, SamplingParams(max_tokens=6, seed=seed, ignore_eos=True))
    outs = {o.request_id: o for o in engine.run_until_done()}
    assert outs["13"].outputs[0].finish_reason == "error" and outs["13"].error is not None
    assert all(
        outs[r].outputs[0].finish_reason == "length" and len(outs[r].outputs[0].token_ids) == 6 for r in ("12", "14")
    )
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks

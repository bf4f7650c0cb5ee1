"""Prompt log-probabilities on the real embedded model (CPU, fp32): the engine's scores of each prompt token
equal a plain forward's log-softmax over the prompt, whether the prompt runs in one step, in chunks, after
a cached prefix, or across a preemption; ``max_tokens=0`` scores a prompt and generates nothing."""

from __future__ import annotations

import pytest
import torch

from lifeofprompt.engine import prompt_logprobs as prompt_scoring
from lifeofprompt.engine.llm_engine import LLMEngine
from lifeofprompt.engine.sampling_params import SamplingParams
from lifeofprompt.errors import InvalidRequestError

ATOL = 1e-3  # fp32: the engine's paged, chunked forward sums in another order than the plain one
TEXT = (
    "The old lighthouse keeper climbed the stairs every evening, counting the steps out loud, "
    "and at the top he lit the lamp that guided the fishing boats home."
)

pytestmark = pytest.mark.usefixtures("one_thread")


def make_engine(smollm2, **kwargs):
    model, tokenizer = smollm2
    kwargs.setdefault("num_kv_blocks", 64)
    return LLMEngine(model, tokenizer=tokenizer, log_stats=False, check_invariants=True, **kwargs)


def run(engine, requests):
    for rid, ids, params in requests:
        engine.add_request(rid, ids, params)
    return {o.request_id: o for o in engine.run_until_done()}


def scored(k, max_tokens=2):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, prompt_logprobs=k)


@pytest.fixture(scope="module")
def prompt(smollm2):
    return smollm2[1].encode(TEXT)


def reference(model, ids) -> torch.Tensor:
    """A plain forward over the whole prompt: row p's log-softmax scores token p + 1."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).float()[0], dim=-1)


def assert_matches(prompt_logprobs, model, ids, k):
    """Each entry holds the prompt token with its reference value, and the reference's top k (where no near tie
    decides which tokens they are)."""
    ref = reference(model, ids)
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == len(ids)
    for p, entry in enumerate(prompt_logprobs[1:]):
        token = ids[p + 1]
        assert entry[token] == pytest.approx(ref[p, token].item(), abs=ATOL), f"prompt token {p + 1}"
        values, top = ref[p].topk(k + 1)
        others = {t: v for t, v in entry.items() if t != token or token in top[:k].tolist()}
        assert len(others) == k
        if k and values[k - 1] - values[k] > ATOL:  # the k-th and the next are apart: the set is decided
            assert set(others) == set(top[:k].tolist()), f"top {k} of prompt token {p + 1}"
        for t, v in others.items():
            assert v == pytest.approx(ref[p, t].item(), abs=ATOL)


@pytest.mark.numerics
def test_prompt_logprobs_equal_a_plain_forward(smollm2, prompt):
    out = run(make_engine(smollm2), [("a", prompt, scored(5))])["a"]
    assert_matches(out.prompt_logprobs, smollm2[0], prompt, 5)
    assert len(out.outputs[0].token_ids) == 2


@pytest.mark.numerics
def test_chunked_prefill_scores_every_chunk_boundary(smollm2, prompt):
    """A budget of 8 tokens a step: the prompt runs in chunks, and each chunk's last row scores the next
    chunk's first token."""
    engine = make_engine(smollm2, max_num_batched_tokens=8, block_size=4)
    out = run(engine, [("a", prompt, scored(3))])["a"]
    assert sum(1 for rec in engine.step_records for r in rec.scheduled if r.kind == "prefill chunk") >= 3
    assert_matches(out.prompt_logprobs, smollm2[0], prompt, 3)


@pytest.mark.numerics
def test_a_cached_prefix_is_not_used_but_its_blocks_are_cached_for_others(smollm2, prompt):
    """A request that asks computes every prompt row even when its prefix is cached (vLLM V1's choice), and the
    blocks it fills are then found by the next request with the same prompt."""
    engine = make_engine(smollm2, block_size=4)
    half = prompt[: len(prompt) // 2]
    run(engine, [("first", half, scored(None))])
    asks = run(engine, [("asks", prompt, scored(2))])["asks"]
    assert asks.num_cached_tokens == 0
    assert_matches(asks.prompt_logprobs, smollm2[0], prompt, 2)
    later = run(engine, [("later", prompt, scored(None))])["later"]
    assert later.num_cached_tokens > len(half), "the asking request's own blocks were meant to be cached"
    assert later.prompt_logprobs is None


@pytest.mark.numerics
def test_preemption_keeps_the_rows_already_scored(smollm2, prompt, monkeypatch):
    """A pool of 12 blocks of 4 tokens, 4 tokens a step: the three requests' prompts are chunked and the newest
    is preempted and recomputed; every prompt token is scored exactly once, and correctly."""
    rows = []
    real = prompt_scoring.score_prompt_rows

    def counting(lm_head, hidden, plan, *args):
        rows.extend((seq_id, n) for seq_id, n in plan.owners)
        return real(lm_head, hidden, plan, *args)

    monkeypatch.setattr("lifeofprompt.engine.model_runner.score_prompt_rows", counting)
    prompts = [prompt[:20], prompt[5:22], prompt[10:30]]
    engine = make_engine(smollm2, num_kv_blocks=12, block_size=4, max_num_batched_tokens=4)
    outs = run(engine, [(f"r{i}", ids, scored(1, max_tokens=10)) for i, ids in enumerate(prompts)])
    assert engine.scheduler.num_preemptions >= 1, "the pool was meant to force a preemption"
    preempted = [i for i in range(3) if outs[f"r{i}"].metrics.num_preemptions]
    assert preempted, "a request that asks was meant to be preempted"
    assert sum(n for _, n in rows) == sum(len(ids) - 1 for ids in prompts), "a prompt row was scored twice"
    for i, ids in enumerate(prompts):
        assert_matches(outs[f"r{i}"].prompt_logprobs, smollm2[0], ids, 1)
    assert engine.block_manager.num_used_blocks == 0


@pytest.mark.numerics
def test_max_tokens_zero_scores_the_prompt_and_generates_nothing(smollm2, prompt):
    engine = make_engine(smollm2)
    engine.add_request("other", prompt[:7], scored(None, max_tokens=3))
    outs = run(
        engine, [("ll", prompt, scored(0, max_tokens=0)), ("two", prompt[:9], SamplingParams(max_tokens=0, n=2))]
    )
    ll = outs["ll"]
    assert ll.finished and ll.outputs[0].token_ids == [] and ll.outputs[0].text == ""
    assert ll.outputs[0].finish_reason == "length"
    assert all(len(entry) == 1 for entry in ll.prompt_logprobs[1:]), "k = 0: the prompt token alone"
    assert_matches(ll.prompt_logprobs, smollm2[0], prompt, 0)
    assert [c.token_ids for c in outs["two"].outputs] == [[], []] and outs["two"].prompt_logprobs is None
    assert len(outs["other"].outputs[0].token_ids) == 3
    assert engine.block_manager.num_used_blocks == 0


def test_scoring_in_slices_equals_scoring_at_once(smollm2, prompt):
    """The lm_head and log-softmax run a few rows at a time; the slices must give what one pass gives."""
    model = smollm2[0]
    hidden = torch.randn(len(prompt), model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    plan = prompt_scoring.PromptRows(
        rows=list(range(len(prompt) - 1)),
        targets=prompt[1:],
        top_k=[4] * (len(prompt) - 1),
        owners=[(7, len(prompt) - 1)],
    )
    at_once = prompt_scoring.score_prompt_rows(model.lm_head, hidden, plan, slice_rows=len(prompt))[7]
    sliced = prompt_scoring.score_prompt_rows(model.lm_head, hidden, plan, slice_rows=3)[7]
    assert len(sliced) == len(prompt) - 1
    # Other row counts sum the same products in another order: equal to fp32 rounding (a few 1e-6 on logprobs of
    # size 10 over a 49,152-token softmax), and a token may swap in at the top-k edge only through such a tie.
    close = 1e-4
    for a, b in zip(at_once, sliced):
        assert all(a[t] == pytest.approx(b[t], abs=close) for t in a.keys() & b.keys())
        for only, other in ((a.keys() - b.keys(), b), (b.keys() - a.keys(), a)):
            assert all(abs({**a, **b}[t] - min(other.values())) <= close for t in only), (a, b)


@pytest.mark.parametrize("value", [21, -1, 1.5, True, "3"])
def test_bad_prompt_logprobs_raise_typed_errors(value):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(prompt_logprobs=value)
    assert info.value.param == "prompt_logprobs"


def test_max_tokens_below_zero_is_refused():
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(max_tokens=-1)
    assert info.value.param == "max_tokens"
    assert SamplingParams(max_tokens=0).max_tokens == 0

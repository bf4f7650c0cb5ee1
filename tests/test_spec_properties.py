"""Speculative decoding's bookkeeping under random drafts (hypothesis), on a tiny random-weight model.

A scripted drafter proposes, call after call, drafts whose first few tokens are the model's own
greedy continuation and the rest wrong, so every accept/reject pattern happens. With small pools
(preemption), short budgets, stop tokens inside accepted runs and aborts between steps, the block
manager's invariants hold after every step (the engine checks them), no block leaks, no cached
block ever holds a token that was not verified, and the greedy tokens are those of plain decoding.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from cache_checks import check_cached_blocks_were_verified
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis_counts import examples

from lifeofprompt.engine.llm_engine import LLMEngine
from lifeofprompt.engine.sampling_params import SamplingParams
from lifeofprompt.lessons.agreement import FP32_TOLERANCE, assert_greedy_agrees, teacher_forced_logits, top2_margins
from lifeofprompt.model.config import TINYLLAMA_1_1B
from lifeofprompt.model.llama import LlamaForCausalLM
from lifeofprompt.model.loader import ByteTokenizer

VOCAB = 32
K = 4
MAX_TOKENS = 12
TINY = replace(
    TINYLLAMA_1_1B,
    name="tiny",
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    head_dim=16,
    max_position_embeddings=128,
)
NGRAM = {"method": "ngram", "num_speculative_tokens": K}

pytestmark = pytest.mark.usefixtures("one_thread")


def build_tiny():
    """The 2-layer random model over a 32-token byte vocabulary, seeded: the same weights on every build."""
    torch.manual_seed(0)
    return LlamaForCausalLM(TINY).eval(), ByteTokenizer(VOCAB)


@pytest.fixture(scope="module")
def tiny():
    return build_tiny()


_references: dict[tuple, list[int]] = {}


def reference(model, tokenizer, prompt: tuple) -> list[int]:
    """The greedy continuation without speculation (memoised: the model never changes)."""
    if prompt not in _references:
        engine = LLMEngine(model, tokenizer=tokenizer, num_kv_blocks=32, log_stats=False)
        engine.add_request(
            "r", list(prompt), SamplingParams(temperature=0, max_tokens=MAX_TOKENS + K + 1, ignore_eos=True)
        )
        _references[prompt] = engine.run_until_done()[0].outputs[0].token_ids
    return _references[prompt]


def tight_engine(tiny, requests, extra_blocks: int, block_size: int, budget: int, caching: bool, **settings):
    """An engine whose pool just holds the largest request plus ``extra_blocks`` (the others get preempted),
    checking the block manager's invariants after every step."""
    model, tokenizer = tiny
    num_blocks = max(-(-(len(p) + n) // block_size) for p, n, *_ in requests) + extra_blocks
    return LLMEngine(
        model,
        tokenizer=tokenizer,
        num_kv_blocks=num_blocks,
        block_size=block_size,
        max_num_batched_tokens=budget,
        enable_prefix_caching=caching,
        log_stats=False,
        check_invariants=True,
        **settings,
    )


def record_computed(engine) -> list[list[int]]:
    """The tokens of every sequence each step updated (what the steps computed, for the cache check)."""
    computed: list[list[int]] = []
    update = engine.scheduler.update_from_output

    def recording_update(batch, sampled):
        changes = update(batch, sampled)
        computed.extend(list(s.token_ids) for s in batch.seqs)
        return changes

    engine.scheduler.update_from_output = recording_update
    return computed


def stop_tokens(ref: list[int], stop_at: int | None, max_tokens: int) -> list[int]:
    """The stop token a request is given: its greedy token at ``stop_at``, if it comes before ``max_tokens``."""
    return [ref[stop_at]] if stop_at is not None and stop_at < max_tokens else []


def assert_greedy_answers(model, refs, requests, outs, stops) -> None:
    """Each answer is the greedy continuation (the margin rule) cut by its stop token, its length or an abort,
    with one time per emitted token."""
    got, want, margins = [], [], []
    for i, (prompt, max_tokens, *_) in enumerate(requests):
        out = outs[str(i)].outputs[0]
        tokens, stop = out.token_ids, stops[str(i)]
        assert len(outs[str(i)].metrics.token_times) == len(tokens)  # one time per emitted token, no more
        assert len(tokens) <= max_tokens
        if out.finish_reason == "abort":
            assert not set(stop) & set(tokens)
            continue
        if out.finish_reason == "stop":
            assert tokens[-1] == stop[0] and stop[0] not in tokens[:-1]
        else:
            # (length is checked first: a stop token that is also the last allowed one ends it as "length")
            assert out.finish_reason == "length" and len(tokens) == max_tokens and not set(stop) & set(tokens[:-1])
        ref = refs[prompt][: len(tokens)]
        got.append(tokens)
        want.append(ref)
        margins.append(top2_margins(teacher_forced_logits(model, list(prompt), ref)).tolist())
    assert_greedy_agrees(got, want, margins, FP32_TOLERANCE, min_steps=0)


class ScriptedProposer:
    """Each call takes the next ``(num_draft, num_right)`` of a script: the first ``num_right`` drafts are
    the model's greedy next tokens, the others deliberately wrong."""

    def __init__(self, references: dict[tuple, list[int]], script: list[tuple[int, int]]):
        self.references, self.script, self.calls = references, script, 0

    def propose(self, token_ids, max_draft=None):
        num_draft, num_right = self.script[self.calls % len(self.script)]
        self.calls += 1
        num_draft = min(num_draft, max_draft or 0)
        prompt = max((p for p in self.references if tuple(token_ids[: len(p)]) == p), key=len, default=None)
        if prompt is None:
            return []
        done = len(token_ids) - len(prompt)
        right = self.references[prompt][done : done + num_draft]
        return [t if i < num_right else (t + 1 + i) % VOCAB for i, t in enumerate(right)]


prompts = st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=10).map(tuple)
requests = st.lists(
    st.tuples(
        prompts, st.integers(3, MAX_TOKENS), st.sampled_from([None, 1, 3, 6]), st.sampled_from([None, None, None, 3, 6])
    ),
    min_size=2,
    max_size=4,
)
scripts = st.lists(
    st.integers(0, K).flatmap(lambda d: st.tuples(st.just(d), st.integers(0, d))), min_size=2, max_size=8
)


@settings(
    max_examples=examples(50),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    requests=requests,
    script=scripts,
    extra_blocks=st.integers(0, 4),
    block_size=st.sampled_from([2, 4]),
    budget=st.sampled_from([4, 8, 64]),
    caching=st.booleans(),
)
def test_random_accept_reject_stops_aborts_and_preemption_keep_the_books(
    tiny, requests, script, extra_blocks, block_size, budget, caching
):
    model, tokenizer = tiny
    refs = {p: reference(model, tokenizer, p) for p, *_ in requests}
    engine = tight_engine(tiny, requests, extra_blocks, block_size, budget, caching, speculative_config=NGRAM)
    engine.proposer = ScriptedProposer(refs, script)
    verified = record_computed(engine)
    stops, aborts = {}, {}
    for i, (prompt, max_tokens, stop_at, abort_at) in enumerate(requests):
        stop = stops[str(i)] = stop_tokens(refs[prompt], stop_at, max_tokens)
        if abort_at is not None:
            aborts[str(i)] = abort_at
        engine.add_request(
            str(i),
            list(prompt),
            SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, stop_token_ids=stop),
        )
    outs, step = {}, 0
    while engine.has_unfinished_requests():
        for rid, at in aborts.items():
            if at == step:
                engine.abort(rid)  # between steps: its drafts are pending
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
        for seq in engine.scheduler.running:  # rolled back: no block kept for rejected drafts only
            assert len(seq.block_table) == -(-seq.num_computed_tokens // block_size), seq
        step += 1
        assert step < 400, "the engine stopped making progress"
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks), "a block leaked"
    bm.check_invariants([])
    check_cached_blocks_were_verified(bm, verified + [list(p) + refs[p] for p, *_ in requests])

    assert_greedy_answers(model, refs, requests, outs, stops)
    spec = engine.spec_stats
    assert spec.num_accepted_tokens <= spec.num_draft_tokens
    assert sum(spec.num_accepted_tokens_per_pos) == spec.num_accepted_tokens


@settings(
    max_examples=examples(25),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    requests=requests,
    extra_blocks=st.integers(0, 4),
    block_size=st.sampled_from([2, 4]),
    budget=st.sampled_from([4, 8, 64]),
    caching=st.booleans(),
    k=st.integers(1, 4),
)
def test_the_model_as_its_own_draft_through_preemption_aborts_and_cache_hits(
    tiny, requests, extra_blocks, block_size, budget, caching, k
):
    """The draft's K/V live in its own pool under the target's block tables. If any slot were wrong after a
    rollback, a preemption or a prefix-cache hit, the model as its own draft would start to disagree with
    itself: nearly every draft must be accepted."""
    model, tokenizer = tiny
    refs = {p: reference(model, tokenizer, p) for p, *_ in requests}
    draft = {"model": model, "num_speculative_tokens": k}
    engine = tight_engine(tiny, requests, extra_blocks, block_size, budget, caching, speculative_config=draft)
    for i, (prompt, max_tokens, _, _) in enumerate(requests):
        engine.add_request(str(i), list(prompt), SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    outs, step = {}, 0
    while engine.has_unfinished_requests():
        for i, (_, _, _, abort_at) in enumerate(requests):
            if abort_at == step:
                engine.abort(str(i))
        outs |= {o.request_id: o for o in engine.step() if o.finished}
        step += 1
        assert step < 400
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    spec = engine.spec_stats
    assert spec.num_draft_tokens == 0 or spec.acceptance_rate >= 0.95, spec
    assert_greedy_answers(model, refs, requests, outs, {str(i): [] for i in range(len(requests))})

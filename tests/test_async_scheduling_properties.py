"""Async scheduling's bookkeeping under random stops, aborts and tight pools (hypothesis), on a tiny
random-weight model.

With the next step scheduled while this one runs, a request that stops or is aborted is already in
the step after. Whatever the pool, budget, block size, stop tokens and abort times: no token after a
stop is emitted, every answer is the greedy continuation cut where it should be, each emitted token
has its time (usage counts what was emitted), no block leaks, no cached block holds a token nobody
computed, and no placeholder ever leaves the engine. The engine checks the block manager's
invariants after every step.
"""

from __future__ import annotations

import pytest
from cache_checks import check_cached_blocks_were_verified
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis_counts import examples
from test_spec_properties import (
    assert_greedy_answers,
    build_tiny,
    prompts,
    record_computed,
    reference,
    stop_tokens,
    tight_engine,
)

from lifeofprompt.engine.sampling_params import SamplingParams
from lifeofprompt.engine.sequence import PLACEHOLDER

MAX_TOKENS = 12

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny():
    return build_tiny()


requests = st.lists(
    st.tuples(
        prompts,
        st.integers(1, MAX_TOKENS),
        st.sampled_from([None, 0, 1, 3, 6]),
        st.sampled_from([None, None, 1, 3, 6]),
        st.sampled_from([False, False, False, True]),  # scores its prompt: its steps run one at a time
    ),
    min_size=2,
    max_size=4,
)


@settings(
    max_examples=examples(60),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    requests=requests,
    extra_blocks=st.integers(0, 4),
    block_size=st.sampled_from([2, 4]),
    budget=st.sampled_from([4, 8, 64]),
    caching=st.booleans(),
)
def test_random_stops_aborts_and_preemption_keep_the_books(tiny, requests, extra_blocks, block_size, budget, caching):
    model, tokenizer = tiny
    refs = {p: reference(model, tokenizer, p) for p, *_ in requests}
    engine = tight_engine(tiny, requests, extra_blocks, block_size, budget, caching, async_scheduling=True)
    computed = record_computed(engine)
    stops, aborts = {}, {}
    for i, (prompt, max_tokens, stop_at, abort_at, scores) in enumerate(requests):
        stops[str(i)] = stop_tokens(refs[prompt], stop_at, max_tokens)
        if abort_at is not None:
            aborts[str(i)] = abort_at
        params = SamplingParams(
            temperature=0,
            max_tokens=max_tokens,
            ignore_eos=True,
            stop_token_ids=stops[str(i)],
            prompt_logprobs=0 if scores else None,
        )
        engine.add_request(str(i), list(prompt), params)
    outs, streamed, step = {}, {}, 0
    while engine.has_unfinished_requests():
        for rid, at in aborts.items():
            if at == step:
                engine.abort(rid)  # between steps: its next step is already running
        for out in engine.step():
            tokens = list(out.outputs[0].token_ids)
            assert PLACEHOLDER not in tokens, f"a placeholder left the engine: {out}"
            assert tokens[: len(streamed.get(out.request_id, []))] == streamed.get(out.request_id, [])
            streamed[out.request_id] = tokens
            if out.finished:
                assert out.request_id not in outs, "a request finished twice"
                outs[out.request_id] = out
        step += 1
        assert step < 400, "the engine stopped making progress"
    assert engine.overlap.in_flight is None
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks), "a block leaked"
    bm.check_invariants([])
    assert all(PLACEHOLDER not in tokens for tokens in computed), [t for t in computed if PLACEHOLDER in t]
    check_cached_blocks_were_verified(bm, computed + [list(p) + refs[p] for p, *_ in requests])

    for i, (prompt, _, _, _, scores) in enumerate(requests):
        if scores and outs[str(i)].outputs[0].finish_reason != "abort":
            assert len(outs[str(i)].prompt_logprobs) == len(prompt)  # every prompt token scored once
    assert_greedy_answers(model, refs, requests, outs, stops)

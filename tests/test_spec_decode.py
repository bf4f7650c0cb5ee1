"""Speculative decoding on the real embedded model (CPU, fp32): the same greedy tokens as without it
(alone, batched, preempted), one target forward per verify step, the budget's share, stops inside an
accepted run, streaming, the counters and the typed errors."""

from __future__ import annotations

import pytest
import torch

from lifeofprompt.engine.llm_engine import LLMEngine
from lifeofprompt.engine.model_runner import ModelRunner
from lifeofprompt.engine.sampling_params import SamplingParams
from lifeofprompt.engine.sequence import Sequence
from lifeofprompt.engine.speculative import NgramProposer, SpeculativeConfig
from lifeofprompt.errors import SpeculativeConfigError
from lifeofprompt.figures.schedule import format_steps
from lifeofprompt.lessons.agreement import FP32_TOLERANCE, assert_greedy_agrees, teacher_forced_logits, top2_margins
from lifeofprompt.lessons.speculation import first_layers

pytestmark = pytest.mark.usefixtures("one_thread")

K = 4
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
# A code-editing prompt: the answer repeats most of it, so prompt lookup has something to find.
CODE = (
    "def area(width, height):\n    return width * height\n\n"
    "def perimeter(width, height):\n    return 2 * (width + height)\n\n"
    "Rewrite both functions with type hints:\n"
)
DAY_GREEDY = [
    281,
    260,
    216,
    34,
    33,
    302,
    2070,
    30,
    2,
]  # "today is a beautiful summer day" -> " in the 21st century." EOS


def make_engine(smollm2, spec=None, **kwargs):
    model, tokenizer = smollm2
    kwargs.setdefault("num_kv_blocks", 64)
    return LLMEngine(
        model, tokenizer=tokenizer, log_stats=False, check_invariants=True, speculative_config=spec, **kwargs
    )


def greedy(n, **kwargs):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kwargs)


def run(engine, requests):
    for rid, ids, params in requests:
        engine.add_request(rid, ids, params)
    outs = {o.request_id: o for o in engine.run_until_done()}
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks, "a block leaked"
    return outs


class OracleProposer:
    """Drafts the known continuation of each prompt (so every draft is right), optionally wrong from ``wrong_at``."""

    def __init__(self, continuations: dict[tuple, list[int]], k: int = K, wrong_at: int | None = None):
        self.continuations, self.k, self.wrong_at = continuations, k, wrong_at

    def propose(self, token_ids, max_draft=None):
        for prompt, cont in self.continuations.items():
            if tuple(token_ids[: len(prompt)]) == prompt:
                done = len(token_ids) - len(prompt)
                draft = list(cont[done : done + min(self.k, max_draft or self.k)])
                if self.wrong_at is not None and self.wrong_at < len(draft):
                    draft[self.wrong_at] += 1
                return draft
        return []


@pytest.fixture(scope="module")
def prompts(smollm2):
    _, tokenizer = smollm2
    from lifeofprompt.story import STORY_PROMPTS

    return [tokenizer.encode(CODE)] + [tokenizer.encode(p) for p in STORY_PROMPTS]


@pytest.fixture(scope="module")
def reference(smollm2, prompts):
    """Greedy tokens without speculation, and the top-2 margins of the logits that chose them."""
    model, _ = smollm2
    outs = run(make_engine(smollm2), [(str(i), p, greedy(24)) for i, p in enumerate(prompts)])
    tokens = [outs[str(i)].outputs[0].token_ids for i in range(len(prompts))]
    margins = [top2_margins(teacher_forced_logits(model, p, t)).tolist() for p, t in zip(prompts, tokens)]
    return tokens, margins


@pytest.fixture(scope="module")
def verify_tolerance(smollm2, prompts, reference):
    """The largest change of a top-2 margin between a 1-row decode and a (k + 1)-row verify of the same
    positions (measured here, on this machine's kernels), times 4, and never below the fp32 tolerance."""
    model, _ = smollm2
    runner = ModelRunner.for_model(model, num_kv_blocks=16, attention_backend="torch", max_num_seqs=4)
    worst = 0.0
    for prompt, tokens in list(zip(prompts, reference[0]))[:2]:  # the code prompt and a story's
        seq = Sequence("m", prompt + tokens, greedy(1))
        seq.block_table = list(range(8))
        computed = 0  # positions already in the cache: each start's prefix extends the last one's
        for start in range(len(prompt), len(prompt) + len(tokens) - K - 1, 12):  # 2 starts, 5 rows each
            seq.num_computed_tokens = computed
            seq.prompt_token_ids, seq.spec_token_ids = (prompt + tokens)[:start], []
            runner.model(*runner.prepare([seq], [start - 1 - computed]))  # the prefix, up to the last token
            seq.num_computed_tokens = start - 1
            seq.spec_token_ids = (prompt + tokens)[start : start + K]
            verify = runner.model(*runner.prepare([seq], [K + 1]))  # [last, d1..dk]: k + 1 rows
            seq.spec_token_ids = []
            decodes = []
            for j in range(K + 1):
                seq.prompt_token_ids = (prompt + tokens)[: start + j]
                seq.num_computed_tokens = start + j - 1
                decodes.append(runner.model(*runner.prepare([seq], [1]))[0])
            computed = start + K  # the last decode wrote position start + K - 1
            worst = max(worst, (top2_margins(verify) - top2_margins(torch.stack(decodes))).abs().max().item())
    print(f"\nmeasured margin change, 1-row decode vs {K + 1}-row verify: {worst:.3g}")
    return max(FP32_TOLERANCE, 4 * worst)


def assert_same_greedy(outs, reference, tolerance):
    tokens, margins = reference
    got = [outs[str(i)].outputs[0].token_ids for i in range(len(tokens))]
    decided = sum(sum(m > tolerance for m in ms[: len(t)]) for ms, t in zip(margins, tokens))
    total = sum(len(t) for t in tokens)
    assert decided >= 0.9 * total, f"only {decided} of {total} steps decided beyond {tolerance}"
    assert_greedy_agrees(got, tokens, margins, tolerance, min_steps=int(0.9 * total))


# ----------------------------------------------------------------------------- greedy identity


@pytest.mark.numerics
@pytest.mark.slow  # 9 s; the batched and preempted run below keeps greedy identity in the quick tier
def test_greedy_tokens_unchanged_alone(smollm2, prompts, reference, verify_tolerance):
    engine = make_engine(smollm2, NGRAM)
    outs = {}
    for i, p in enumerate(prompts):
        outs |= run(engine, [(str(i), p, greedy(24))])
    assert_same_greedy(outs, reference, verify_tolerance)
    assert engine.spec_stats.num_accepted_tokens > 10, "the code prompt should have let prompt lookup fire"
    assert engine.scheduler.num_steps < sum(len(t) for t in reference[0]) + len(prompts)  # fewer steps than tokens


@pytest.mark.numerics
def test_greedy_tokens_unchanged_batched_and_preempted(smollm2, prompts, reference, verify_tolerance):
    batched = make_engine(smollm2, NGRAM)
    assert_same_greedy(
        run(batched, [(str(i), p, greedy(24)) for i, p in enumerate(prompts)]), reference, verify_tolerance
    )
    assert batched.spec_stats.num_drafts > 0
    small = make_engine(smollm2, NGRAM, num_kv_blocks=22, block_size=4, max_num_batched_tokens=16)
    assert_same_greedy(
        run(small, [(str(i), p, greedy(24)) for i, p in enumerate(prompts)]), reference, verify_tolerance
    )
    assert small.scheduler.num_preemptions > 0 and small.spec_stats.num_accepted_tokens > 0
    verifies = [r for rec in small.step_records for r in rec.scheduled if r.kind == "verify"]
    assert verifies and all(r.num_tokens == 1 + r.num_draft_tokens for r in verifies)
    assert all(rec.num_batched_tokens <= 16 for rec in small.step_records)


# ----------------------------------------------------------------------------- one forward, the budget


@pytest.mark.numerics
def test_one_target_forward_per_verify_step_with_all_rows(smollm2, prompts, reference):
    engine = make_engine(smollm2, NGRAM)
    engine.proposer = OracleProposer({tuple(prompts[0]): reference[0][0]})
    calls = []
    run_model = engine.runner.run_model

    def counted(input_ids, positions, meta):
        calls.append((len(input_ids), len(meta.logits_indices)))
        return run_model(input_ids, positions, meta)

    engine.runner.run_model = counted
    out = run(engine, [("code", prompts[0], greedy(24))])["code"]
    assert out.outputs[0].token_ids == reference[0][0]
    assert len(calls) == engine.scheduler.num_steps == 6  # the prefill's token, then 23 at 5 a step
    assert calls[1] == (K + 1, K + 1)  # a verify: k + 1 rows in, k + 1 logits out
    steps = out.metrics.spec_steps
    assert all(s.num_accepted == len(s.draft_token_ids) for s in steps)  # the oracle is always right
    assert sum(len(s.token_ids) for s in steps) + 1 == 24


@pytest.mark.numerics
def test_short_budget_drafts_fewer_and_mixes_with_prefill_chunks(smollm2, prompts, reference):
    """A budget of 9: one verify of 1 + 4 leaves 4 tokens, for another prompt's chunk or a verify of 1 + 3."""
    engine = make_engine(smollm2, NGRAM, max_num_batched_tokens=9)
    engine.proposer = OracleProposer({tuple(prompts[0]): reference[0][0]})
    engine.add_request("code", prompts[0], greedy(40))
    while not engine.scheduler.running or engine.scheduler.running[0].num_computed_tokens < len(prompts[0]):
        engine.step()
    engine.add_request("twin", prompts[0], greedy(12))
    outs = {o.request_id: o for o in engine.run_until_done()}
    assert outs["code"].outputs[0].token_ids[:24] == reference[0][0]
    assert outs["twin"].outputs[0].token_ids == reference[0][0][:12]
    assert all(rec.num_batched_tokens <= 9 for rec in engine.step_records)
    shares = [sorted((r.kind, r.num_tokens) for r in rec.scheduled) for rec in engine.step_records]
    assert [("prefill chunk", 4), ("verify", 5)] in shares  # a verify beside another's prompt chunk
    assert [("verify", 4), ("verify", 5)] in shares  # the second verify gets 3 drafts, not 4
    assert engine.block_manager.stats["hits"] > 0  # the twin's prompt came from the cache


# ----------------------------------------------------------------------------- stops and streaming


@pytest.mark.numerics
def test_stops_inside_an_accepted_run(smollm2, story_ids):
    day = story_ids[1]
    engine = make_engine(smollm2, NGRAM)
    engine.proposer = OracleProposer({tuple(day): DAY_GREEDY + [0] * 8})
    outs = run(
        engine,
        [
            ("eos", day, SamplingParams(temperature=0, max_tokens=12)),
            ("token", day, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[216])),
            ("string", day, SamplingParams(temperature=0, max_tokens=12, stop=["21st"])),
            ("length", day, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)),
        ],
    )
    eos = outs["eos"].outputs[0]
    assert (eos.token_ids, eos.text, eos.finish_reason) == (DAY_GREEDY, " in the 21st century.", "stop")
    token = outs["token"].outputs[0]
    assert (token.token_ids, token.finish_reason, token.stop_reason) == ([281, 260, 216], "stop", 216)
    string = outs["string"].outputs[0]
    assert (string.text, string.finish_reason, string.token_ids) == (" in the ", "stop", [281, 260, 216, 34, 33, 302])
    length = outs["length"].outputs[0]
    assert (length.token_ids, length.finish_reason) == (DAY_GREEDY[:4], "length")
    assert len(outs["token"].metrics.token_times) == 3
    assert outs["eos"].metrics.spec_steps[0].num_accepted == K  # the stop fell inside accepted runs
    # the stop string's sequence left the scheduler at the step after (its tokens past the stop never shown)
    assert not engine.scheduler.has_unfinished() and engine.block_manager.num_used_blocks == 0
    assert not engine.requests and not engine.has_unfinished_requests()


@pytest.mark.numerics
def test_streaming_yields_each_steps_accepted_tokens(smollm2, story_ids):
    day = story_ids[1]
    engine = make_engine(smollm2, NGRAM)
    engine.proposer = OracleProposer({tuple(day): DAY_GREEDY}, wrong_at=2)  # 2 drafts kept per verify
    engine.add_request("s", day, SamplingParams(temperature=0, max_tokens=12))
    deltas = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas.append(out.outputs[0].new_token_ids)
    assert deltas[0] == [281] and deltas[1] == [260, 216, 34]  # 2 accepted + the model's own
    assert sum(deltas, []) == DAY_GREEDY == out.outputs[0].token_ids
    assert [s.num_accepted for s in out.metrics.spec_steps][:2] == [2, 2]


# ----------------------------------------------------------------------------- counters and errors


@pytest.mark.numerics
def test_counters_in_outputs_stats_metrics_and_the_startup_log(smollm2, story_ids):
    from lifeofprompt.serving.server_metrics import ServerStats, render_metrics

    day = story_ids[1]
    engine = make_engine(smollm2, NGRAM)
    engine.proposer = OracleProposer({tuple(day): DAY_GREEDY}, wrong_at=1)
    out = run(engine, [("d", day, SamplingParams(temperature=0, max_tokens=9))])["d"]
    spec = out.metrics.spec_decode
    assert spec.num_drafts == len(out.metrics.spec_steps) > 0
    assert spec.num_accepted_tokens == spec.num_drafts and spec.num_accepted_tokens_per_pos[:2] == [spec.num_drafts, 0]
    stats = engine.stats["spec_decode"]
    assert stats["num_draft_tokens"] == spec.num_draft_tokens and stats["num_accepted_tokens"] == spec.num_drafts
    text = render_metrics(engine, ServerStats(), "smollm2")
    assert f"lifeofprompt_spec_decode_num_drafts_total {spec.num_drafts}" in text
    assert f'lifeofprompt_spec_decode_num_accepted_tokens_per_pos_total{{position="0"}} {spec.num_drafts}' in text
    assert "lifeofprompt_spec_decode_verify_seconds_total" in text
    parser = pytest.importorskip("prometheus_client.parser")
    names = {f.name for f in parser.text_string_to_metric_families(text)}
    assert "lifeofprompt_spec_decode_num_accepted_tokens_per_pos" in names
    assert "speculative decoding: n-gram" in "\n".join(make_engine(smollm2, NGRAM).startup_log)
    assert "spec_decode" not in render_metrics(make_engine(smollm2), ServerStats(), "smollm2")


@pytest.mark.parametrize(
    "config, field",
    [
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 2.5}, "num_speculative_tokens"),
        ({"method": "medusa", "num_speculative_tokens": 2}, "method"),
        ({"num_speculative_tokens": 2}, "method"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
            "prompt_lookup_min",
        ),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 0}, "prompt_lookup_max"),
        ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "lookahead"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
    ],
)
def test_bad_speculative_config_names_the_field(config, field):
    with pytest.raises(SpeculativeConfigError) as info:
        SpeculativeConfig.from_user(config)
    assert info.value.param == field and repr(field) in str(info.value)


def test_ngram_proposer_takes_the_longest_suffix_and_its_earliest_match():
    config = SpeculativeConfig.from_user(
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    )
    propose = NgramProposer(config).propose
    assert propose([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3]) == [9, 1, 2]  # 3-gram: the earliest of two
    assert propose([5, 1, 2, 8, 8, 4, 2]) == [8, 8, 4]  # only a 1-gram matches
    assert propose([7, 1, 2, 3, 7, 4, 2, 3]) == [7, 4, 2]  # 2-gram "2 3" beats 1-gram "3"
    assert propose([1, 2, 3, 4]) == []  # nothing earlier: no draft
    assert propose([1, 2, 1, 2]) == [1, 2]  # the run stops at the end
    assert propose([4, 5, 4, 5, 4], max_draft=1) == [5]
    assert propose([1 << 40, 3, 1 << 40]) == [3, 1 << 40]  # ids wider than 32 bits
    assert propose([256, 0, 1]) == []  # the bytes of 1 start inside those of 256: not a match
    defaults = SpeculativeConfig.from_user({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3})
    assert (defaults.prompt_lookup_min, defaults.prompt_lookup_max) == (3, 3)  # one bound given: the other follows


def test_drafts_are_cut_to_the_rows_the_c_step_takes():
    """With a row budget (the C step's measured limit) the drafts of a step's decodes add up to at most
    the rows left after one per decode, given in order; without one every decode drafts its k."""
    from lifeofprompt.engine.spec_decode import SpecDecoder

    config = SpeculativeConfig.from_user(
        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    )
    decoder = SpecDecoder(config, model=None, tokenizer=None, block_size=16)

    def decoding_seqs():
        seqs = [Sequence(f"s{i}", [1, 2, 3, 4, 5, 6, 1, 2], SamplingParams(temperature=0)) for i in range(3)]
        for seq in seqs:
            seq.num_computed_tokens = len(seq) - 1
        return seqs

    for budget, drafts in ((0, [4, 4, 4]), (8, [4, 1, 0]), (3, [0, 0, 0]), (16, [4, 4, 4])):
        decoder.row_budget = budget
        seqs = decoding_seqs()
        decoder.propose(seqs, lambda seq: 4, clock=lambda: 0.0)
        assert [len(s.spec_token_ids) for s in seqs] == drafts, budget


# ----------------------------------------------------------------------------- a draft model

SELF_DRAFT_LAYERS = 8


@pytest.mark.slow
@pytest.mark.numerics
def test_self_speculation_first_layers_gives_the_same_greedy_tokens(smollm2, prompts, reference, verify_tolerance):
    """The model's first 8 of 30 layers as its draft: alone, batched, and in a pool small enough to preempt.
    Its acceptance is reported, whatever it is (it is low: 8 layers predict the 30-layer model poorly)."""
    model, _ = smollm2
    spec = {"model": first_layers(model, SELF_DRAFT_LAYERS), "num_speculative_tokens": 2}
    alone = make_engine(smollm2, spec)
    outs = {}
    for i, p in enumerate(prompts[:2]):
        outs |= run(alone, [(str(i), p, greedy(24))])
    assert_same_greedy(outs, [r[:2] for r in reference], verify_tolerance)
    small = make_engine(smollm2, spec, num_kv_blocks=22, block_size=4, max_num_batched_tokens=16)
    assert_same_greedy(
        run(small, [(str(i), p, greedy(24)) for i, p in enumerate(prompts)]), reference, verify_tolerance
    )
    assert small.scheduler.num_preemptions > 0
    stats = alone.spec_stats
    assert stats.num_drafts > 0 and stats.draft_time > 0
    print(
        f"\nself-speculation, first {SELF_DRAFT_LAYERS} layers: {stats.num_accepted_tokens} of "
        f"{stats.num_draft_tokens} draft tokens accepted ({stats.acceptance_rate:.1%}), per position "
        f"{stats.num_accepted_tokens_per_pos}"
    )


@pytest.mark.slow
@pytest.mark.numerics
def test_the_model_as_its_own_draft_accepts_almost_everything(smollm2, prompts, reference, verify_tolerance):
    """Acceptance ≈ 1 checks the bookkeeping: the draft's K/V sit in the right slots of its own pool, in
    blocks shared with the target's tables, through rollbacks and prefix-cache hits."""
    model, _ = smollm2
    engine = make_engine(smollm2, {"model": model, "num_speculative_tokens": 3})
    outs = run(engine, [(str(i), p, greedy(24)) for i, p in enumerate(prompts)])
    assert_same_greedy(outs, reference, verify_tolerance)
    first = engine.spec_stats.acceptance_rate
    again = run(engine, [("again", prompts[0], greedy(24))])["again"]  # its prompt's blocks: cache hits
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == reference[0][0]
    assert first > 0.95 and again.metrics.spec_decode.acceptance_rate > 0.95
    assert engine.proposer.kv_cache.kv.abs().sum() > 0


def test_memory_is_split_by_bytes_per_block_and_a_draft_must_fit(smollm2):
    from lifeofprompt.engine.memory import kv_bytes_per_block
    from lifeofprompt.errors import OutOfMemoryError

    model, _ = smollm2
    draft = first_layers(model, 6)
    target_block = kv_bytes_per_block(model.config, model.dtype, 16)
    draft_block = kv_bytes_per_block(draft.config, draft.dtype, 16)
    memory = 10 * target_block
    engine = make_engine(
        smollm2, {"model": draft, "num_speculative_tokens": 2}, num_kv_blocks=None, kv_cache_memory=memory
    )
    assert engine.num_kv_blocks == memory // (target_block + draft_block) == 8
    assert engine.proposer.kv_cache.num_blocks == engine.num_kv_blocks
    assert engine.proposer.kv_cache.nbytes == 8 * draft_block
    assert any("draft model" in line and "split by bytes per block" in line for line in engine.startup_log)
    with pytest.raises(OutOfMemoryError, match=r"speculative_config\['model'\]"):
        make_engine(
            smollm2, {"model": draft, "num_speculative_tokens": 2}, num_kv_blocks=None, kv_cache_memory=target_block
        )  # one block without the draft, none with it


def test_a_draft_with_another_vocabulary_or_tokenizer_is_refused(smollm2):
    from dataclasses import replace

    from lifeofprompt.model.llama import LlamaForCausalLM
    from lifeofprompt.model.loader import ByteTokenizer

    model, _ = smollm2
    other = LlamaForCausalLM(
        replace(
            model.config,
            vocab_size=512,
            num_layers=1,
            hidden_size=64,
            intermediate_size=64,
            num_heads=2,
            num_kv_heads=1,
            head_dim=32,
        )
    ).eval()
    with pytest.raises(SpeculativeConfigError, match="vocabulary") as info:
        make_engine(smollm2, {"model": other, "num_speculative_tokens": 2})
    assert info.value.param == "model"
    with pytest.raises(SpeculativeConfigError, match="tokenizer") as info:
        make_engine(
            smollm2,
            {
                "model": first_layers(model, 2),
                "num_speculative_tokens": 2,
                "draft_tokenizer": ByteTokenizer(model.config.vocab_size),
            },
        )
    assert info.value.param == "model"
    short = LlamaForCausalLM(replace(model.config, max_position_embeddings=256, num_layers=1)).eval()
    with pytest.raises(SpeculativeConfigError, match="context") as info:
        make_engine(smollm2, {"model": short, "num_speculative_tokens": 2})
    assert info.value.param == "model"
    assert make_engine(smollm2, {"model": short, "num_speculative_tokens": 2}, max_model_len=256).max_model_len == 256
    with pytest.raises(SpeculativeConfigError, match="LlamaForCausalLM"):
        make_engine(smollm2, {"model": 3, "num_speculative_tokens": 2})


@pytest.mark.numerics
def num_rejected(step) -> int:
    """Drafts of a verify step (``SpecStep``) whose KV rows were computed and rolled back."""
    return len(step.draft_token_ids) - step.num_accepted


def kept_positions(step) -> range:
    """The KV rows a verify wrote and kept: its last verified token's and the accepted drafts'."""
    return range(step.position, step.position + 1 + step.num_accepted)


def rolled_back_positions(step) -> range:
    """The KV rows written for rejected drafts and discarded (overwritten later)."""
    return range(step.position + 1 + step.num_accepted, step.position + 1 + len(step.draft_token_ids))


def per_token_acceptance(stats) -> list[float]:
    """P(draft token i accepted | tokens before it accepted), per position (NaN where never reached)."""
    return [a / r if r else float("nan") for a, r in zip(stats.num_accepted_tokens_per_pos, stats.num_reached_per_pos)]


def mean_tokens_per_verify(stats) -> float:
    """Tokens each verify step produced on average (accepted + the model's own one)."""
    return 1 + stats.num_accepted_tokens / stats.num_drafts if stats.num_drafts else 1.0


def test_llm_front_door_logprobs_and_notebook_readable_metrics(smollm2, story_ids):
    from lifeofprompt import LLM

    model, tokenizer = smollm2
    day = story_ids[1]
    plain = LLM(model, tokenizer=tokenizer, num_kv_blocks=32, log_stats=False)
    llm = LLM(model, tokenizer=tokenizer, num_kv_blocks=32, log_stats=False, speculative_config=NGRAM)
    llm.engine.proposer = OracleProposer({tuple(day): DAY_GREEDY}, wrong_at=3)
    params = SamplingParams(temperature=0, max_tokens=9, logprobs=2)
    want = plain.generate([day], params, use_tqdm=False)[0].outputs[0]
    out = llm.generate([day], params, use_tqdm=False)[0]
    got = out.outputs[0]
    assert got.token_ids == want.token_ids == DAY_GREEDY
    assert len(got.logprobs) == 9 and all(
        len(top) in (2, 3) and t in top for t, top in zip(got.token_ids, got.logprobs)
    )
    for mine, theirs in zip(got.logprobs, want.logprobs):
        assert mine.keys() == theirs.keys()
        assert all(abs(mine[t] - theirs[t]) < 1e-3 for t in mine)
    assert got.cumulative_logprob == pytest.approx(want.cumulative_logprob, abs=1e-3)
    steps = out.metrics.spec_steps  # what a notebook draws: drafts, kept, rolled back
    assert [s.num_accepted for s in steps] == [3, 3]
    assert steps[0].token_ids == DAY_GREEDY[1:5] and num_rejected(steps[0]) == 1
    assert list(kept_positions(steps[0])) == [6, 7, 8, 9] and list(rolled_back_positions(steps[0])) == [10]
    assert per_token_acceptance(out.metrics.spec_decode)[:3] == [1.0, 1.0, 1.0]


@pytest.mark.numerics
def test_the_trace_shows_drafts_kept_and_rolled_back(smollm2, story_ids):
    day = story_ids[1]
    engine = make_engine(smollm2, NGRAM, block_size=4)
    engine.proposer = OracleProposer({tuple(day): DAY_GREEDY}, wrong_at=1)
    run(engine, [("d", day, SamplingParams(temperature=0, max_tokens=9))])
    trace = format_steps(engine.step_records)
    assert "d verify        tokens   6..10  (5, 4 drafts, 1 kept)  blocks [0, 1, 2]" in trace, trace
    # the rollback kept 8 verified tokens (2 blocks) and gave block 2 back; the next verify takes it again
    assert "d verify        tokens   8..12  (5, 4 drafts, 1 kept)  blocks [0, 1, 2, 3]" in trace, trace


def test_serve_takes_a_speculative_config_as_json(capsys):
    from lifeofprompt.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["serve", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    assert args.speculative_config == {"method": "ngram", "num_speculative_tokens": 3}
    assert parser.parse_args(["serve"]).speculative_config is None
    for bad in ("{method: ngram}", "[3]"):
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", "--speculative-config", bad])


def test_alpha_is_estimated_from_the_per_position_counts():
    """Simulated drafts with a known α: accepted/reached recovers it, accepted/drafted is the smaller
    (α − α^(k+1)) / (k(1 − α)), and the per-position rates are each about α."""
    import random

    from lifeofprompt.engine.speculative import SpecDecodeStats

    rng, alpha, k = random.Random(0), 0.7, 4
    stats = SpecDecodeStats(k)
    for _ in range(20_000):
        accepted = 0
        while accepted < k and rng.random() < alpha:
            accepted += 1
        stats.observe(k, accepted)
    assert stats.alpha == pytest.approx(alpha, abs=0.01)
    assert stats.acceptance_rate == pytest.approx((alpha - alpha ** (k + 1)) / (k * (1 - alpha)), abs=0.01)
    assert all(r == pytest.approx(alpha, abs=0.02) for r in per_token_acceptance(stats))
    assert mean_tokens_per_verify(stats) == pytest.approx((1 - alpha ** (k + 1)) / (1 - alpha), abs=0.03)


def test_ngram_proposer_can_take_the_latest_match_instead():
    config = SpeculativeConfig.from_user(
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    )
    latest = NgramProposer(config, latest=True).propose
    assert latest([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3]) == [7, 8, 1]
    assert latest([5, 1, 2, 8, 2, 4, 2]) == [4, 2]
    assert latest([256, 0, 1]) == [] and latest([1, 256, 0, 1]) == [256, 0, 1]  # misaligned bytes skipped


@pytest.mark.numerics
def test_a_draft_loaded_by_name_with_the_same_tokenizer(smollm2, story_ids):
    engine = make_engine(smollm2, {"model": "smollm2-135m", "num_speculative_tokens": 2})
    assert engine.proposer.model is not smollm2[0] and engine.proposer.model.dtype == torch.float32
    from lifeofprompt.model.linear import plannable

    paths = {m.plan.describe() for m in engine.proposer.model.modules() if plannable(m)}  # its own shapes' choice
    assert paths == {m.plan.describe() for m in smollm2[0].modules() if plannable(m)}  # pinned alike here
    out = run(engine, [("d", story_ids[1], SamplingParams(temperature=0, max_tokens=6))])["d"]
    assert out.outputs[0].token_ids == DAY_GREEDY[:6]
    assert engine.spec_stats.acceptance_rate > 0.9


def test_requests_with_penalties_or_logit_bias_decode_plainly_beside_speculating_ones(tiny_model):
    """The verify applies no penalties or logit_bias, so those requests never draft; the others still do
    (a grammar's requests do draft: tests/test_spec_structured.py)."""
    from lifeofprompt import LLM, SamplingParams

    model, tokenizer = tiny_model
    llm = LLM(
        model,
        tokenizer=tokenizer,
        log_stats=False,
        num_kv_blocks=256,
        max_num_seqs=4,
        speculative_config={"model": model, "num_speculative_tokens": 3},
    )
    asks = [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, frequency_penalty=1.0),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logit_bias={7: 3.0}),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
    ]
    outs = llm.generate(["abc", "abd", "abe"], asks, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 12 for o in outs)
    assert not outs[0].metrics.spec_steps and not outs[1].metrics.spec_steps
    assert outs[2].metrics.spec_steps  # the plain request still speculates


# ------------------------------------------------------------------ drafts priced by their rows


def drafting_seqs(acceptance: list[tuple[int, int]], k: int = 4) -> list[Sequence]:
    """Decoding sequences with ``k`` drafts each and a request history of (accepted, reached) positions."""
    from lifeofprompt.engine.speculative import SpecDecodeStats

    seqs = []
    for i, (accepted, reached) in enumerate(acceptance):
        seq = Sequence(f"d{i}", [5, 6, 7], SamplingParams(temperature=0))
        seq.num_computed_tokens = 2
        seq.spec_stats = SpecDecodeStats(k, num_accepted_tokens=accepted, num_reached_per_pos=[reached] + [0] * (k - 1))
        seq.set_spec([8 + j for j in range(k)])
        seqs.append(seq)
    return seqs


def test_step_time_reads_between_and_beyond_the_measured_counts():
    from lifeofprompt.engine.spec_decode import step_time

    measured = {1: 0.020, 2: 0.022, 8: 0.040, 16: 0.064}
    assert step_time(1, measured) == 0.020 and step_time(4, measured) == pytest.approx(0.028)
    assert step_time(32, measured) == pytest.approx(0.064 + 16 * 0.003)  # the last two's slope
    assert step_time(1, {4: 0.04}) == 0.04 and step_time(8, {4: 0.04}) == pytest.approx(0.08)


def test_drafts_stay_where_rows_are_cheap_and_go_where_they_cost_more_than_they_bring():
    """A flat (memory-bound) curve: every draft stays, however poor the acceptance. The AMD EPYC's
    C step at 1 thread: a poor request alone keeps some; at batch 8 rarely accepted drafts all go,
    often accepted ones keep their first positions, and a mixed batch keeps the good requests' drafts."""
    from lifeofprompt.engine.spec_decode import drafts_worth_their_rows

    flat = {1: 0.026, 8: 0.026, 16: 0.050}
    poor = drafting_seqs([(2, 10)])  # alpha 0.25 with the prior
    assert drafts_worth_their_rows(poor, flat) == 4 and len(poor[0].spec_token_ids) == 4
    amd = {1: 0.026, 2: 0.024, 4: 0.028, 8: 0.038, 16: 0.062, 32: 0.112}
    poor = drafting_seqs([(2, 10)])
    assert drafts_worth_their_rows(poor, amd) >= 1
    batch = drafting_seqs([(2, 10)] * 8)
    assert drafts_worth_their_rows(batch, amd) == 0 and all(not s.spec_token_ids for s in batch)
    good = drafting_seqs([(80, 100)] * 8)  # alpha ~ 0.8
    kept = drafts_worth_their_rows(good, amd)
    assert 0 < kept < 32 and all(s.spec_token_ids == [8] for s in good)  # a first draft each
    mixed = drafting_seqs([(80, 100)] * 4 + [(2, 10)] * 4)
    drafts_worth_their_rows(mixed, amd)
    assert [len(s.spec_token_ids) for s in mixed[4:]] == [0] * 4 and all(s.spec_token_ids for s in mixed[:4])


def test_without_the_price_a_batch_speculates_and_loses():
    """The cut is what prevents the loss: the same poor batch, every draft kept, expects fewer tokens
    per second than plain decoding on that curve (so a test without the cut would catch the 0.89x)."""
    from lifeofprompt.engine.spec_decode import acceptance_estimate, step_time

    flat = {1: 0.026, 8: 0.038, 16: 0.062, 32: 0.112}
    batch = drafting_seqs([(2, 10)] * 8)
    alpha = acceptance_estimate(batch[0])
    with_all = (8 + 8 * sum(alpha ** (i + 1) for i in range(4))) / step_time(40, flat)
    assert with_all < 8 / step_time(8, flat)


def test_a_request_s_own_verifies_move_its_estimate(smollm2, story_ids):
    """The engine hands each sequence its request's counters: a new request starts at 1/2, and its
    verifies move it (accepted over reached positions, the prior's two trials added)."""
    from lifeofprompt.engine.spec_decode import acceptance_estimate

    engine = make_engine(smollm2, NGRAM)
    engine.add_request("r", story_ids[1], SamplingParams(temperature=0, max_tokens=2))
    request = engine.requests["r"]
    seq = request.completions[0].seq
    assert seq.spec_stats is request.metrics.spec_decode and acceptance_estimate(seq) == 0.5
    seq.spec_stats.observe(4, 1)  # first draft kept, second rejected
    assert acceptance_estimate(seq) == 0.5  # (1 + 1) / (2 + 2)
    seq.spec_stats.observe(4, 0)
    assert acceptance_estimate(seq) == 0.4  # (1 + 1) / (3 + 2)

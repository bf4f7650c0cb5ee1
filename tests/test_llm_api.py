"""The public API with vLLM's conventions: ``LLM.generate`` / ``stream`` / ``chat`` and their validation."""

from __future__ import annotations

import pytest

from lifeofprompt import LLM, RequestOutput, SamplingParams
from lifeofprompt.errors import InvalidRequestError, RequestTooLargeError
from lifeofprompt.story import STORY_PROMPTS

STORY = list(STORY_PROMPTS)
GREEDY3 = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
# The greedy tokens pinned below are decided far beyond fp32 rounding at every step (tests/test_pins.py).

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def llm(smollm2):
    model, tokenizer = smollm2
    return LLM(model, tokenizer=tokenizer, num_kv_blocks=16, log_stats=False, check_invariants=True)


def test_defaults_follow_vllm():
    p = SamplingParams()
    assert (p.temperature, p.max_tokens, p.ignore_eos, p.stop, p.seed, p.top_p, p.top_k) == (
        1.0,
        16,
        False,
        [],
        None,
        1.0,
        -1,
    )


@pytest.mark.numerics
def test_generate_text_and_token_prompts_in_order(llm, story_ids):
    outs = llm.generate([STORY[2], story_ids[0], STORY[1]], GREEDY3)
    assert all(isinstance(o, RequestOutput) and o.finished for o in outs)
    assert [o.prompt for o in outs] == [STORY[2], None, STORY[1]]
    assert [o.prompt_token_ids for o in outs] == [story_ids[2], story_ids[0], story_ids[1]]
    assert [o.outputs[0].token_ids for o in outs] == [[506, 787, 737], [2026, 365, 10905], [281, 260, 216]]
    assert [o.outputs[0].text for o in outs] == ["'s no need", "... (pa", " in the "]
    assert {o.outputs[0].finish_reason for o in outs} == {"length"}
    m = outs[0].metrics
    assert m.num_prompt_tokens == 2 and len(m.token_times) == 3 and m.finished_time >= m.first_token_time
    single = llm.generate(STORY[2], GREEDY3)  # one string -> a list of one
    assert len(single) == 1 and single[0].outputs[0].token_ids == [506, 787, 737]
    assert single[0].num_cached_tokens == 0  # 2 tokens: less than a block, nothing to reuse


def test_one_sampling_params_per_prompt(llm):
    outs = llm.generate(STORY[:2], [SamplingParams(temperature=0, max_tokens=1), GREEDY3])
    assert [len(o.outputs[0].token_ids) for o in outs] == [1, 3]


@pytest.mark.parametrize(
    "prompts, params, error, index",
    [
        (["ok", ""], None, InvalidRequestError, 1),
        (["ok", 7], None, InvalidRequestError, 1),
        ([[1, 2], [1, 49152]], None, InvalidRequestError, 1),
        (["ok", "ok", "ok"], [GREEDY3, GREEDY3, "greedy"], InvalidRequestError, 2),
        (["ok", list(range(300))], None, RequestTooLargeError, 1),
    ],
)
def test_every_request_is_checked_before_any_work(llm, prompts, params, error, index):
    steps = llm.engine.scheduler.num_steps
    with pytest.raises(error) as info:
        llm.generate(prompts, params)
    assert info.value.index == index and f"request {index}" in str(info.value)
    assert not llm.engine.has_unfinished_requests() and llm.engine.scheduler.num_steps == steps


def test_invalid_sampling_values_and_mismatched_lists(llm):
    bad = SamplingParams(temperature=0)
    bad.max_tokens = -1  # made valid, then broken: generate re-checks
    with pytest.raises(InvalidRequestError, match="request 0: max_tokens"):
        llm.generate("ok", bad)
    with pytest.raises(InvalidRequestError, match="2 sampling_params for 3 prompts"):
        llm.generate(STORY, [GREEDY3, GREEDY3])


@pytest.mark.numerics
def test_stream_yields_deltas_that_add_up(llm):
    pieces: dict[str, list[str]] = {}
    finals = {}
    for out in llm.stream(STORY[1:], GREEDY3):
        pieces.setdefault(out.request_id, []).append(out.outputs[0].new_text)
        if out.finished:
            finals[out.request_id] = out.outputs[0].text
    assert sorted(finals.values()) == sorted([" in the ", "'s no need"])
    assert all("".join(pieces[rid]) == text for rid, text in finals.items())


@pytest.mark.numerics
def test_stream_closed_early_aborts_the_rest(llm):
    stream = llm.stream(STORY[0], SamplingParams(temperature=0, max_tokens=50))
    first = next(stream)
    assert first.outputs[0].new_token_ids == [2026]
    stream.close()
    assert not llm.engine.has_unfinished_requests() and llm.engine.block_manager.num_used_blocks == 0


@pytest.mark.numerics
def test_chat_applies_the_template(llm):
    conversation = [{"role": "user", "content": "What is 2+2?"}]
    prompt = llm.apply_chat_template(conversation)
    assert prompt["prompt"].endswith("<|im_start|>assistant\n")
    (out,) = llm.chat(conversation, SamplingParams(temperature=0, max_tokens=4))
    assert out.prompt_token_ids == prompt["prompt_token_ids"]
    assert out.outputs[0].text == "The answer to this"
    with pytest.raises(InvalidRequestError):
        llm.chat([{"content": "no role"}])


def test_long_runs_get_a_progress_bar(llm, capsys):
    outs = llm.generate([[i + 1, i + 2] for i in range(16)], SamplingParams(temperature=0, max_tokens=1))
    assert len(outs) == 16 and all(len(o.outputs[0].token_ids) == 1 for o in outs)
    assert "Processed prompts" in capsys.readouterr().err
    llm.generate([[1, 2]], SamplingParams(temperature=0, max_tokens=1))
    assert "Processed prompts" not in capsys.readouterr().err  # a short run stays quiet


@pytest.mark.numerics
def test_logprobs_come_back_through_generate(llm, story_ids):
    """``logprobs=N``: per generated token the top N plus the sampled one; greedy picks the most likely."""
    import math

    out = llm.generate(
        [story_ids[0]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3), use_tqdm=False
    )[0].outputs[0]
    assert out.token_ids == [2026, 365, 10905, 6176]
    assert len(out.logprobs) == 4 and out.logprobs[3][6176] == pytest.approx(-0.0959, abs=1e-3)
    for token, top in zip(out.token_ids, out.logprobs):
        assert len(top) == 3 and token in top
        assert max(top, key=top.get) == token  # greedy: the sampled token is the best
        assert all(lp <= 0 for lp in top.values()) and sum(math.exp(lp) for lp in top.values()) <= 1 + 1e-5
    assert out.cumulative_logprob == pytest.approx(sum(top[t] for t, top in zip(out.token_ids, out.logprobs)))
    assert not llm.generate([story_ids[0]], GREEDY3, use_tqdm=False)[0].random_weights


def test_outputs_of_a_random_weight_model_say_so():
    from dataclasses import replace

    from lifeofprompt.model.config import TINYLLAMA_1_1B
    from lifeofprompt.model.llama import LlamaForCausalLM
    from lifeofprompt.model.loader import ByteTokenizer

    config = replace(
        TINYLLAMA_1_1B,
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=128,
    )
    model = LlamaForCausalLM(config).eval()
    model.is_random = True
    tiny = LLM(model, tokenizer=ByteTokenizer(config.vocab_size), num_kv_blocks=16, log_stats=False)
    assert any("random weights" in line for line in tiny.engine.startup_log)
    out = tiny.generate(["hi"], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)[0]
    assert out.random_weights and "RANDOM WEIGHTS" in repr(out)

"""Penalties, min_tokens and logit_bias: against a hand computation, then through the engine."""

import pytest
import torch

from lifeofprompt import LLM, SamplingParams
from lifeofprompt.engine.logits_processors import process_logits
from lifeofprompt.errors import InvalidRequestError


def by_hand(row, prompt, output, rep=1.0, freq=0.0, pres=0.0, bias=None, min_tokens=0, eos=(), stop_ids=()):
    """The same rules, one token at a time in plain Python."""
    row = list(row)
    for t in range(len(row)):
        if min_tokens and len(output) < min_tokens and (t in eos or t in stop_ids):
            row[t] = float("-inf")
            continue
        row[t] += (bias or {}).get(t, 0.0)
        if t in prompt or t in output:
            row[t] = row[t] / rep if row[t] > 0 else row[t] * rep
        count = output.count(t)
        row[t] -= freq * count + pres * (count > 0)
    return row


@pytest.mark.parametrize(
    "case",
    [
        dict(rep=1.3),
        dict(freq=0.7),
        dict(pres=1.5),
        dict(freq=-0.5, pres=0.5, rep=0.8),
        dict(bias={2: 5.0, 7: -100.0}),
        dict(min_tokens=4, eos=(3,), stop_ids=(5,)),
        dict(rep=2.0, freq=1.0, bias={1: 2.0}),
    ],
)
def test_each_rule_matches_the_hand_computation(case):
    torch.manual_seed(0)
    logits = torch.randn(2, 9) * 3
    prompt, output = [1, 2, 2, 8], [2, 4, 4, 4]
    eos, stop_ids = case.pop("eos", ()), case.pop("stop_ids", ())
    names = dict(
        rep="repetition_penalty",
        freq="frequency_penalty",
        pres="presence_penalty",
        bias="logit_bias",
        min_tokens="min_tokens",
    )
    params = SamplingParams(**{names[k]: v for k, v in case.items()}, stop_token_ids=list(stop_ids))
    got = process_logits(logits, [params, SamplingParams()], [prompt, prompt], [output, output], eos)
    want = by_hand(logits[0].tolist(), prompt, output, eos=eos, stop_ids=stop_ids, **case)
    torch.testing.assert_close(got[0], torch.tensor(want, dtype=torch.float32))
    assert torch.equal(got[1], logits[1])  # a row that asks for nothing is untouched


def test_a_row_without_history_is_an_error_not_a_silent_skip():
    with pytest.raises(ValueError, match="prompt and output"):
        process_logits(torch.zeros(1, 4), [SamplingParams(presence_penalty=1.0)], None, None)


@pytest.mark.parametrize(
    "field,value",
    [
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3),
        ("repetition_penalty", 0),
        ("min_tokens", -1),
        ("logit_bias", {"a": 1}),
        ("logit_bias", {3: 200}),
    ],
)
def test_bad_values_name_their_field(field, value):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**{field: value})
    assert info.value.param == field
    with pytest.raises(InvalidRequestError):
        SamplingParams(min_tokens=5, max_tokens=3)


@pytest.fixture(scope="module")
def tiny_llm(tiny_model):
    model, tokenizer = tiny_model
    return LLM(model, tokenizer=tokenizer, log_stats=False, num_kv_blocks=64, max_num_seqs=4)


def test_logit_bias_and_min_tokens_through_the_engine(tiny_llm):
    eos = next(iter(tiny_llm.engine.eos_token_ids))
    forced = tiny_llm.generate(
        ["abc"], SamplingParams(temperature=0, max_tokens=6, logit_bias={7: 100.0}), use_tqdm=False
    )[0].outputs[0]
    assert forced.token_ids == [7] * 6
    # EOS pushed to the top, but held back for 3 tokens: the 4th is EOS and ends the answer
    held = tiny_llm.generate(
        ["abc"], SamplingParams(temperature=0, max_tokens=10, min_tokens=3, logit_bias={eos: 100.0}), use_tqdm=False
    )[0].outputs[0]
    assert len(held.token_ids) == 4 and held.token_ids[-1] == eos and eos not in held.token_ids[:3]
    assert held.finish_reason == "stop"


def test_penalties_move_the_greedy_choice_away_from_repeats(tiny_llm):
    plain = (
        tiny_llm.generate(["abc"], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)[0]
        .outputs[0]
        .token_ids
    )
    penalised = (
        tiny_llm.generate(
            ["abc"],
            SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, frequency_penalty=2.0, presence_penalty=2.0),
            use_tqdm=False,
        )[0]
        .outputs[0]
        .token_ids
    )
    assert len(set(penalised)) > len(set(plain))  # fewer repeats once repeating costs

"""Completions' ``echo``, driven by the official ``openai`` client: the prompt before the answer, and with
``logprobs`` its tokens' log-probabilities first (the first null), equal to the engine's ``prompt_logprobs``;
``max_tokens: 0`` + ``echo`` + ``logprobs`` is lm-evaluation-harness's log-likelihood request. Streamed, the
prompt comes in each choice's first chunk only; with ``n`` > 1 every choice echoes it."""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from lifeofprompt.engine.llm_engine import LLMEngine  # noqa: E402
from lifeofprompt.engine.sampling_params import SamplingParams  # noqa: E402
from lifeofprompt.lessons.server_thread import ServerThread  # noqa: E402

MODEL = "smollm2-135m"
PROMPT = "The capital of France is Paris, and the capital of Italy is"
OTHER = [504, 3658, 6476, 314]  # a second prompt, as token ids
ATOL = 1e-3  # the server's batches may sum in another order than the reference engine's


@pytest.fixture(scope="module")
def server(smollm2):
    model, tokenizer = smollm2
    engine = LLMEngine(model, tokenizer=tokenizer, num_kv_blocks=64, max_num_seqs=8, log_stats=False)
    with ServerThread(engine, model_name=MODEL) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def engine_scores(smollm2):
    """The engine's own prompt logprobs of each prompt (its own engine, the same weights), by prompt ids."""
    model, tokenizer = smollm2
    engine = LLMEngine(model, tokenizer=tokenizer, num_kv_blocks=64, log_stats=False)
    ids = {"text": tokenizer.encode(PROMPT, add_special_tokens=False), "other": OTHER}
    for name, prompt in ids.items():
        engine.add_request(name, prompt, SamplingParams(max_tokens=0, prompt_logprobs=1))
    outs = {o.request_id: o for o in engine.run_until_done()}
    return {name: (ids[name], outs[name].prompt_logprobs) for name in ids}


def assert_prompt_part(logprobs, ids, scores, tokenizer):
    """The first len(ids) entries are the prompt's: its tokens' texts, the first logprob null, then the engine's
    values; text offsets count the characters of the tokens before."""
    p = len(ids)
    assert logprobs.tokens[:p] == [tokenizer.decode([t]) for t in ids]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    for i in range(1, p):
        assert logprobs.token_logprobs[i] == pytest.approx(scores[i][ids[i]], abs=ATOL), f"prompt token {i}"
        top = logprobs.top_logprobs[i]
        assert logprobs.tokens[i] in top and 1 <= len(top) <= 2
    assert logprobs.text_offset == [len("".join(logprobs.tokens[:i])) for i in range(len(logprobs.tokens))]


def test_echo_puts_the_prompt_before_the_answer(client, smollm2):
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    echoed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    assert echoed.choices[0].logprobs is None
    assert echoed.usage.prompt_tokens == plain.usage.prompt_tokens and echoed.usage.completion_tokens == 4
    by_ids = client.completions.create(model=MODEL, prompt=OTHER, max_tokens=2, temperature=0, echo=True)
    assert by_ids.choices[0].text.startswith(smollm2[1].decode(OTHER)), "a token-id prompt is echoed decoded"


def test_echo_with_logprobs_scores_the_prompt_then_the_answer(client, smollm2, engine_scores):
    ids, scores = engine_scores["text"]
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=1)
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=1, echo=True)
    choice = out.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) + 3
    assert_prompt_part(lp, ids, scores, smollm2[1])
    assert lp.tokens[len(ids) :] == plain.choices[0].logprobs.tokens
    assert lp.token_logprobs[len(ids) :] == pytest.approx(plain.choices[0].logprobs.token_logprobs, abs=ATOL)
    assert "".join(lp.tokens) == choice.text and choice.text.startswith(PROMPT)


@pytest.mark.parametrize("as_ids, max_tokens", [(False, 0), (True, 0), (True, 1)])
def test_lm_eval_log_likelihood_request(client, server, smollm2, engine_scores, as_ids, max_tokens):
    """lm-evaluation-harness's ``local-completions`` body: the prompt scored, nothing generated (or one token,
    which the harness's parser drops: it reads ``token_logprobs[ctxlen:-1]``)."""
    ids, scores = engine_scores["text"]
    prompt = [ids, OTHER] if as_ids else PROMPT
    body = dict(model=MODEL, prompt=prompt, max_tokens=max_tokens, echo=True, logprobs=1, temperature=0)
    out = client.completions.create(**body)
    expected = [engine_scores["text"], engine_scores["other"]] if as_ids else [engine_scores["text"]]
    assert len(out.choices) == len(expected)
    for choice, (ids, scores) in zip(out.choices, expected):
        assert choice.finish_reason == "length"
        assert len(choice.logprobs.tokens) == len(ids) + max_tokens
        assert_prompt_part(choice.logprobs, ids, scores, smollm2[1])
        assert choice.text.startswith(smollm2[1].decode(ids))
    assert out.usage.completion_tokens == max_tokens * len(expected)
    assert server.engine.block_manager.num_used_blocks == 0


def test_a_streamed_echo_sends_the_prompt_in_the_first_chunk_only(client):
    body = dict(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=1, echo=True)
    whole = client.completions.create(**body).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(**body, stream=True) if c.choices]
    assert chunks[0].text.startswith(PROMPT) and all(PROMPT not in c.text for c in chunks[1:])
    assert "".join(c.text for c in chunks) == whole.text
    tokens = [t for c in chunks if c.logprobs for t in c.logprobs.tokens]
    values = [v for c in chunks if c.logprobs for v in c.logprobs.token_logprobs]
    assert tokens == whole.logprobs.tokens
    assert values[0] is None and values[1:] == pytest.approx(whole.logprobs.token_logprobs[1:], abs=ATOL)
    offsets = [o for c in chunks if c.logprobs for o in c.logprobs.text_offset]
    assert offsets == whole.logprobs.text_offset


@pytest.mark.parametrize("stream", [False, True])
def test_every_one_of_n_choices_echoes_the_prompt(client, stream):
    body = dict(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0.8, seed=5, n=2, echo=True)
    if not stream:
        choices = client.completions.create(**body).choices
        texts = {c.index: c.text for c in choices}
    else:
        texts = {}
        for chunk in client.completions.create(**body, stream=True):
            for c in chunk.choices:
                texts[c.index] = texts.get(c.index, "") + c.text
    assert sorted(texts) == [0, 1]
    for text in texts.values():
        assert text.startswith(PROMPT) and PROMPT not in text[len(PROMPT) :]


def test_vllm_prompt_logprobs_field(client, smollm2, engine_scores):
    """vLLM's extra field: the choice's ``prompt_logprobs``, None first, then each prompt token with its top N,
    ranked (the prompt token's rank null when it is below them)."""
    ids, scores = engine_scores["text"]
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, extra_body={"prompt_logprobs": 1})
    got = out.choices[0].model_extra["prompt_logprobs"]
    assert got[0] is None and len(got) == len(ids)
    for i in range(1, len(ids)):
        mine = got[i][str(ids[i])]
        assert mine["logprob"] == pytest.approx(scores[i][ids[i]], abs=ATOL)
        assert mine["decoded_token"] == smollm2[1].decode([ids[i]])
        ranks = sorted((v["rank"] or 99) for v in got[i].values())
        assert ranks[0] == 1 and (len(got[i]) == 1 or (len(got[i]) == 2 and mine["rank"] is None))


@pytest.mark.parametrize(
    "extra",
    [
        {"prompt_logprobs": 21},
        {"prompt_logprobs": 2, "stream": True},
        {"prompt_logprobs": 2, "echo": True, "logprobs": 1},
    ],
)
def test_bad_prompt_logprobs_are_400s_naming_the_field(client, extra):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, extra_body=extra)
    assert info.value.body["param"] == "prompt_logprobs"


def test_a_streamed_log_likelihood_request_sends_the_scored_prompt(client, engine_scores, smollm2):
    ids, scores = engine_scores["text"]
    body = dict(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1, temperature=0, stream=True)
    chunks = [c.choices[0] for c in client.completions.create(**body) if c.choices]
    assert len(chunks) == 1 and chunks[0].text == PROMPT and chunks[0].finish_reason == "length"
    assert_prompt_part(chunks[0].logprobs, ids, scores, smollm2[1])

"""The OpenAI-compatible server, driven by the official ``openai`` client on loopback.

One server for the module, on the embedded SmolLM2 (CPU), with a small KV pool. Expected
tokens come from ``LLM.generate`` on the same weights; every test leaves the engine idle, with
every block back in the pool. The last section drives the whole surface (n, logprobs, penalties,
json_schema, regex, choice, tools, /tokenize) against it and against a second server on the tiny
random model, where valid JSON and tool calls can only come from the grammar.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from lifeofprompt.engine.llm import LLM  # noqa: E402
from lifeofprompt.engine.llm_engine import LLMEngine  # noqa: E402
from lifeofprompt.engine.sampling_params import SamplingParams  # noqa: E402
from lifeofprompt.lessons.server_thread import ServerThread  # noqa: E402

MODEL = "smollm2-135m"
NUM_BLOCKS = 64  # 64 × 16 = 1,024 tokens: the engine's limit per request
HI_IDS = [6004, 957, 1462, 314]  # "hi my name is"
SUMMER = "today is a beautiful summer day"
HELLO = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def expected(smollm2):
    """Greedy tokens from ``LLM.generate`` (its own engine and pool, the same weights).

    The server batches requests otherwise, which moves the rounding, not these tokens: each step
    of them is decided far beyond fp32 rounding (tests/test_pins.py).
    """
    model, tokenizer = smollm2
    llm = LLM(model, tokenizer=tokenizer, num_kv_blocks=NUM_BLOCKS, log_stats=False)
    greedy = SamplingParams(temperature=0, max_tokens=6)
    hi, summer = llm.generate([HI_IDS, SUMMER], greedy, use_tqdm=False)
    chat = llm.chat(HELLO, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    return {
        "hi": hi.outputs[0],
        "summer": summer.outputs[0],
        "chat": chat.outputs[0],
        "summer_prompt_len": len(summer.prompt_token_ids),
        "chat_prompt_len": len(chat.prompt_token_ids),
    }


@pytest.fixture(scope="module")
def server(smollm2):
    model, tokenizer = smollm2
    engine = LLMEngine(model, tokenizer=tokenizer, num_kv_blocks=NUM_BLOCKS, max_num_seqs=8, log_stats=False)
    with ServerThread(engine, model_name=MODEL) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def wait_idle(server, timeout: float = 60.0) -> None:
    """Until the engine has nothing left (aborts are applied at the next step)."""
    deadline = time.monotonic() + timeout
    while server.engine.has_unfinished_requests() or server.engine_loop.routes:
        assert time.monotonic() < deadline, "the engine never went idle"
        time.sleep(0.02)


def assert_no_leaks(server, timeout: float = 60.0) -> None:
    wait_idle(server, timeout)
    engine = server.engine
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.requests and not engine.scheduler.running and not engine.scheduler.waiting
    engine.block_manager.check_invariants([])


# ----------------------------------------------------------------------------- the happy paths


def test_completion_matches_llm_generate(client, server, expected):
    response = client.completions.create(
        model=MODEL, prompt=HI_IDS, max_tokens=6, temperature=0, extra_body={"return_token_ids": True}
    )
    choice = response.choices[0]
    assert choice.text == expected["hi"].text
    assert choice.model_extra["token_ids"] == expected["hi"].token_ids
    assert choice.finish_reason == "length"
    assert (response.usage.prompt_tokens, response.usage.completion_tokens, response.usage.total_tokens) == (4, 6, 10)
    assert response.object == "text_completion" and response.model == MODEL
    assert_no_leaks(server)


def test_completion_stream_matches_llm_generate(client, expected):
    stream = client.completions.create(
        model=MODEL,
        prompt=SUMMER,
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"return_token_ids": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    ids = [t for c in chunks if c.choices for t in c.choices[0].model_extra["token_ids"]]
    assert text == expected["summer"].text
    assert ids == expected["summer"].token_ids
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert len([c for c in chunks if c.choices]) >= 2, "a stream sends more than one chunk"
    usage = chunks[-1].usage  # the last chunk: no choices, the totals
    assert chunks[-1].choices == []
    assert (usage.prompt_tokens, usage.completion_tokens) == (expected["summer_prompt_len"], 6)


def test_chat_uses_the_chat_template(client, expected):
    response = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=8, temperature=0)
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].message.content == expected["chat"].text
    assert response.usage.prompt_tokens == expected["chat_prompt_len"]
    assert response.usage.completion_tokens == len(expected["chat"].token_ids)


def test_chat_stream(client, expected):
    chunks = list(client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=8, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected["chat"].text
    assert chunks[-1].choices[0].finish_reason == expected["chat"].finish_reason
    assert all(c.object == "chat.completion.chunk" for c in chunks)


def test_raw_stream_is_server_sent_events(server):
    body = {"model": MODEL, "prompt": HI_IDS, "max_tokens": 3, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"


def test_models_and_health(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].model_extra["max_model_len"] == NUM_BLOCKS * 16
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_metrics_parse_as_prometheus(client, server):
    parser = pytest.importorskip("prometheus_client.parser")
    client.completions.create(model=MODEL, prompt=HI_IDS, max_tokens=3, temperature=0)
    wait_idle(server)
    response = httpx.get(server.url + "/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in parser.text_string_to_metric_families(response.text)}
    value = lambda name: families[name].samples[0].value  # noqa: E731
    assert value("lifeofprompt_num_requests_running") == 0
    assert value("lifeofprompt_num_requests_waiting") == 0
    assert value("lifeofprompt_kv_cache_blocks_total") == NUM_BLOCKS
    assert value("lifeofprompt_kv_cache_blocks_used") == 0
    assert 0 <= value("lifeofprompt_prefix_cache_hit_rate") <= 1
    for name in ("lifeofprompt_time_to_first_token_seconds", "lifeofprompt_time_per_output_token_seconds"):
        assert families[name].type == "histogram"
        samples = {s.name: s for s in families[name].samples if s.name.endswith("_count")}
        assert samples[name + "_count"].value >= 1
        buckets = [s.value for s in families[name].samples if s.name.endswith("_bucket")]
        assert buckets == sorted(buckets) and buckets[-1] == samples[name + "_count"].value


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({"prompt": HI_IDS, "temperature": -1}, 400, "temperature"),
        ({"prompt": HI_IDS, "max_tokens": -1}, 400, "max_tokens"),
        ({"prompt": HI_IDS, "max_tokens": 5000}, 413, "max_tokens"),  # prompt + max_tokens > the 1,024-token pool
        ({"prompt": [7] * 1100}, 413, "max_tokens"),  # the prompt alone is too long
        ({"prompt": [10**9]}, 400, "prompt"),  # outside the vocabulary
        ({"prompt": ""}, 400, "prompt"),
        ({"max_tokens": 3}, 400, "prompt"),  # missing field
        ({"prompt": HI_IDS, "max_tokens": "many"}, 400, "max_tokens"),  # wrong type
        ({"prompt": {"not": "a prompt"}}, 400, None),
        ({"prompt": HI_IDS, "model": "gpt-4"}, 404, None),
    ],
)
def test_malformed_requests_get_openai_errors(server, body, status, param):
    body = {"model": MODEL, **body}
    response = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param


def test_openai_client_raises_typed_errors(client):
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt="hi", temperature=-0.5)
    assert bad.value.body["type"] == "invalid_request_error" and bad.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "wizard", "content": "hi"}])
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hi")


def test_invalid_json_body(server):
    response = httpx.post(
        server.url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_full_queue_answers_503(server, client, expected):
    """The engine thread held still: a burst admits max_num_seqs + max_waiting requests (8 + 2; it
    once counted the ones about to run as waiting and took only 2), the next gets 503 with Retry-After."""
    engine = server.engine
    saved, engine.max_waiting = engine.max_waiting, 2
    admitted = engine.scheduler.config.max_num_seqs + 2
    server.engine_loop.pause()
    results = {}

    def ask(name):
        try:
            results[name] = (
                client.completions.create(model=MODEL, prompt=HI_IDS, max_tokens=6, temperature=0).choices[0].text
            )
        except openai.APIStatusError as exc:
            results[name] = exc.status_code

    try:
        waiting = [threading.Thread(target=ask, args=(i,)) for i in range(admitted)]
        for t in waiting:
            t.start()
        deadline = time.monotonic() + 30
        while len(server.engine_loop.routes) < admitted:
            assert time.monotonic() < deadline, results
            time.sleep(0.01)
        full = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": HI_IDS, "max_tokens": 6})
        assert full.status_code == 503 and full.headers["retry-after"] == "1"
        assert full.json()["error"]["type"] == "server_overloaded"
    finally:
        engine.max_waiting = saved
        server.engine_loop.resume()
    for t in waiting:
        t.join(60)
    assert results == {i: expected["hi"].text for i in range(admitted)}
    assert_no_leaks(server)


def test_the_served_queue_is_bounded_by_default(server):
    assert server.engine.max_waiting == 4 * server.engine.scheduler.config.max_num_seqs


def test_a_failing_step_fails_its_requests_and_the_server_goes_on(server, expected, monkeypatch):
    """A step that raises (a bug, a kernel failure) fails the requests in flight with a 500 in
    OpenAI's shape; the engine thread survives and the next request is served."""
    real_step, calls = server.engine.step, []

    def step_that_fails_once():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("simulated failure inside a step")
        return real_step()

    monkeypatch.setattr(server.engine, "step", step_that_fails_once)
    body = {"model": MODEL, "prompt": HI_IDS, "max_tokens": 6, "temperature": 0}
    failed = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert failed.status_code == 500
    assert failed.json()["error"]["type"] == "internal_error"
    assert "simulated failure" in failed.json()["error"]["message"]
    assert "simulated failure" in server.engine_loop.last_error
    assert_no_leaks(server)
    again = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert again.status_code == 200 and again.json()["choices"][0]["text"] == expected["hi"].text
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


# ----------------------------------------------------------------------------- many clients at once


def test_concurrent_clients_cancelled_and_malformed(server, expected):
    """Valid, cancelled mid-stream and malformed requests all at once: every valid one completes
    with ``LLM.generate``'s tokens, the malformed get 4xx, and no block leaks."""

    async def run():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)

        async def complete(prompt):
            r = await client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=6, temperature=0, extra_body={"return_token_ids": True}
            )
            return r.choices[0].model_extra["token_ids"]

        async def stream(prompt):
            ids = []
            async for chunk in await client.completions.create(
                model=MODEL,
                prompt=prompt,
                max_tokens=6,
                temperature=0,
                stream=True,
                extra_body={"return_token_ids": True},
            ):
                ids += chunk.choices[0].model_extra["token_ids"]
            return ids

        async def chat():
            r = await client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=8, temperature=0)
            return r.choices[0].message.content

        async def cancel_after_first_chunk():
            response = await client.completions.create(
                model=MODEL, prompt="once upon a time", max_tokens=200, temperature=0, stream=True
            )
            async for _ in response:
                break
            await response.close()  # the client hangs up mid-stream
            return "cancelled"

        async def malformed(body):
            try:
                await client.completions.create(model=MODEL, **body)
            except openai.APIStatusError as exc:
                return exc.status_code
            return "accepted"

        jobs = (
            [complete(HI_IDS), stream(HI_IDS), complete(SUMMER), stream(SUMMER), chat(), chat()]
            + [cancel_after_first_chunk() for _ in range(3)]
            + [
                malformed({"prompt": "x", "temperature": -2}),
                malformed({"prompt": [1] * 2000}),
                malformed({"prompt": "x", "top_p": 7}),
            ]
        )
        try:
            return await asyncio.gather(*jobs)
        finally:
            await client.close()

    results = asyncio.run(run())
    hi, summer, chat = expected["hi"].token_ids, expected["summer"].token_ids, expected["chat"].text
    assert results[:6] == [hi, hi, summer, summer, chat, chat]
    assert results[6:9] == ["cancelled"] * 3
    assert results[9:] == [400, 413, 400]
    assert_no_leaks(server)
    aborted = [
        line
        for line in httpx.get(server.url + "/metrics").text.splitlines()
        if line.startswith('lifeofprompt_request_success_total{finished_reason="abort"}')
    ]
    assert aborted and float(aborted[0].split()[-1]) >= 3


def test_disconnect_frees_blocks_while_others_run(server, expected):
    """A long stream dropped after one chunk gives its blocks back; a request beside it is unaffected.
    Its 1,000 tokens (no EOS) take seconds, so the first chunk is read while it still runs even when a
    busy machine delays this thread (300 tokens once finished before the first read, blocks and all)."""
    body = {
        "model": MODEL, "prompt": "tell me a long story", "max_tokens": 1000, "ignore_eos": True,
        "temperature": 0, "stream": True,
    }  # fmt: skip
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
        # The line iterator is held: a generator dropped after next() is closed at once, and closing httpx's
        # stream closes the connection, so the server aborted the request before the check below could see it run.
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[6:])["choices"][0]["text"], first
        assert server.engine.block_manager.num_used_blocks > 0, first
    other = httpx.post(
        server.url + "/v1/completions",
        timeout=60,
        json={"model": MODEL, "prompt": HI_IDS, "max_tokens": 6, "temperature": 0},
    ).json()
    assert other["choices"][0]["text"] == expected["hi"].text
    assert_no_leaks(server)


def test_non_streaming_client_that_gives_up_aborts_its_request(server):
    """A client that stops waiting for a long non-streamed completion: the server notices the closed
    connection and aborts it, well before its 900 tokens could have been generated."""
    body = {"model": MODEL, "prompt": HI_IDS, "max_tokens": 900, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=httpx.Timeout(60, read=1.0))
    assert_no_leaks(server, timeout=20)


def test_a_bad_seed_is_a_400_and_hurts_nobody(server, expected):
    """seed=2**64 once passed validation and failed every request in flight with a 500."""

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            good = http.post(
                "/v1/completions", json={"model": MODEL, "prompt": HI_IDS, "max_tokens": 6, "temperature": 0}
            )
            bad = http.post("/v1/completions", json={"model": MODEL, "prompt": HI_IDS, "max_tokens": 6, "seed": 2**64})
            return await asyncio.gather(good, bad)

    good, bad = asyncio.run(run())
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "seed"
    assert good.status_code == 200 and good.json()["choices"][0]["text"] == expected["hi"].text
    assert_no_leaks(server)


# ------------------------------------------------------------------------- the whole surface, real and random weights

SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "age"],
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
}
WEATHER = {
    "type": "object",
    "additionalProperties": False,
    "required": ["city"],
    "properties": {"city": {"type": "string", "maxLength": 12}},
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "the weather in a city", "parameters": WEATHER},
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "additionalProperties": False,
                "required": ["a", "b"],
                "properties": {"a": {"type": "integer", "maximum": 999}, "b": {"type": "integer", "maximum": 999}},
            },
        },
    },
]
TOOL_SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def tiny_server():
    from tiny_models import build_tiny_model

    model, tokenizer = build_tiny_model(max_position_embeddings=2048)  # room for the default tools template
    tokenizer.chat_template = "tags"
    engine = LLMEngine(model, tokenizer=tokenizer, num_kv_blocks=512, max_num_seqs=8, log_stats=False)
    with ServerThread(engine, model_name="tiny") as running:
        yield running


@pytest.fixture(scope="module", params=["real", "random"])
def target(request, smollm2):
    """``(client, model name, LLM on the same weights)``: SmolLM2, then the tiny random model."""
    if request.param == "real":
        server = request.getfixturevalue("server")
        model, tokenizer = smollm2
        name = MODEL
    else:
        server = request.getfixturevalue("tiny_server")
        model, tokenizer, name = server.engine.model, server.engine.tokenizer, "tiny"
    llm = LLM(model, tokenizer=tokenizer, num_kv_blocks=128, log_stats=False)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    return client, name, llm


def test_client_n_and_logprobs(target):
    client, name, llm = target
    response = client.completions.create(
        model=name,
        prompt="once upon a time",
        max_tokens=5,
        n=3,
        seed=11,
        logprobs=2,
        extra_body={"return_token_ids": True},
    )
    assert [c.index for c in response.choices] == [0, 1, 2]
    alone = llm.generate(["once upon a time"], SamplingParams(n=3, seed=11, max_tokens=5), use_tqdm=False)[0]
    assert [c.model_extra["token_ids"] for c in response.choices] == [o.token_ids for o in alone.outputs]
    for choice in response.choices:
        assert len(choice.logprobs.token_logprobs) == 5 and all(lp <= 0 for lp in choice.logprobs.token_logprobs)
    chat = client.chat.completions.create(
        model=name, messages=HELLO, max_tokens=4, n=2, seed=3, logprobs=True, top_logprobs=3
    )
    assert len(chat.choices) == 2
    for entry in chat.choices[0].logprobs.content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= entry.top_logprobs[0].logprob + 1e-6


def test_client_penalties_and_logit_bias_are_the_engines(target):
    client, name, llm = target
    knobs = dict(presence_penalty=1.5, frequency_penalty=1.0)
    response = client.completions.create(
        model=name,
        prompt="the the the the",
        max_tokens=8,
        temperature=0,
        extra_body={"repetition_penalty": 1.3, "min_tokens": 8, "return_token_ids": True},
        **knobs,
    )
    expected = llm.generate(
        ["the the the the"],
        SamplingParams(temperature=0, max_tokens=8, repetition_penalty=1.3, min_tokens=8, **knobs),
        use_tqdm=False,
    )[0].outputs[0]
    plain = llm.generate(["the the the the"], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].outputs[0]
    assert response.choices[0].model_extra["token_ids"] == expected.token_ids
    if name == MODEL:  # the real model repeats "the" unpenalised (random weights repeat nothing)
        assert expected.token_ids != plain.token_ids
    biased = client.completions.create(
        model=name, prompt="hi", max_tokens=4, logit_bias={"42": 100}, extra_body={"return_token_ids": True}
    )
    assert biased.choices[0].model_extra["token_ids"] == [42] * 4


# SmolLM2's constrained answers (6-10 s) run in the whole tier; the tiny model keeps each check in the quick tier
REAL_IN_THE_WHOLE_TIER = pytest.mark.parametrize(
    "target", [pytest.param("real", marks=pytest.mark.slow), "random"], indirect=True
)


@REAL_IN_THE_WHOLE_TIER
def test_client_json_schema_regex_and_choice(target):
    jsonschema = pytest.importorskip("jsonschema")
    client, name, _ = target
    messages = [{"role": "user", "content": "Describe a person as JSON with a name and an age."}]
    response = client.chat.completions.create(
        model=name,
        messages=messages,
        max_tokens=60,
        temperature=1.0,
        n=6,
        seed=5,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}},
    )
    for choice in response.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    regex = client.completions.create(
        model=name,
        prompt="a date:",
        max_tokens=20,
        temperature=1.0,
        seed=1,
        extra_body={"structured_outputs": {"regex": r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"}},
    )
    assert re.fullmatch(r"20[0-9]{2}-[01][0-9]-[0-3][0-9]", regex.choices[0].text)
    choice = client.chat.completions.create(
        model=name,
        messages=HELLO,
        max_tokens=10,
        n=4,
        seed=2,
        extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe"]}},
    )
    assert all(c.message.content in ("yes", "no", "maybe") for c in choice.choices)


@REAL_IN_THE_WHOLE_TIER
def test_client_tools(target):
    jsonschema = pytest.importorskip("jsonschema")
    client, name, _ = target
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    response = client.chat.completions.create(
        model=name,
        messages=messages,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=200,
        n=4,
        seed=9,
    )
    for choice in response.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), TOOL_SCHEMAS[call.function.name])
    named = {"type": "function", "function": {"name": "get_weather"}}
    stream = client.chat.completions.create(
        model=name, messages=messages, tools=TOOLS, tool_choice=named, max_tokens=200, stream=True
    )
    calls = [call for chunk in stream for c in chunk.choices for call in (c.delta.tool_calls or [])]
    assert calls[0].function.name == "get_weather" and {c.index for c in calls} == {0}
    jsonschema.validate(json.loads("".join(c.function.arguments for c in calls)), WEATHER)


def test_tokenize_and_detokenize_over_http(target):
    client, name, _ = target
    base = str(client.base_url).removesuffix("/v1/")
    tokens = httpx.post(base + "/tokenize", json={"model": name, "prompt": SUMMER, "add_special_tokens": False}).json()
    assert httpx.post(base + "/detokenize", json={"model": name, "tokens": tokens["tokens"]}).json() == {
        "prompt": SUMMER
    }
    chat = httpx.post(base + "/tokenize", json={"model": name, "messages": HELLO}).json()
    billed = client.chat.completions.create(model=name, messages=HELLO, max_tokens=1).usage.prompt_tokens
    assert chat["count"] == billed

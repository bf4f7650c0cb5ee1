"""The server's edges, on the tiny random model in-process (``TestClient``): nothing silently
ignored, every error in OpenAI's shape, limits before work, the door.

Each test here failed on the server before: fields such as ``response_format`` were ignored,
temperature NaN sampled as 1.0, a lone surrogate gave a 500, malformed JSON named a byte offset as
``param``, 404/405 came in FastAPI's shape, a 50 MB body was parsed and tokenized on the event loop,
and there was no key.
"""

from __future__ import annotations

import json
import logging
import re
import threading

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from lifeofprompt.engine.llm_engine import LLMEngine  # noqa: E402
from lifeofprompt.engine.sampling_params import SamplingParams  # noqa: E402
from lifeofprompt.serving.limits import ServerLimits  # noqa: E402
from lifeofprompt.serving.server import ServerConfig, build_app, serve  # noqa: E402

LIMIT = 64 * 1024


def tiny_engine(tiny_model, **kwargs):
    model, tokenizer = tiny_model
    tokenizer = type(tokenizer)(tokenizer.vocab_size)
    tokenizer.chat_template = "tags"  # ByteTokenizer.apply_chat_template: <role>\ncontent\n
    return LLMEngine(model, tokenizer=tokenizer, num_kv_blocks=64, max_num_seqs=4, log_stats=False, **kwargs)


@pytest.fixture(scope="module")
def http(tiny_model):
    app = build_app(tiny_engine(tiny_model), model_name="tiny", config=ServerConfig(limits=ServerLimits(LIMIT)))
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client


def post(http, path, body, **kwargs):
    return http.post(
        path,
        content=json.dumps(body) if not isinstance(body, (bytes, str)) else body,
        headers={"content-type": "application/json", **kwargs.pop("headers", {})},
        **kwargs,
    )


def assert_openai_error(response, status, param="unset"):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param != "unset":
        assert error["param"] == param, error
    return error


COMPLETION = {"model": "tiny", "prompt": "hello", "max_tokens": 4}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


@pytest.mark.parametrize(
    "path, extra, param",
    [
        ("/v1/chat/completions", {"response_format": {"type": "xml"}}, "response_format"),
        (
            "/v1/chat/completions",
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format",
        ),
        (
            "/v1/chat/completions",
            {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "sometimes"},
            "tool_choice",
        ),
        ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),
        ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/completions", {"logit_bias": {"5": 101}}, "logit_bias"),
        ("/v1/completions", {"logit_bias": {"x": 1}}, "logit_bias"),
        ("/v1/completions", {"logit_bias": {"300": 1}}, "logit_bias"),
        ("/v1/completions", {"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
        ("/v1/completions", {"logprobs": 21}, "logprobs"),
        ("/v1/completions", {"n": 100}, "n"),
        ("/v1/completions", {"best_of": 2}, "best_of"),
        ("/v1/completions", {"presence_penalty": 2.5}, "presence_penalty"),
        ("/v1/completions", {"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ("/v1/completions", {"guided_json": {"type": "object"}, "guided_regex": "a+"}, "guided_regex"),
        (
            "/v1/completions",
            {
                "structured_outputs": {
                    "regex": "(",
                }
            },
            "structured_outputs.regex",
        ),
        ("/v1/completions", {"suffix": " and so on"}, "suffix"),
    ],
)
def test_unsupported_fields_and_bad_values_are_refused_by_name(http, path, extra, param):
    base = CHAT if "chat" in path else COMPLETION
    assert_openai_error(post(http, path, {**base, **extra}), 400, param)


def test_penalties_logit_bias_and_min_tokens_are_served(http):
    ids = lambda extra: post(
        http,
        "/v1/completions",
        {
            **COMPLETION,
            "max_tokens": 6,
            "temperature": 0,  # noqa: E731
            "return_token_ids": True,
            **extra,
        },
    ).json()["choices"][0]["token_ids"]
    assert ids({"logit_bias": {"7": 100}}) == [7] * 6
    assert (
        len(ids({"presence_penalty": 1.5, "frequency_penalty": 1.0, "repetition_penalty": 1.2, "min_tokens": 6})) == 6
    )


def test_neutral_values_of_unsupported_fields_are_fine(http):
    ok = post(
        http,
        "/v1/chat/completions",
        {
            **CHAT,
            "response_format": {"type": "text"},
            "tool_choice": "none",
            "logprobs": False,
            "logit_bias": {},
            "n": 1,
            "user": "me",
            "store": False,
        },
    )
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("raw", ["NaN", "Infinity", "-Infinity"])
def test_temperature_nan_and_inf_are_refused(http, raw):
    body = f'{{"model": "tiny", "prompt": "hello", "max_tokens": 4, "temperature": {raw}}}'
    assert_openai_error(post(http, "/v1/completions", body), 400, "temperature")


def test_tiny_temperatures_are_greedy_or_clamped(http):
    assert SamplingParams(temperature=1e-320).temperature == 0 and SamplingParams(temperature=9e-6).greedy
    assert SamplingParams(temperature=1e-5).temperature == SamplingParams(temperature=0.005).temperature == 0.01
    ids = lambda t: post(
        http,
        "/v1/completions",
        {
            **COMPLETION,
            "max_tokens": 8,
            "temperature": t,  # noqa: E731
            "return_token_ids": True,
        },
    ).json()["choices"][0]["token_ids"]
    assert ids(1e-320) == ids(0)


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", '{"prompt": "a\\ud800b", "max_tokens": 2}', "prompt"),
        ("/v1/completions", '{"prompt": ["ok", "\\udfff"], "max_tokens": 2}', "prompt.1"),
        (
            "/v1/chat/completions",
            '{"messages": [{"role": "user", "content": "\\ud83d"}], "max_tokens": 2}',
            "messages.0.content",
        ),
    ],
)
def test_lone_surrogates_are_a_400(http, path, body, param):
    assert_openai_error(post(http, path, body), 400, param)


def test_undecodable_bytes_are_a_400(http):
    error = assert_openai_error(post(http, "/v1/completions", b'{"prompt": "\xff\xfe", "max_tokens": 2}'), 400)
    assert "UTF-8" in error["message"]


def test_malformed_json_says_where(http):
    error = assert_openai_error(post(http, "/v1/completions", '{"prompt": "hi",\n "max_tokens": 2,,}'), 400, None)
    assert "line 2, column 18" in error["message"], error  # the second comma


@pytest.mark.parametrize(
    "method, path, status",
    [("GET", "/v1/nowhere", 404), ("DELETE", "/v1/completions", 405), ("GET", "/v1/completions", 405)],
)
def test_fastapi_own_errors_come_in_openai_shape(http, method, path, status):
    assert_openai_error(http.request(method, path), status)


def test_validation_errors_are_400_in_openai_shape(http):
    error = assert_openai_error(post(http, "/v1/chat/completions", {"messages": [{"role": "wizard"}]}), 400)
    assert error["param"] == "messages.0.role"
    assert_openai_error(post(http, "/v1/completions", "[1, 2]"), 400)


# ----------------------------------------------------------------------------- limits before work


def test_a_body_over_the_limit_is_413_before_parsing(http, monkeypatch):
    big = json.dumps({**COMPLETION, "junk": "x" * LIMIT})
    monkeypatch.setattr(json, "loads", lambda *a, **k: pytest.fail("the body was parsed"))
    response = post(http, "/v1/completions", big)
    monkeypatch.undo()
    assert_openai_error(response, 413)


def test_a_chunked_body_over_the_limit_is_413(http):
    chunks = (b'{"prompt": "' if i == 0 else b"y" * 4096 for i in range(LIMIT // 4096 + 2))
    response = http.post("/v1/completions", content=chunks, headers={"content-type": "application/json"})
    assert_openai_error(response, 413)


def test_an_absurd_prompt_is_refused_without_tokenizing(http, monkeypatch):
    tokenizer = http.app.state.prompt_tokenizer.tokenizer
    assert tokenizer is not http.app.state.engine.tokenizer, "the server tokenizes on its own instance"
    monkeypatch.setattr(tokenizer, "encode", lambda *a, **k: pytest.fail("the prompt was tokenized"))
    too_long = "z" * (http.app.state.engine.max_model_len + 1)  # one character a token at least
    assert_openai_error(post(http, "/v1/completions", {**COMPLETION, "prompt": too_long}), 413, "prompt")


def test_prompts_are_tokenized_off_the_event_loop(http, monkeypatch):
    tokenizer = http.app.state.prompt_tokenizer.tokenizer
    threads, encode = [], tokenizer.encode

    def spy(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return encode(*args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", spy)
    assert post(http, "/v1/completions", COMPLETION).status_code == 200
    assert threads and all(name.startswith("lifeofprompt-tokenize") for name in threads)


def test_prompts_per_request_and_stop_strings_are_capped(http):
    assert_openai_error(post(http, "/v1/completions", {**COMPLETION, "prompt": ["a"] * 65}), 400, "prompt")
    assert_openai_error(post(http, "/v1/completions", {**COMPLETION, "stop": ["x"] * 17}), 400, "stop")


# ----------------------------------------------------------------------------- the door


@pytest.fixture(scope="module")
def locked(tiny_model):
    config = ServerConfig(api_key="sekrit", allowed_origins=["https://ok.example"])
    with TestClient(build_app(tiny_engine(tiny_model), model_name="tiny", config=config)) as client:
        yield client


@pytest.mark.parametrize(
    "headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekrit"}, {"Authorization": "Bearer sekrit2"}]
)
def test_the_api_key_is_required_on_v1(locked, headers):
    for path in ("/v1/models", "/v1/completions"):
        response = locked.request("GET" if path == "/v1/models" else "POST", path, headers=headers, json=COMPLETION)
        error = assert_openai_error(response, 401)
        assert error["code"] == "invalid_api_key"


def test_the_right_key_opens_and_health_and_metrics_stay_open(locked):
    assert locked.get("/v1/models", headers={"Authorization": "Bearer sekrit"}).status_code == 200
    ok = locked.post("/v1/completions", json=COMPLETION, headers={"Authorization": "Bearer sekrit"})
    assert ok.status_code == 200, ok.text
    assert locked.get("/health").status_code == 200 and locked.get("/metrics").status_code == 200


def test_docs_are_off_unless_enabled(http, tiny_model):
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert_openai_error(http.get(path), 404)
    app = build_app(tiny_engine(tiny_model), config=ServerConfig(enable_docs=True))
    with TestClient(app) as client:
        assert client.get("/openapi.json").status_code == 200 and client.get("/docs").status_code == 200


def test_cors_is_off_unless_origins_are_allowed(http, locked):
    preflight = {"Origin": "https://ok.example", "Access-Control-Request-Method": "POST"}
    assert "access-control-allow-origin" not in http.options("/v1/completions", headers=preflight).headers
    allowed = locked.options("/v1/completions", headers=preflight)
    assert allowed.headers.get("access-control-allow-origin") == "https://ok.example"
    other = locked.options("/v1/completions", headers={**preflight, "Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in other.headers


def test_binding_beyond_loopback_without_a_key_warns(tiny_model, monkeypatch, caplog):
    import uvicorn

    monkeypatch.setattr(uvicorn.Server, "run", lambda self, *a, **k: None)
    engine = tiny_engine(tiny_model)
    with caplog.at_level(logging.WARNING, logger="lifeofprompt.server"):
        serve(engine, host="0.0.0.0", port=1)
        serve(engine, host="127.0.0.1", port=1)
        serve(engine, host="0.0.0.0", port=1, config=ServerConfig(api_key="k"))
    warnings = [r for r in caplog.records if "without an API key" in r.getMessage()]
    assert len(warnings) == 1 and "0.0.0.0" in warnings[0].getMessage()


def test_response_format_json_schema_gives_json_that_validates(http):
    import jsonschema

    schema = {
        "type": "object",
        "required": ["word"],
        "additionalProperties": False,
        "properties": {"word": {"type": "string", "maxLength": 6}},
    }
    for seed in range(5):
        reply = post(
            http,
            "/v1/chat/completions",
            {
                **CHAT,
                "max_tokens": 200,
                "temperature": 1.0,
                "seed": seed,
                "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": schema}},
            },
        )
        assert reply.status_code == 200, reply.text
        jsonschema.validate(json.loads(reply.json()["choices"][0]["message"]["content"]), schema)
    regex = post(http, "/v1/completions", {**COMPLETION, "max_tokens": 20, "structured_outputs": {"regex": "[0-9]{4}"}})
    assert re.fullmatch("[0-9]{4}", regex.json()["choices"][0]["text"])

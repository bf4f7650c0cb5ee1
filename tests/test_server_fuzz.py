"""Fuzzing the server with schemathesis over its own OpenAPI schema, in-process (ASGI).

The schema is ``app.openapi()`` (``/openapi.json`` is off by default): response models for every
endpoint and OpenAI's error schema on 400 (where FastAPI would document its 422), 401, 404, 413,
500 and 503, so that "every response conforms" means something. About 30 examples an operation,
on the tiny random model, with ``max_tokens`` capped so each example takes milliseconds.
``stream=true`` is turned off in every generated body: the event stream is not documented in the
schema (tests/test_server.py checks it).

Checks: no 5xx, and every response's status, content type, headers and body conform to the schema.
Not checked: whether schema-valid bodies are accepted (many ask for what we refuse by name, such as
``suffix`` or ``best_of``) or schema-invalid ones refused (unknown fields are accepted, as OpenAI does).
"""

from __future__ import annotations

import zlib

import pytest

schemathesis = pytest.importorskip("schemathesis")
pytest.importorskip("fastapi")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis_counts import examples  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from tiny_models import build_tiny_model  # noqa: E402

from lifeofprompt.engine.llm_engine import LLMEngine  # noqa: E402
from lifeofprompt.serving.openai_protocol import UNSUPPORTED  # noqa: E402
from lifeofprompt.serving.server import build_app  # noqa: E402

MAX_TOKENS = 4
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]


def fuzzed_app():
    """Built at import: schemathesis' lazy fixture loader does not run under this pytest (it reads a
    private attribute pytest 9 no longer has); the tiny model builds in milliseconds."""
    model, tokenizer = build_tiny_model()
    tokenizer.chat_template = "tags"
    engine = LLMEngine(model, tokenizer=tokenizer, num_kv_blocks=64, max_num_seqs=4, log_stats=False)
    return build_app(engine, model_name="tiny")


APP = fuzzed_app()
schema = schemathesis.openapi.from_dict(APP.openapi())
schema.app = APP


def tame(case) -> None:
    """No streams, few tokens: every example answers in milliseconds. And so that examples reach the
    engine rather than stop at the first check: the served model's name, and in every other example
    the fields we refuse by name (tests/test_server_limits.py) left out."""
    if isinstance(case.body, dict):
        if "model" in case.body:
            case.body["model"] = "tiny"
        if zlib.crc32(repr(sorted(case.body.items(), key=str)).encode()) % 2:
            for name in UNSUPPORTED:
                case.body.pop(name, None)
        if "stream" in case.body:
            case.body["stream"] = False
        for name in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
            value = case.body.get(name)
            if isinstance(value, int) and not isinstance(value, bool) and value > MAX_TOKENS:
                case.body[name] = MAX_TOKENS
        if "input" in case.body:  # /v1/responses
            case.body.setdefault("max_output_tokens", MAX_TOKENS)
        elif "max_tokens" not in case.body and "max_completion_tokens" not in case.body:
            case.body["max_tokens"] = MAX_TOKENS


# One test per operation, named by it: schemathesis' own ``schema.parametrize()`` gives all ten the same node id,
# which pytest-xdist's scheduler reads as one test, so under two workers only one operation was fuzzed.
OPERATIONS = [result.ok() for result in schema.get_all_operations()]


@pytest.mark.slow
@pytest.mark.parametrize("operation", OPERATIONS, ids=lambda operation: operation.label)
def test_the_server_never_fails_and_always_conforms(operation):
    @settings(max_examples=examples(30), deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(case=operation.as_strategy())
    def fuzz(case):
        tame(case)
        case.call_and_validate(checks=CHECKS)

    fuzz()


def test_every_route_is_fuzzed():
    assert {operation.label for operation in OPERATIONS} >= {
        "POST /v1/completions",
        "POST /v1/chat/completions",
        "POST /v1/responses",
        "POST /tokenize",
        "POST /detokenize",
        "GET /v1/models",
        "GET /health",
    }

"""lessons/door.py (chapter 12's production door): raw HTTP answers from a locked server on loopback,
the tiny random model behind it."""

from __future__ import annotations

from collections import Counter

import pytest

pytest.importorskip("fastapi")

from lifeofprompt.engine.llm_engine import LLMEngine  # noqa: E402
from lifeofprompt.lessons import door  # noqa: E402
from lifeofprompt.lessons.server_thread import ServerThread  # noqa: E402
from lifeofprompt.serving.limits import ServerLimits  # noqa: E402
from lifeofprompt.serving.server import ServerConfig  # noqa: E402

KEY = "sk-test"


@pytest.fixture(scope="module")
def locked(tiny_model):
    model, tokenizer = tiny_model
    engine = LLMEngine(model, tokenizer=tokenizer, num_kv_blocks=64, max_num_seqs=2, max_waiting=2, log_stats=False)
    with ServerThread(
        engine, model_name="tiny", config=ServerConfig(api_key=KEY, limits=ServerLimits(4096), shutdown_timeout=5)
    ) as server:
        yield server


ASK = {"model": "tiny", "prompt": "hello", "max_tokens": 4, "temperature": 0}


def test_without_the_key_a_401_in_openais_shape_and_with_it_a_200(locked):
    refused = door.post(locked.url, "/v1/completions", ASK)
    assert refused.status == 401 and set(refused.error) == {"message", "type", "param", "code"}
    assert door.post(locked.url, "/v1/completions", ASK, api_key="wrong").status == 401
    answered = door.post(locked.url, "/v1/completions", ASK, api_key=KEY)
    assert answered.status == 200 and answered.error == {} and answered.body["choices"][0]["finish_reason"]
    assert door.get(locked.url, "/health").status == 200 and door.get(locked.url, "/v1/models").status == 401


def test_a_body_over_the_limit_is_a_413(locked):
    answer = door.post(locked.url, "/v1/completions", dict(ASK, prompt="a" * 5000), api_key=KEY)
    assert answer.status == 413 and "--max-request-bytes" in answer.error["message"]
    raw = door.post(locked.url, "/v1/completions", content=b"{" * 5000, api_key=KEY)
    assert raw.status == 413


def test_a_crowd_fills_the_seats_and_the_queue_then_gets_503_with_retry_after(locked):
    # 400 tokens each: the first four are still running or queued when the last of the eight arrives
    crowd = door.burst(locked.url, "/v1/completions", dict(ASK, max_tokens=400, ignore_eos=True), 8, api_key=KEY)
    counts = Counter(a.status for a in crowd)
    assert counts[503] >= 1 and counts[200] >= 4 and set(counts) <= {200, 503}, counts
    assert all(a.retry_after and a.retry_after.isdigit() for a in crowd if a.status == 503)

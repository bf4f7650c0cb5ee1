"""Graceful shutdown, on a real server process on loopback: SIGTERM, then queued requests are aborted
at once, running ones get ``--shutdown-timeout`` to finish and are then aborted, and the process
exits. Aborted requests end with finish_reason "abort", which the official client takes.

Before, SIGTERM waited for every request in flight and in the queue to run to completion (53 s
seen). The server here runs the tiny random model with a step slowed to 20 ms, so that its one
running request is still running when the 2-second timeout ends; every wait is bounded.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from fastapi.testclient import TestClient  # noqa: E402

from lifeofprompt.lessons.server_thread import free_port  # noqa: E402
from lifeofprompt.serving.server import build_app  # noqa: E402

SERVER = """
import sys, time
sys.path.insert(0, {tests!r})
from tiny_models import build_tiny_model
from lifeofprompt.engine.llm_engine import LLMEngine
from lifeofprompt.serving.server import ServerConfig, serve

model, tokenizer = build_tiny_model(max_position_embeddings=1024)
engine = LLMEngine(model, tokenizer=tokenizer, num_kv_blocks=128, max_num_seqs=1, log_stats=False)
step = engine.step
engine.step = lambda: (time.sleep(0.02), step())[1]        # 20 ms a step: 500 tokens take 10 s
serve(engine, port={port}, model_name="tiny", config=ServerConfig(shutdown_timeout=2.0), log_level="warning")
"""
LONG = {"model": "tiny", "prompt": "hello", "max_tokens": 500, "temperature": 0, "extra_body": {"ignore_eos": True}}


def wait_for(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def metric(url: str, name: str) -> float:
    line = next(line for line in httpx.get(url + "/metrics").text.splitlines() if line.startswith(name + " "))
    return float(line.split()[-1])


@pytest.fixture
def server_process(tmp_path):
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1]), "LIFEOFPROMPT_TEST_THREADS": "1"}
    log = open(tmp_path / "server.log", "w+")
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVER.format(tests=str(Path(__file__).parent), port=port)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"

    def up():
        assert proc.poll() is None, (tmp_path / "server.log").read_text()
        try:
            return httpx.get(url + "/health").status_code == 200
        except httpx.TransportError:
            return False

    wait_for(up, 120, "the server to start")
    try:
        yield proc, url, tmp_path / "server.log"
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        log.close()


def test_sigterm_aborts_queued_now_running_after_the_timeout_then_exits(server_process):
    proc, url, log = server_process
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    streamed, results = [], {}

    def running():
        for chunk in client.completions.create(stream=True, **LONG):
            streamed.append(chunk.choices[0])

    def queued():
        results["queued"] = client.completions.create(**LONG)
        results["streamed_when_queued_ended"] = len(streamed)

    first = threading.Thread(target=running)
    first.start()
    wait_for(lambda: len(streamed) >= 3, 60, "the running request's first tokens")
    second = threading.Thread(target=queued)
    second.start()
    wait_for(lambda: metric(url, "lifeofprompt_num_requests_waiting") == 1, 30, "the second request to queue")

    proc.send_signal(signal.SIGTERM)
    second.join(30)
    first.join(60)
    assert not second.is_alive() and not first.is_alive()
    queued_choice = results["queued"].choices[0]
    assert queued_choice.finish_reason == "abort" and results["queued"].usage.completion_tokens == 0
    assert streamed[-1].finish_reason == "abort", "the running request was aborted at the timeout"
    tokens = "".join(c.text for c in streamed)
    assert 0 < len(streamed) - 1 < LONG["max_tokens"] and tokens
    assert len(streamed) > results["streamed_when_queued_ended"], "the running request ran on after the queued ended"
    assert proc.wait(30) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once it has drained
    with pytest.raises(httpx.TransportError):
        httpx.get(url + "/health", timeout=2)
    # and it said so on stderr (before, the server's logger had no handler: its INFO lines were dropped)
    said = log.read_text()
    assert "server: door: API key off;" in said and "queue: 1 running + 4 waiting" in said
    assert "INFO" in said and "server: shutting down: queued requests aborted now, running ones in 2 s at most" in said


def test_while_draining_new_requests_get_503_and_health_says_so(tiny_model):
    from lifeofprompt.engine.llm_engine import LLMEngine

    model, tokenizer = tiny_model
    app = build_app(LLMEngine(model, tokenizer=tokenizer, num_kv_blocks=16, log_stats=False), model_name="tiny")
    with TestClient(app) as http:
        app.state.engine_loop.begin_shutdown(timeout=5)
        refused = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert refused.status_code == 503 and refused.headers["retry-after"]
        assert refused.json()["error"]["type"] == "server_shutting_down"
        assert http.get("/health").status_code == 503

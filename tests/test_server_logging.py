"""What the server says on stderr: its warnings, one line naming the door's settings, its shutdown.

Before, the ``lifeofprompt.server`` logger had no handler, so Python printed its warnings bare and
dropped every INFO line (the shutdown line never showed), the engine's lines said INFO whatever
their level, and nothing said how the door was set.
"""

from __future__ import annotations

import io
import logging
from contextlib import contextmanager

import pytest

pytest.importorskip("fastapi")

from lifeofprompt.engine.logs import log_to_stderr, stderr_handler  # noqa: E402


def record(level: int, message: str) -> logging.LogRecord:
    return logging.LogRecord("lifeofprompt.engine", level, __file__, 1, message, (), None)


def test_the_engines_lines_carry_their_own_level():
    from lifeofprompt.engine.llm_engine import logger

    handler = next(h for h in logger.handlers if type(h) is logging.StreamHandler)  # ours, not pytest's
    assert handler.format(record(logging.WARNING, "request r1 failed")).startswith("WARNING ")
    assert handler.format(record(logging.INFO, "KV cache: 4 blocks")).startswith("INFO ")
    assert handler.format(record(logging.ERROR, "x")).split()[2] == "engine:"


@contextmanager
def no_logging_setup(log: logging.Logger):
    """No handler on the root logger nor on ``log``, as in ``python -m lifeofprompt serve``; pytest's own
    handlers (which it adds as each test starts) and ``log``'s settings are put back after."""
    root = logging.getLogger()
    saved = root.handlers[:], log.handlers[:], log.level, log.propagate
    root.handlers.clear()
    log.handlers.clear()
    try:
        yield root
    finally:
        root.handlers[:], log.handlers[:] = saved[0], saved[1]
        log.setLevel(saved[2])
        log.propagate = saved[3]


FRESH = logging.getLogger("lifeofprompt.test-server-logging")


def test_log_to_stderr_adds_a_handler_only_where_none_is_configured():
    stream = io.StringIO()
    with no_logging_setup(FRESH):
        assert log_to_stderr(FRESH, "server", stream)
        FRESH.info("shutting down")
        FRESH.debug("not shown")
        assert not log_to_stderr(FRESH, "server", io.StringIO())  # it has one now
        assert len(FRESH.handlers) == 1
    assert stream.getvalue().startswith("INFO ") and stream.getvalue().rstrip().endswith("server: shutting down")
    assert len(stream.getvalue().splitlines()) == 1


def test_a_program_that_set_logging_up_keeps_its_own():
    with no_logging_setup(FRESH) as root:
        root.addHandler(stderr_handler("app", io.StringIO()))
        assert not log_to_stderr(FRESH, "server", io.StringIO())
        assert FRESH.handlers == [] and FRESH.propagate


def test_serve_logs_the_exposure_the_door_and_the_shutdown(tiny_model, monkeypatch, capsys):
    from lifeofprompt.engine.llm_engine import LLMEngine
    from lifeofprompt.serving import server
    from lifeofprompt.serving.limits import ServerLimits

    class Uvicorn:  # instead of a real one: "runs", then gets SIGTERM
        def __init__(self, app):
            self.app = app

        def run(self):
            self.app.state.engine_loop.begin_shutdown(7.0)

    monkeypatch.setattr(server, "uvicorn_server", lambda app, *args: Uvicorn(app))
    model, tokenizer = tiny_model
    engine = LLMEngine(
        model, tokenizer=tokenizer, num_kv_blocks=16, max_num_seqs=2, max_num_batched_tokens=256, log_stats=False
    )
    config = server.ServerConfig(limits=ServerLimits(max_request_bytes=2**20), shutdown_timeout=7.0)
    with no_logging_setup(server.logger):
        server.serve(engine, host="0.0.0.0", port=1, config=config)
    lines = [line for line in capsys.readouterr().err.splitlines() if " server: " in line]
    warning, door, shutdown = lines
    assert warning.startswith("WARNING ") and "server: binding '0.0.0.0' without an API key" in warning
    assert door.startswith("INFO ") and "server: door: API key off;" in door
    for part in (
        "docs off",
        "CORS off",
        "bodies up to 1 MiB",
        "up to 64 prompts",
        "n <= 16",
        "queue: 2 running + 8 waiting, then 503",
        "fair prefill: a prompt's chunk at most 64 of 256 tokens",
        "running requests get 7 s",
    ):
        assert part in door, (part, door)
    assert shutdown.startswith("INFO ") and "server: shutting down: queued requests aborted now" in shutdown


def test_the_door_line_names_a_key_and_fair_prefill_off(tiny_model):
    from lifeofprompt.engine.llm_engine import LLMEngine
    from lifeofprompt.serving.server import ServerConfig, door_settings

    model, tokenizer = tiny_model
    engine = LLMEngine(
        model,
        tokenizer=tokenizer,
        num_kv_blocks=16,
        max_num_batched_tokens=256,
        long_prefill_token_threshold=0,
        log_stats=False,
    )
    line = door_settings(engine, ServerConfig(api_key="k", enable_docs=True, allowed_origins=["http://a.example"]))
    assert line.startswith(
        "door: API key on (/v1/*, /tokenize, /detokenize, /tokenizer_info; /health and /metrics open); docs on; "
        "CORS for http://a.example;"
    )
    assert "bodies up to 4 MiB" in line and "256 running + unbounded waiting" in line  # build_app bounds it, not this
    assert "fair prefill: off (a prompt's chunk may take all 256 tokens of a step)" in line

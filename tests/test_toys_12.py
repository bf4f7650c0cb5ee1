"""Chapter 12's toy server loop, run against the package outside the notebook.

The toy (``# toy: server loop``) keeps requests in an inbox, runs the engine's steps in one background task and
streams each request's tokens from its own queue; its check (``# check: server loop``) asserts that it gives
``LLM.generate``'s tokens, and the notebook's next cell asserts that the package's HTTP server gives the same. Here
both cells run as the notebook holds them, on the tiny random model (a step takes about a millisecond), with the
server cell after them; the ``broken`` tests change one rule of the toy and expect the check to fail.
"""

from __future__ import annotations

import ast
import asyncio
import inspect

import pytest
from test_notebook_toys import broken, cell_sources

pytest.importorskip("openai")
pytest.importorskip("fastapi")

NOTEBOOK = "12_server.ipynb"
TOY, CHECK = "# toy: server loop", "# check: server loop"
SERVED = "from lifeofprompt.lessons.server_thread import ServerThread"


def run_with_await(sources: list[str], namespace: dict) -> dict:
    """Run notebook cells that may ``await`` at top level (as IPython allows) in one namespace."""
    for i, source in enumerate(sources):
        code = compile(source, f"<12 cell {i}>", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
        result = eval(code, namespace)
        if inspect.iscoroutine(result):
            asyncio.run(result)
    return namespace


def setup_namespace() -> dict:
    from tiny_models import build_tiny_model

    from lifeofprompt import LLM, LLMEngine, SamplingParams
    from lifeofprompt.story import STORY_PROMPTS

    model, tokenizer = build_tiny_model()
    greedy = SamplingParams(temperature=0, max_tokens=12)
    return dict(
        __name__="server",
        model=model,
        tokenizer=tokenizer,
        LLM=LLM,
        LLMEngine=LLMEngine,
        SamplingParams=SamplingParams,
        STORY_PROMPTS=STORY_PROMPTS,
        greedy=greedy,
    )


def test_the_toy_server_streams_the_engines_tokens_and_the_real_server_agrees():
    toy, check, served = cell_sources(NOTEBOOK, TOY, CHECK, SERVED)
    ns = run_with_await([toy, check], setup_namespace())
    assert len(ns["toy_tokens"]) == 3 and all(len(t) == 12 for t in ns["toy_tokens"])
    try:
        run_with_await([served], ns)  # starts the package's server on loopback and asserts its tokens are the toy's
        assert ns["served_tokens"] == ns["toy_tokens"]
    finally:
        if "server" in ns:
            ns["server"].stop()


@pytest.mark.parametrize(
    "old, new",
    [
        # every output goes to every request's queue instead of its own
        (
            "streams[out.request_id].put_nowait(out.outputs[0].new_token_ids)",
            "[q.put_nowait(out.outputs[0].new_token_ids) for q in streams.values()]",
        ),
        ("tokens += chunk", "tokens = chunk"),  # a client keeps only the last chunk it was streamed
    ],
    ids=["broadcast", "last-chunk-only"],
)
def test_the_server_loop_check_fails_on_a_broken_toy(old, new):
    toy, check = cell_sources(NOTEBOOK, TOY, CHECK)
    with pytest.raises(AssertionError):
        run_with_await(broken([toy, check], old, new), setup_namespace())

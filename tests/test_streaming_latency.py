"""Chunked prefill as the users already streaming see it: counted in steps and tokens, not seconds
(the seconds are chapter 09's measurement)."""

from __future__ import annotations

import math

import pytest
from tiny_models import build_tiny_model

from lifeofprompt.engine.llm_engine import LLMEngine
from lifeofprompt.lessons.streaming_latency import (
    chunked_budget,
    decode_gaps_beside_prefill,
    gaps_table,
    unchunked_budget,
)

LONG, STREAMS, CHUNK = 600, 3, 64


@pytest.fixture(scope="module")
def model_1k():
    return build_tiny_model(max_position_embeddings=1024)


def run(model_1k, settings, label):
    model, tokenizer = model_1k
    engine = LLMEngine(
        model, tokenizer=tokenizer, num_kv_blocks=128, log_stats=False, check_invariants=True, **settings
    )
    gaps = decode_gaps_beside_prefill(engine, LONG, num_streams=STREAMS, steady_tokens=4, label=label)
    assert not engine.has_unfinished_requests()  # the streams were aborted, the long one finished
    return gaps


def test_without_chunking_the_prompt_is_one_step_and_the_streams_get_one_token_across_it(model_1k):
    gaps = run(model_1k, unchunked_budget(LONG, STREAMS), "whole prompt")
    assert gaps.prefill_chunks == [LONG]
    assert len(gaps.during_gaps_s) == 1  # one gap spans the whole prefill
    assert len(gaps.before_gaps_s) >= 2
    assert set(gaps.token_times) and all(len(t) >= 5 for t in gaps.token_times.values())


def test_with_chunking_the_streams_get_a_token_every_chunk(model_1k):
    gaps = run(model_1k, chunked_budget(CHUNK, STREAMS), "chunked")
    assert gaps.prefill_chunks == [CHUNK] * (LONG // CHUNK) + [LONG % CHUNK]
    assert len(gaps.during_gaps_s) == math.ceil(LONG / CHUNK)  # a token at the end of every chunk's step
    assert gaps.long_ttft_s > 0 and gaps.worst_gap_s >= gaps.median_gap_s > 0
    table = gaps_table([gaps]).splitlines()
    assert len(table) == 2 and table[1].split()[:3] == [
        "chunked",
        str(len(gaps.prefill_chunks)),
        str(len(gaps.during_gaps_s)),
    ]


def test_the_figure_has_a_panel_per_run_and_a_tick_per_token(model_1k):
    import matplotlib

    matplotlib.use("Agg")
    from lifeofprompt.figures.streaming import plot_stream_gaps

    runs = [
        run(model_1k, unchunked_budget(LONG, STREAMS), "whole prompt"),
        run(model_1k, chunked_budget(CHUNK, STREAMS), "chunked"),
    ]
    fig = plot_stream_gaps(runs, footer="test machine")
    assert len(fig.axes) == 2
    for ax, r in zip(fig.axes, runs):
        ticks = sum(len(c.get_positions()) for c in ax.collections if hasattr(c, "get_positions"))
        assert ticks == sum(len(t) for t in r.token_times.values())
        assert r.label in ax.get_title(loc="left")
    assert any(t.get_text() == "test machine" for t in fig.texts)

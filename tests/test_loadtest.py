"""The load tester against the in-process server: small, bounded runs on the embedded model."""

from __future__ import annotations

import json
import statistics
import time

import pytest

pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from lifeofprompt import latency as metrics  # noqa: E402
from lifeofprompt.cli import main  # noqa: E402
from lifeofprompt.engine.llm_engine import LLMEngine  # noqa: E402
from lifeofprompt.errors import InvalidRequestError  # noqa: E402
from lifeofprompt.lessons.server_thread import ServerThread  # noqa: E402
from lifeofprompt.loadtest import arrivals  # noqa: E402
from lifeofprompt.loadtest.client import LoadTestConfig, make_prompts, parse_length, run_loadtest, waiting_over_time  # noqa: E402


@pytest.fixture(scope="module")
def server(smollm2):
    model, tokenizer = smollm2
    engine = LLMEngine(model, tokenizer=tokenizer, num_kv_blocks=64, max_num_seqs=4, log_stats=False)
    with ServerThread(engine, model_name="smollm2-135m") as running:
        yield running


def assert_idle_and_clean(server):
    engine = server.engine
    assert not engine.requests
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


# ----------------------------------------------------------------------------- the workload


def test_prompts_and_lengths_are_seeded():
    config = LoadTestConfig(arrival="all_at_once", num_requests=5, prompt_len=(3, 9), output_len=(2, 4), seed=7)
    prompts, output_lens = make_prompts(config)
    again, again_lens = make_prompts(config)
    assert prompts == again and output_lens == again_lens
    assert [len(p) for p in prompts] == arrivals.sample_lengths(5, (3, 9), seed=8)
    assert output_lens == arrivals.sample_lengths(5, (2, 4), seed=9)
    assert all(1000 <= t < 30000 for p in prompts for t in p)
    other, _ = make_prompts(LoadTestConfig(arrival="all_at_once", num_requests=5, prompt_len=(3, 9), seed=8))
    assert other != prompts
    words, _ = make_prompts(LoadTestConfig(arrival="all_at_once", num_requests=2, prompt_len=6, prompt_kind="text"))
    assert all(isinstance(w, str) and len(w.split()) == 6 for w in words)


def test_lengths_and_config_are_validated():
    assert parse_length("32") == 32 and parse_length("16:64") == (16, 64)
    with pytest.raises(InvalidRequestError):
        parse_length("lots")
    with pytest.raises(InvalidRequestError):
        LoadTestConfig(arrival="poisson", rate=None)
    with pytest.raises(InvalidRequestError):
        LoadTestConfig(arrival="closed_loop", num_clients=0)
    with pytest.raises(InvalidRequestError):
        LoadTestConfig(endpoint="chat", prompt_kind="ids", arrival="all_at_once")


# ----------------------------------------------------------------------------- against the server


def test_closed_loop_keeps_at_most_n_in_flight(server):
    result = run_loadtest(
        url=server.url + "/v1",
        arrival="closed_loop",
        num_clients=2,
        num_requests=5,
        prompt_len=(4, 8),
        output_len=(2, 4),
        seed=1,
    )
    _, output_lens = make_prompts(result.config)
    prompts, _ = make_prompts(result.config)
    assert [r.index for r in result.records] == [0, 1, 2, 3, 4]
    assert all(r.error is None and r.status == 200 for r in result.records)
    assert [r.num_output_tokens for r in result.records] == output_lens  # ignore_eos: every request runs to its length
    assert [r.num_prompt_tokens for r in result.records] == [len(p) for p in prompts]
    for r in result.records:
        assert r.arrival_time < r.first_token_time <= r.finished_time
        assert 1 <= len(r.token_times) <= r.num_output_tokens
    for r in result.records:  # a client sends its next request only after its last one finished
        overlapping = sum(o.arrival_time <= r.arrival_time < o.finished_time for o in result.records)
        assert overlapping <= 2
    assert result.summary["completed"] == 5 and result.summary["failed"] == 0
    assert result.summary["output_tokens"] == sum(output_lens)
    assert result.num_not_sent == 0
    assert_idle_and_clean(server)


def test_poisson_follows_the_seeded_schedule_and_metrics_summarize(server):
    config = LoadTestConfig(
        url=server.url + "/v1", arrival="poisson", rate=8.0, num_requests=6, prompt_len=4, output_len=3, seed=3
    )
    result = run_loadtest(config)
    schedule = arrivals.poisson(6, 8.0, seed=3).send_times()
    sent = [r.arrival_time - result.start_time for r in result.records]
    assert all(s >= t - 1e-3 for s, t in zip(sent, schedule)), "never sent before its Poisson time"
    assert sorted(sent) == sent
    ok = result.records
    assert all(r.error is None for r in ok)
    # the summary is lifeofprompt.latency' own, over these records
    recomputed = metrics.summarize(ok, duration=result.duration)
    assert json.dumps(result.summary, sort_keys=True) == json.dumps(recomputed, sort_keys=True)  # NaN-aware
    assert result.summary["ttft_s"] == metrics.percentiles(metrics.ttft(r) for r in ok)
    assert result.summary["tpot_s"]["p99"] == metrics.percentiles(metrics.tpot(r) for r in ok)["p99"]
    assert result.summary["achieved_arrival_rate"] == metrics.achieved_arrival_rate(ok)
    times, waiting = waiting_over_time(result)
    assert len(times) == len(waiting) and waiting.max() >= 1 and waiting[-1] == 0
    assert_idle_and_clean(server)


def test_json_output_schema(server, tmp_path):
    path = tmp_path / "run.json"
    code = main(
        [
            "loadtest",
            "--url",
            server.url + "/v1",
            "--clients",
            "2",
            "--num-requests",
            "3",
            "--prompt-len",
            "4",
            "--output-len",
            "2:3",
            "--json",
            str(path),
        ]
    )
    assert code == 0
    doc = json.loads(path.read_text())
    assert doc["schema"] == "lifeofprompt.loadtest/1"
    assert set(doc) == {"schema", "config", "client", "pattern", "num_not_sent", "summary", "requests"}
    assert doc["config"]["arrival"] == "closed_loop" and doc["config"]["num_clients"] == 2
    assert doc["config"]["output_len"] == [2, 3] and "api_key" not in doc["config"]
    assert doc["pattern"] == "3 requests from a closed loop of 2 clients"
    assert {"machine", "torch", "device"} <= set(doc["client"])
    summary = doc["summary"]
    for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        assert set(summary[key]) == {"mean", "p50", "p90", "p99"}
        assert summary[key]["p50"] <= summary[key]["p90"] <= summary[key]["p99"]
    assert (
        summary["completed"] == 3 and summary["queue_s"]["p50"] is None
    )  # the client cannot see the queue: null, not NaN
    assert len(doc["requests"]) == 3
    request = doc["requests"][0]
    assert set(request) == {
        "index",
        "status",
        "error",
        "arrival_time",
        "first_token_time",
        "finished_time",
        "token_times",
        "num_prompt_tokens",
        "num_output_tokens",
        "ttft_s",
        "tpot_s",
        "e2e_s",
    }
    assert request["ttft_s"] == pytest.approx(request["first_token_time"] - request["arrival_time"])
    assert request["num_prompt_tokens"] == 4 and request["num_output_tokens"] in (2, 3)


def test_chat_endpoint_with_text_prompts(server):
    result = run_loadtest(
        url=server.url + "/v1",
        endpoint="chat",
        prompt_kind="text",
        arrival="all_at_once",
        num_requests=2,
        prompt_len=3,
        output_len=3,
    )
    assert [r.error for r in result.records] == [None, None]
    assert [r.num_output_tokens for r in result.records] == [3, 3]
    assert all(r.num_prompt_tokens > 3 for r in result.records)  # the chat template adds its own tokens


def test_errors_are_counted_not_raised(server):
    result = run_loadtest(
        url=server.url + "/v1", model="no-such-model", arrival="all_at_once", num_requests=2, prompt_len=4, output_len=2
    )
    assert [r.status for r in result.records] == [404, 404]
    assert all(r.error.startswith("HTTP 404") for r in result.records)
    assert result.summary["completed"] == 0 and result.summary["failed"] == 2
    json.loads(result.to_json())  # NaN summaries still make valid JSON


def test_stops_by_itself_at_the_time_limit(server):
    """A Poisson run far longer than its limit: later requests are never sent, those in flight are cancelled."""
    result = run_loadtest(
        url=server.url + "/v1",
        arrival="poisson",
        rate=4.0,
        num_requests=40,
        prompt_len=4,
        output_len=400,
        max_duration=0.8,
        seed=0,
    )
    schedule = arrivals.poisson(40, 4.0, seed=0).send_times()
    assert result.num_not_sent == 40 - sum(t < 0.8 for t in schedule) == 35
    assert len(result.records) + result.num_not_sent == 40
    assert all(r.error == "cancelled: the time limit came first" for r in result.records)
    server_loop = server.engine_loop
    deadline = time.monotonic() + 60
    while server.engine.has_unfinished_requests() or server_loop.routes:  # the cancelled streams were aborted
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert_idle_and_clean(server)


# ----------------------------------------------------------------------------- chapter 13's study and figures


def test_time_decode_steps_reads_the_engines_step_records(smollm2):
    from lifeofprompt.lessons.serving_study import time_decode_steps

    model, tokenizer = smollm2
    engine = LLMEngine(model, tokenizer=tokenizer, num_kv_blocks=16, max_num_seqs=4, log_stats=False)
    point = time_decode_steps(engine, 2, prompt_len=4, decode_steps=2)
    records = list(engine.step_records)
    assert [r.num_batched_tokens for r in records] == [8, 2, 2]  # one prefill of 2 × 4, two decode steps
    assert point.batch_size == 2 and point.context_tokens == 2 * (4 + 1 + 1)
    durations = [r.end_time - r.start_time for r in records[1:]]
    assert point.step_s == min(durations) > 0 and point.median_s == statistics.median(durations)
    assert not engine.has_unfinished_requests() and engine.block_manager.num_used_blocks == 0
    narrow = LLMEngine(model, tokenizer=tokenizer, num_kv_blocks=16, max_num_seqs=1, log_stats=False)
    with pytest.raises(RuntimeError, match="max_num_seqs"):
        time_decode_steps(narrow, 2, prompt_len=4, decode_steps=1)
    # A budget too small to prefill both at once (a slow CPU's timed default can be): the first finishes first.
    tight = LLMEngine(model, tokenizer=tokenizer, num_kv_blocks=16, max_num_seqs=4, max_num_batched_tokens=4)
    with pytest.raises(RuntimeError, match=r"max_num_batched_tokens >= 8 \(it has 4\)"):
        time_decode_steps(tight, 2, prompt_len=4, decode_steps=1)


def test_roofline_bend_and_prediction():
    import torch

    from lifeofprompt.lessons import roofline
    from lifeofprompt.lessons.serving_study import BatchPoint, bend_batch_size, predicted_curve
    from lifeofprompt.lessons.story_model import SMOLLM2_135M

    machine = roofline.Machine("test", bandwidth=10e9, flops=50e9, overhead_s=0.01)
    bend = bend_batch_size(machine, SMOLLM2_135M, torch.float32, context_per_seq=20)
    assert bend == 11  # break-even 5 FLOP/byte over ~0.5 FLOP/byte per float32 sequence
    for batch, compute_bound in ((bend - 1, False), (bend, True)):
        nbytes, flops = roofline.step_bytes_and_flops(SMOLLM2_135M, torch.float32, batch, 20 * batch, batch)
        assert (flops / machine.flops >= nbytes / machine.bandwidth) == compute_bound
    points = [BatchPoint(1, 0.1, 20), BatchPoint(32, 0.5, 640)]
    assert predicted_curve(machine, SMOLLM2_135M, torch.float32, points) == [
        roofline.predict_step_time(machine, SMOLLM2_135M, torch.float32, 1, 20, 1),
        roofline.predict_step_time(machine, SMOLLM2_135M, torch.float32, 32, 640, 32),
    ]


def _fake_result(rate, seed, ttfts):
    from lifeofprompt.loadtest.client import LoadTestResult, RequestRecord

    config = LoadTestConfig(arrival="poisson", rate=rate, num_requests=len(ttfts), seed=seed)
    records = [
        RequestRecord(
            arrival_time=i / rate,
            first_token_time=i / rate + t,
            finished_time=i / rate + t + 1.0,
            token_times=[i / rate + t, i / rate + t + 1.0],
            num_output_tokens=2,
            index=i,
            status=200,
        )
        for i, t in enumerate(ttfts)
    ]
    return LoadTestResult(config, records, 0.0, len(ttfts) + 2.0, 0, metrics.summarize(records))


def test_serving_figures_label_axes_and_name_the_machine():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from lifeofprompt.figures.serving import (
        plot_batching_curve,
        plot_queue_growth,
        plot_repeats,
        plot_ttft_against_rate,
    )
    from lifeofprompt.lessons.serving_study import BatchPoint

    sweep = [_fake_result(0.5, 0, [0.1, 0.2, 0.3]), _fake_result(2.0, 0, [0.5, 2.0, 4.0])]
    figures = [
        plot_batching_curve([BatchPoint(1, 0.1, 20), BatchPoint(2, 0.12, 40)], [0.1, 0.11], 0.05, label="machine X"),
        plot_ttft_against_rate(sweep, capacity=1.0, label="machine X"),
        plot_queue_growth(sweep, capacity=1.0, label="machine X"),
        plot_repeats(sweep, label="machine X"),
    ]
    for fig in figures:
        assert any(t.get_text() == "machine X" for t in fig.texts)
        assert any(ax.get_xlabel() for ax in fig.axes)  # panels stacked on one x axis label the last
        for ax in fig.axes:
            if ax.axison:  # a table beside a plot has a title only
                assert ax.get_ylabel() and ax.get_title()
            else:
                assert ax.get_title() and ax.tables
    ttft_ax = figures[1].axes[0]
    p99_line = ttft_ax.get_lines()[1]
    assert list(p99_line.get_ydata()) == [r.summary["ttft_s"]["p99"] for r in sweep]
    assert [len(ax.get_lines()) for ax in figures[2].axes] == [1, 1]  # one panel, one queue line, per rate
    offered = [r.summary["achieved_arrival_rate"] for r in sweep]  # what the arrivals offered
    assert [ax.get_title() for ax in figures[2].axes] == [f"{x:.2f} req/s offered ({x:.2f}× capacity)" for x in offered]
    plt.close("all")


def _overlapping_texts(fig, ax):
    """Pairs of the plot's visible labels (tick labels, run numbers, legend) whose drawn boxes intersect."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    texts = [
        t
        for t in [*ax.get_xticklabels(), *ax.get_yticklabels(), *ax.texts, *ax.get_legend().get_texts()]
        if t.get_visible() and t.get_text()
    ]
    boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in texts]
    return [(a, b) for i, (a, box_a) in enumerate(boxes) for b, box_b in boxes[i + 1 :] if box_a.overlaps(box_b)]


def test_the_ttft_figure_keeps_nearby_runs_readable():
    """Runs at 0.9x and 0.95x capacity land close together: numbers, not labels, mark them; a table says which."""
    import matplotlib

    matplotlib.use("Agg")
    from types import SimpleNamespace

    import matplotlib.pyplot as plt

    from lifeofprompt.figures.serving import log_ticks, plot_ttft_against_rate, ttft_rows

    capacity = 4.24  # chapter 13's stored sweep: set factor, achieved rate, p50, p99
    runs = [
        SimpleNamespace(
            config=SimpleNamespace(rate=f * capacity),
            summary=dict(achieved_arrival_rate=got, ttft_s=dict(p50=p50, p99=p99)),
        )
        for f, got, p50, p99 in [
            (1.25, 4.74, 0.61, 1.78),
            (0.5, 1.90, 0.15, 0.29),
            (0.9, 3.42, 0.26, 1.25),
            (0.95, 3.61, 0.23, 1.17),
        ]
    ]
    rows = ttft_rows(runs, capacity)
    assert [row["number"] for row in rows] == [1, 2, 3, 4]
    assert [row["got"] for row in rows] == sorted(r.summary["achieved_arrival_rate"] for r in runs)
    assert [round(row["set_factor"], 2) for row in rows] == [0.5, 0.9, 0.95, 1.25]
    fig = plot_ttft_against_rate(runs, capacity, label="machine X")
    ax, side = fig.axes
    assert sorted(t.get_text() for t in ax.texts) == ["1", "2", "3", "4"]  # one number per run
    cells = side.tables[0].get_celld()
    assert [cells[(i + 1, 0)].get_text().get_text() for i in range(4)] == ["1", "2", "3", "4"]
    assert cells[(0, 1)].get_text().get_text() == "offered"  # what arrived, not what was set
    assert [cells[(i + 1, 1)].get_text().get_text() for i in range(4)] == [
        f"{row['got'] / capacity:.2f}×" for row in rows
    ]
    assert [cells[(i + 1, 4)].get_text().get_text() for i in range(4)] == [f"{row['p99']:.2f}" for row in rows]
    assert _overlapping_texts(fig, ax) == []
    assert [t.get_text() for t in ax.get_yticklabels()] == [f"{t:g}" for t in ax.get_yticks()]
    plt.close(fig)
    assert log_ticks(0.1, 2.0) == [0.1, 0.2, 0.3, 0.5, 1.0, 2.0] and log_ticks(0.15, 0.45) == [0.2, 0.3]


def test_the_sweep_sets_each_rate_so_its_schedule_offers_the_target():
    from lifeofprompt.latency import achieved_arrival_rate
    from lifeofprompt.lessons.serving_study import rate_offering
    from lifeofprompt.loadtest.arrivals import poisson

    for seed in (0, 1, 7):
        for target in (1.5, 2.9, 4.0):
            rate = rate_offering(target, 60, seed)
            records = [{"arrival_time": t} for t in poisson(60, rate, seed).send_times()]
            assert achieved_arrival_rate(records) == pytest.approx(target, rel=1e-9)
    # seed 1's 60 gaps run long: set at the target itself, it offers about a tenth less
    records = [{"arrival_time": t} for t in poisson(60, 3.0, 1).send_times()]
    assert achieved_arrival_rate(records) < 0.92 * 3.0


def test_the_sweep_table_puts_the_achieved_rate_beside_every_percentile():
    from lifeofprompt.lessons.serving_study import sweep_table

    runs = [_fake_result(0.5, 1, [0.1, 0.2, 0.3]), _fake_result(2.0, 1, [0.5, 2.0, 4.0])]
    lines = sweep_table(runs).splitlines()
    assert lines[0].split()[:6] == ["set", "req/s", "got", "req/s", "done", "req/s"]
    for line, run in zip(lines[1:], runs):
        cells = line.split()
        assert float(cells[1]) == pytest.approx(run.summary["achieved_arrival_rate"], abs=0.01)
        assert float(cells[2]) == pytest.approx(run.summary["request_throughput"], abs=0.01)
        assert int(cells[4]) == 3 and cells[6] == f"{run.summary['ttft_s']['p99']:.2f}s"


def test_the_batching_curve_titles_state_the_measured_ratios():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from lifeofprompt.figures.serving import plot_batching_curve
    from lifeofprompt.lessons.serving_study import BatchPoint

    fig = plot_batching_curve([BatchPoint(1, 0.1, 20), BatchPoint(4, 0.2, 80)], [0.1, 0.11], 0.05, label="m")
    left, right = fig.axes
    assert left.get_title() == "Step time: 2.0× from 1 to 4 sequences"
    assert right.get_title() == "Throughput: 2.0× from 1 to 4 sequences"
    plt.close(fig)

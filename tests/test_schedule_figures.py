"""Timelines and the notebook-07 panel, tested through their plain functions (no browser)."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from lifeofprompt.figures.schedule import (
    SchedulePanel,
    build_spans,
    plot_gantt,
    plot_static_vs_continuous,
    spans_from_sim,
)  # noqa: E402
from lifeofprompt.lessons.roofline import Machine  # noqa: E402
from lifeofprompt.lessons.simulator import SimRequest, Simulator  # noqa: E402

MACHINE = Machine("test machine", bandwidth=10e9, flops=50e9, overhead_s=0.01)
WORK = [SimRequest(16, n) for n in (2, 6, 2, 6)]


def kinds(row):
    return [k for _, _, k in sorted(row.spans)]


def test_static_rows_show_waiting_and_idle_seats():
    static = Simulator(machine=MACHINE, static_batch_size=2).run(WORK)
    rows = {r.request_id: r for r in spans_from_sim(static)}
    assert kinds(rows["r0"]) == ["prefill", "decode", "idle seat"]  # done after 2 tokens, seat kept
    assert kinds(rows["r1"]) == ["prefill", "decode"]
    assert kinds(rows["r2"]) == ["waiting", "prefill", "decode", "idle seat"]
    idle = [s for s in rows["r0"].spans if s[2] == "idle seat"][0]
    assert idle[1] == rows["r1"].finish  # until the longest of its batch ends


def test_continuous_rows_have_no_idle_seats_and_show_preemption():
    continuous = Simulator(machine=MACHINE, max_num_seqs=2).run(WORK)
    assert all("idle seat" not in kinds(r) for r in spans_from_sim(continuous))
    tight = Simulator(machine=MACHINE, num_blocks=4, block_size=16).run([SimRequest(20, 20), SimRequest(20, 20)])
    assert tight.num_preemptions >= 1
    rows = spans_from_sim(tight)
    assert any("preempted" in kinds(r) and "recompute" in kinds(r) for r in rows)


def test_build_spans_merges_consecutive_decodes_and_shifts_time():
    result = Simulator(machine=MACHINE).run([SimRequest(8, 5)])
    (row,) = build_spans(result.steps, {"r0": 0.0}, {"r0": result.duration})
    assert [k for _, _, k in row.spans] == ["prefill", "decode"]  # four decode steps, one bar
    assert row.spans[-1][1] == result.duration
    (shifted,) = build_spans(result.steps, {"r0": 0.0}, {"r0": result.duration}, t0=-1.0)
    assert shifted.arrival == 1.0 and shifted.spans[-1][1] == result.duration + 1.0


def test_figures_draw():
    static = Simulator(machine=MACHINE, static_batch_size=2).run(WORK)
    continuous = Simulator(machine=MACHINE, max_num_seqs=2).run(WORK)
    fig = plot_static_vs_continuous(
        spans_from_sim(static), spans_from_sim(continuous), static.timings, continuous.timings
    )
    titles = [ax.get_title() for ax in fig.axes]
    assert titles[0].startswith("static: ") and "TTFT p50" in titles[1]
    ax = plot_gantt(spans_from_sim(continuous), max_rows=2)
    assert [t.get_text() for t in ax.get_yticklabels()] == ["r0", "r1"] and "first 2 of 4" in ax.get_title()
    plt.close("all")


def test_panel_callback_reacts_to_every_slider():
    panel = SchedulePanel(machine=MACHINE, num_requests=30)
    base = panel.summary()
    assert panel.capacity > 0 and panel.default_rate < panel.capacity < panel.max_rate
    assert base == panel.summary(16, panel.default_rate, 256, 512)
    changed = {
        panel.summary(max_num_seqs=2),
        panel.summary(rate=panel.max_rate),
        panel.summary(num_blocks=16),
        panel.summary(budget=64),
    }
    assert base not in changed and len(changed) == 4
    assert "preemptions" in base and "TTFT p50" in base
    tight = panel.simulate(num_blocks=16)
    assert tight.num_preemptions > 0
    assert panel.simulate(max_num_seqs=2).summary["ttft_s"]["p99"] > panel.simulate().summary["ttft_s"]["p99"]
    assert panel.simulate(rate=panel.max_rate).summary["ttft_s"]["p99"] > panel.simulate().summary["ttft_s"]["p99"]
    text = panel.update(max_num_seqs=4)
    assert text == panel.summary(max_num_seqs=4)
    fig = panel.figure(max_num_seqs=4)
    assert "max_num_seqs=4" in fig.axes[0].get_title()
    plt.close("all")
    box = panel.widget()
    assert [c.description for row in box.children[:2] for c in row.children] == [
        "max seqs",
        "req/s",
        "KV blocks",
        "token budget",
    ]


def test_in_steps_retimes_a_run_by_step_index():
    from types import SimpleNamespace

    from lifeofprompt.figures.schedule import in_steps

    run = Simulator(machine=MACHINE, static_batch_size=2).run(WORK)  # r0..r3, 2 + 6 + 2 + 6 tokens
    engine = SimpleNamespace(step_records=run.steps)
    outputs = [SimpleNamespace(request_id=f"r{i}", metrics=t) for i, t in enumerate(run.timings)]
    records, timings = in_steps(engine, outputs)
    assert [(r.start_time, r.end_time) for r in records[:2]] == [(0.0, 1.0), (1.0, 2.0)]
    assert [t.first_token_time for t in timings.values()] == [1.0, 1.0, 7.0, 7.0]  # second batch after 6 steps
    assert [t.finished_time for t in timings.values()] == [2.0, 6.0, 8.0, 12.0]
    assert timings["r2"].first_scheduled_time == 6.0 and timings["r2"].arrival_time == 0.0


def test_the_roofline_check_draws_both_panels_with_a_machine_footer():
    from lifeofprompt.figures.schedule import plot_roofline_check

    gap = {"measured_s": [0.02, 0.03, 0.05], "predicted_s": [0.02, 0.02, 0.04], "num_tokens": [8, 3, 12]}
    fig = plot_roofline_check(gap, label="measured on a test machine")
    measured, predicted = (list(line.get_ydata()) for line in fig.axes[0].lines)
    assert measured == pytest.approx([20, 30, 50]) and predicted == pytest.approx([20, 20, 40])  # in ms
    assert fig.axes[1].collections[0].get_offsets()[:, 0].tolist() == [8, 3, 12]  # by the step's tokens
    assert list(fig.axes[1].collections[0].get_offsets()[:, 1]) == [1.0, 1.5, 1.25]
    assert "measured on a test machine" in [t.get_text() for t in fig.texts]

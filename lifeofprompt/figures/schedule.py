"""Pictures of a schedule: the trace as text, Gantt timelines (static vs continuous), chapter 08's panel.

Every picture is drawn from the same two things the engine and the simulator both leave
behind: the ``StepRecord`` of each step (who ran, what kind of work, when) and each request's
arrival and finish times. One row per request; time runs left to right:

* light grey — waiting in the queue (hatched: waiting again after being preempted);
* orange — prompt tokens computed (a whole prompt, or a chunk of one); red — recomputed after preemption;
* blue — decode steps, one token each;
* white with grey hatching — static batching only: finished, but its seat stays empty until the
  longest request of its batch is done.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from ..latency import summarize


def format_step(record) -> str:
    """One line per scheduled request: kind, token positions, blocks."""
    head = (
        f"step {record.step:3d}: {record.num_batched_tokens:4d} tokens, {record.num_seqs} running, "
        f"{record.num_waiting} waiting, {record.num_free_blocks} blocks free"
    )
    if record.group is not None:
        beside = f", beside step {', '.join(map(str, record.overlapped))}" if record.overlapped else ""
        head += f"; group {record.group}{beside}"
    lines = [head]
    for r in record.scheduled:
        cached = f", {r.num_cached_tokens} cached" if r.num_cached_tokens else ""
        cached += f", {r.num_draft_tokens} drafts" if r.num_draft_tokens else ""
        cached += f", {r.num_accepted_tokens} kept" if r.num_accepted_tokens is not None else ""
        lines.append(
            f"    {r.request_id:>10} {r.kind:13} tokens {r.start:3d}..{r.end - 1:<3d} "
            f"({r.num_tokens}{cached})  blocks {r.block_table}"
        )
    for rid in record.preempted:
        lines.append(f"    {rid:>10} PREEMPTED: blocks freed, back to the front of the queue")
    for rid in record.finished:
        lines.append(f"    {rid:>10} finished: its blocks go back to the pool after this step")
    return "\n".join(lines)


def format_steps(records, fold_quiet: bool = False) -> str:
    """The schedule as text, step by step. ``fold_quiet`` folds runs of steps in which every
    request only decoded one token into its existing blocks (nothing admitted, grown, freed)."""
    lines, folded, previous = [], [], {}

    def flush():
        if folded:
            span = f"step {folded[0]}" if len(folded) == 1 else f"steps {folded[0]}..{folded[-1]}"
            lines.append(f"{span}: one decode token per running request, no new block")
            folded.clear()

    for record in records:
        tables = {r.request_id: r.block_table for r in record.scheduled}
        quiet = (
            fold_quiet
            and not record.admitted
            and not record.finished
            and not record.preempted
            and all(r.kind == "decode" and previous.get(r.request_id) == r.block_table for r in record.scheduled)
        )
        previous = tables
        if quiet:
            folded.append(record.step)
            continue
        flush()
        lines.append(format_step(record))
    flush()
    return "\n".join(lines)


COLORS = {
    "prefill": "tab:orange",
    "prefill chunk": "#f7b267",
    "recompute": "tab:red",
    "decode": "tab:blue",
    "waiting": "#d9d9d9",
    "preempted": "#d9d9d9",
    "idle seat": "white",
}


@dataclass
class RequestSpans:
    request_id: str
    arrival: float
    finish: float | None
    spans: list[tuple[float, float, str]] = field(default_factory=list)  # (start, end, kind), merged


def build_spans(
    steps, arrivals: dict[str, float], finishes: dict[str, float], static: bool = False, t0: float | None = None
) -> list[RequestSpans]:
    """Per request, its coloured spans from the step records; times shifted so ``t0`` is 0."""
    t0 = min(arrivals.values()) if t0 is None else t0
    rows = {
        rid: RequestSpans(rid, a - t0, (finishes.get(rid) - t0) if finishes.get(rid) is not None else None)
        for rid, a in arrivals.items()
    }
    runs: dict[str, list] = {rid: [] for rid in rows}
    preempted_at: dict[str, list[float]] = {rid: [] for rid in rows}
    batches: list[list[str]] = []
    for rec in steps:
        start, end = rec.start_time - t0, rec.end_time - t0
        for r in rec.scheduled:
            if r.request_id in runs:
                runs[r.request_id].append((start, end, r.kind))
        for rid in rec.preempted:
            if rid in preempted_at:
                preempted_at[rid].append(start)
        if static and rec.admitted:
            batches.append(list(rec.admitted))
    for rid, row in rows.items():
        merged: list[list] = []
        for start, end, kind in runs[rid]:
            if merged and merged[-1][2] == kind and abs(merged[-1][1] - start) < 1e-9:
                merged[-1][1] = end
            else:
                merged.append([start, end, kind])
        first = merged[0][0] if merged else row.finish
        if first is not None and first > row.arrival:
            row.spans.append((row.arrival, first, "waiting"))
        for p in preempted_at[rid]:
            back = next((s for s, _, _ in merged if s >= p), None)
            if back is not None and back > p:
                row.spans.append((p, back, "preempted"))
        row.spans.extend(tuple(m) for m in merged)
    for batch in batches:
        ends = [rows[rid].finish for rid in batch if rid in rows and rows[rid].finish is not None]
        if not ends:
            continue
        batch_end = max(ends)
        for rid in batch:
            row = rows.get(rid)
            if row is not None and row.finish is not None and row.finish < batch_end:
                row.spans.append((row.finish, batch_end, "idle seat"))
    return sorted(rows.values(), key=lambda r: (r.arrival, int(r.request_id[1:]) if r.request_id[1:].isdigit() else 0))


def spans_from_engine(engine, outputs, static: bool = False) -> list[RequestSpans]:
    """Spans of finished ``RequestOutput``s from an engine's step records (times from the first arrival)."""
    arrivals = {o.request_id: o.metrics.arrival_time for o in outputs}
    finishes = {o.request_id: o.metrics.finished_time for o in outputs}
    return build_spans(list(engine.step_records), arrivals, finishes, static)


def in_steps(engine, outputs):
    """The engine's records and the outputs' timings re-timed in *steps*: step ``i`` runs from ``i`` to ``i + 1``.

    On a shared machine the seconds of a step depend on what else runs; the step count is what
    the scheduling policy alone decides. Returns ``(records, timings)`` for ``build_spans`` and
    ``metrics.summarize`` (a request that arrived before step ``i`` started has arrival ``i``).
    """
    import copy

    from ..latency import RequestTiming

    originals = list(engine.step_records)
    records, end_step = [], {}
    for i, rec in enumerate(originals):
        clone = copy.copy(rec)
        clone.start_time, clone.end_time = float(i), float(i + 1)
        records.append(clone)
        end_step[rec.end_time] = float(i + 1)
    starts = [rec.start_time for rec in originals]

    def arrival_step(t):
        return float(sum(1 for s in starts if s < t))

    timings = {}
    for o in outputs:
        m = o.metrics
        timings[o.request_id] = RequestTiming(
            arrival_time=arrival_step(m.arrival_time),
            first_scheduled_time=arrival_step(m.first_scheduled_time + 1e-12) - 1
            if m.first_scheduled_time is not None
            else None,
            first_token_time=end_step.get(m.first_token_time),
            finished_time=end_step.get(m.finished_time),
            token_times=[end_step[t] for t in m.token_times],
            num_prompt_tokens=m.num_prompt_tokens,
        )
    return records, timings


def spans_from_sim(result, static: bool | None = None) -> list[RequestSpans]:
    arrivals = {f"r{i}": t.arrival_time for i, t in enumerate(result.timings)}
    finishes = {f"r{i}": t.finished_time for i, t in enumerate(result.timings)}
    return build_spans(
        result.steps, arrivals, finishes, result.policy == "static" if static is None else static, t0=0.0
    )


# ----------------------------------------------------------------------------- drawing


def plot_gantt(rows: list[RequestSpans], ax=None, title: str = "", max_rows: int = 40, legend: bool = True):
    """One bar row per request (the first ``max_rows`` by arrival); returns the axes."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if ax is None:
        _, ax = plt.subplots(figsize=(9, 0.3 * min(len(rows), max_rows) + 1.5))
    shown = rows[:max_rows]
    for y, row in enumerate(shown):
        for start, end, kind in row.spans:
            hatch = "///" if kind in ("idle seat", "preempted") else None
            ax.broken_barh(
                [(start, max(end - start, 1e-9))],
                (y - 0.4, 0.8),
                facecolors=COLORS[kind],
                edgecolor="grey" if hatch else "none",
                hatch=hatch,
                linewidth=0.3,
            )
        ax.plot([row.arrival], [y], marker="|", color="black", markersize=7)
    ax.set_yticks(range(len(shown)))
    ax.set_yticklabels([r.request_id for r in shown], fontsize=7)
    ax.set_ylim(len(shown) - 0.5, -0.5)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("request")
    ax.set_title(title + (f" (first {max_rows} of {len(rows)} requests)" if len(rows) > max_rows else ""))
    ax.grid(True, axis="x", alpha=0.3)
    if legend:
        kinds = sorted({k for r in shown for _, _, k in r.spans}, key=list(COLORS).index)
        ax.legend(
            [
                Patch(facecolor=COLORS[k], edgecolor="grey", hatch="///" if k in ("idle seat", "preempted") else None)
                for k in kinds
            ],
            kinds,
            fontsize=7,
            loc="upper left",
            bbox_to_anchor=(1.005, 1.0),
            framealpha=0.9,
        )
    return ax


def summary_line(timings, unit: str = "s") -> str:
    """Throughput and TTFT in one line; ``unit`` is ``"s"`` or ``"steps"`` (timings re-timed by ``in_steps``)."""
    s = summarize(timings)
    if unit == "steps":
        return (
            f"{s['output_throughput']:.2f} output tokens/step, TTFT p50 {s['ttft_s']['p50']:.1f} steps, "
            f"p99 {s['ttft_s']['p99']:.1f} steps, finished after {s['duration_s']:.0f} steps"
        )
    return (
        f"{s['output_throughput']:.1f} output tok/s, TTFT p50 {s['ttft_s']['p50']:.2f} s, "
        f"p99 {s['ttft_s']['p99']:.2f} s, finished after {s['duration_s']:.2f} s"
    )


def plot_static_vs_continuous(
    static_rows,
    continuous_rows,
    static_timings,
    continuous_timings,
    max_rows: int = 40,
    suptitle: str = "Static against continuous batching, same requests",
    unit: str = "s",
):
    """Two Gantt charts on one time axis, each titled with its throughput and TTFT."""
    import matplotlib.pyplot as plt

    n = min(max(len(static_rows), 1), max_rows)
    fig, axes = plt.subplots(2, 1, figsize=(10, 0.5 * n + 3), sharex=True)
    plot_gantt(static_rows, axes[0], "static: " + summary_line(static_timings, unit), max_rows)
    plot_gantt(
        continuous_rows, axes[1], "continuous: " + summary_line(continuous_timings, unit), max_rows, legend=False
    )
    for ax in axes:
        ax.title.set_fontsize(9)
        ax.set_xlabel("time (steps)" if unit == "steps" else "time (s)")
    fig.suptitle(suptitle)
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------- the interactive panel


class SchedulePanel:
    """Sliders → simulator → timeline + throughput / TTFT p50 / p99. ``update`` is the whole callback.

    The arrival-rate slider spans a tenth of to twice the *capacity* of the default settings
    (a closed loop of 16 clients measured in the simulator at start), so the interesting range
    is on the slider whatever machine the simulator was calibrated on.
    """

    DEFAULTS = dict(max_num_seqs=16, num_blocks=256, budget=512)

    def __init__(
        self,
        machine=None,
        num_requests: int = 120,
        prompt_lens=(16, 128),
        output_lens=(8, 64),
        seed: int = 0,
        max_rows: int = 30,
    ):
        from ..lessons.simulator import Simulator, random_workload
        from ..loadtest.arrivals import closed_loop

        self.machine = machine
        self.workload = random_workload(num_requests, prompt_lens, output_lens, seed)
        self.seed = seed
        self.max_rows = max_rows
        self._run = lru_cache(maxsize=64)(self._simulate)
        d = self.DEFAULTS
        loop = Simulator(
            machine=machine,
            num_blocks=d["num_blocks"],
            max_num_seqs=d["max_num_seqs"],
            max_num_batched_tokens=d["budget"],
        ).run(self.workload, closed_loop(num_requests, d["max_num_seqs"]))
        self.capacity = loop.summary["request_throughput"]
        self.max_rate = float(f"{2 * self.capacity:.2g}")
        self.default_rate = float(f"{0.6 * self.capacity:.2g}")

    def _simulate(self, max_num_seqs: int, rate: float, num_blocks: int, budget: int):
        from ..lessons.simulator import Simulator
        from ..loadtest.arrivals import poisson

        sim = Simulator(
            machine=self.machine, num_blocks=num_blocks, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget
        )
        return sim.run(self.workload, poisson(len(self.workload), rate, self.seed), seed=self.seed)

    def _args(self, max_num_seqs, rate, num_blocks, budget):
        d = self.DEFAULTS
        return (
            int(d["max_num_seqs"] if max_num_seqs is None else max_num_seqs),
            float(self.default_rate if rate is None else rate),
            int(d["num_blocks"] if num_blocks is None else num_blocks),
            int(d["budget"] if budget is None else budget),
        )

    def simulate(self, max_num_seqs=None, rate=None, num_blocks=None, budget=None):
        return self._run(*self._args(max_num_seqs, rate, num_blocks, budget))

    def summary(self, max_num_seqs=None, rate=None, num_blocks=None, budget=None) -> str:
        seqs, rate, blocks, budget = self._args(max_num_seqs, rate, num_blocks, budget)
        r = self._run(seqs, rate, blocks, budget)
        s = r.summary
        return (
            f"max_num_seqs={seqs}, {rate:g} req/s, {blocks} blocks, budget {budget}: "
            f"throughput {s['output_throughput']:.1f} tok/s, TTFT p50 {s['ttft_s']['p50']:.2f} s, "
            f"p99 {s['ttft_s']['p99']:.2f} s, {r.num_preemptions} preemptions, {s['failed']} rejected"
        )

    def figure(self, max_num_seqs=None, rate=None, num_blocks=None, budget=None):
        import matplotlib.pyplot as plt

        seqs, rate, blocks, budget = self._args(max_num_seqs, rate, num_blocks, budget)
        r = self._run(seqs, rate, blocks, budget)
        rows = spans_from_sim(r)
        fig, (ax, ax2) = plt.subplots(
            1, 2, figsize=(12, 0.22 * self.max_rows + 2.2), gridspec_kw={"width_ratios": [3, 1]}
        )
        plot_gantt(rows, ax, f"simulated schedule, max_num_seqs={seqs}, {rate:g} req/s", self.max_rows)
        ax.title.set_fontsize(9)
        running = [(rec.start_time, len(rec.scheduled)) for rec in r.steps]
        ax2.step([t for t, _ in running], [n for _, n in running], where="post", color="tab:blue", linewidth=0.8)
        ax2.axhline(seqs, color="grey", linestyle=":", label="max_num_seqs")
        ax2.set_xlabel("time (s)")
        ax2.set_ylabel("sequences in the step")
        ax2.set_title("batch size over time", fontsize=9)
        ax2.legend(fontsize=7)
        fig.suptitle(self.summary(seqs, rate, blocks, budget), fontsize=9)
        fig.tight_layout()
        return fig

    def update(self, max_num_seqs=None, rate=None, num_blocks=None, budget=None):
        """The callback: draw the figure and print the summary (what the widget shows)."""
        import matplotlib.pyplot as plt

        self.figure(max_num_seqs, rate, num_blocks, budget)
        plt.show()
        text = self.summary(max_num_seqs, rate, num_blocks, budget)
        print(text)
        return text

    def widget(self):
        import ipywidgets as w

        d = self.DEFAULTS
        sliders = dict(
            max_num_seqs=w.IntSlider(d["max_num_seqs"], min=1, max=64, description="max seqs", continuous_update=False),
            rate=w.FloatSlider(
                self.default_rate,
                min=self.max_rate / 20,
                max=self.max_rate,
                step=self.max_rate / 40,
                readout_format=".3g",
                description="req/s",
                continuous_update=False,
            ),
            num_blocks=w.IntSlider(
                d["num_blocks"], min=16, max=1024, step=16, description="KV blocks", continuous_update=False
            ),
            budget=w.IntSlider(
                d["budget"], min=32, max=2048, step=32, description="token budget", continuous_update=False
            ),
        )
        out = w.interactive_output(self.update, sliders)
        return w.VBox([w.HBox(list(sliders.values())[:2]), w.HBox(list(sliders.values())[2:]), out])


def plot_roofline_check(gap: dict, label: str | None = None):
    """The simulator's clock checked against the engine (chapter 08, part 4): each real step's time
    beside its roofline prediction, and their ratio by the step's size; a footer names the machine
    and its load, since every measured millisecond belongs to it (``lessons.simulator.compare_steps``)."""
    import matplotlib.pyplot as plt

    from .serving import _finish

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8))
    steps = range(len(gap["measured_s"]))
    ax1.plot(steps, [t * 1e3 for t in gap["measured_s"]], "o-", label="measured (engine)")
    ax1.plot(steps, [t * 1e3 for t in gap["predicted_s"]], "s--", label="predicted (roofline + overhead)")
    ax1.set_xlabel("step of the continuous run")
    ax1.set_ylabel("step time (ms)")
    ax1.set_title("Real steps against the calibrated roofline")
    ax1.legend(fontsize=8)
    ax2.scatter(gap["num_tokens"], [m / p for m, p in zip(gap["measured_s"], gap["predicted_s"])])
    ax2.axhline(1.0, color="grey", linestyle=":")
    ax2.set_xlabel("tokens in the step")
    ax2.set_ylabel("measured / predicted")
    ax2.set_title("The gap, by step size")
    return _finish(fig, label)

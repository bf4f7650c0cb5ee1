"""Chapter 10's step trace; chapter 11's and the measurements appendix's benchmark results, drawn.

The benchmark scripts (``benchmarks/bench_engine.py``, ``benchmarks/gpu_check.py``) write JSON;
these functions read it back, so the notebook shows committed GPU figures on a machine
without a GPU, labelled with the device and date they came from.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..env import cpu_label
from ..lessons.step_timeline import forwards
from .schedule import format_step

RESULTS_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


# ----------------------------------------------------------------------------- a live trace


def kernels_of_step(model, launch) -> str:
    """The kernels one step launches per layer, and how the step was launched (``step_output.Launch``)."""
    attention = (
        "Triton store_kv + paged_attention" if launch.backend == "triton" else "torch store_kv + paged_attention"
    )
    how = launch.mode
    if launch.padded_to:
        how += f" (batch {launch.rows} padded to {launch.padded_to})"
    if str(launch.path).startswith("c-step"):
        return (
            f"{model.config.num_layers} layers in one C call (cpu/c_step.c: RMSNorm, qkv, RoPE, attention from "
            f"the pool, o_proj, RMSNorm, gate_up, SiLU·up, down) + final norm; lm_head GEMM; {how}"
        )
    if launch.path == "fused":
        return (
            f"{model.config.num_layers} × [fused add+RMSNorm, qkv GEMM, fused RoPE, {attention}, o_proj GEMM, "
            f"fused add+RMSNorm, gate_up GEMM, fused SiLU·up, down GEMM] + lm_head; {how}"
        )
    return (
        f"{model.config.num_layers} × [RMSNorm, qkv GEMM, RoPE, {attention}, o_proj GEMM, RMSNorm, "
        f"gate_up GEMM, SiLU·up, down GEMM] + lm_head; {how}"
    )


def wrap_line(text: str, width: int = 100, indent: int = 13) -> str:
    """Break a long trace line between words (never inside one) to fit a notebook's output width."""
    import textwrap

    return "\n".join(
        textwrap.wrap(text, width, subsequent_indent=" " * indent, break_long_words=False, break_on_hyphens=False)
    )


def live_trace(llm, prompts, params, out=print) -> list:
    """Drive ``llm``'s engine one step at a time, printing each step's schedule, blocks and kernels.

    Returns the finished ``RequestOutput``s in prompt order.
    """
    engine = llm.engine
    ids = llm._submit(prompts, params)
    done = {}
    while len(done) < len(ids):
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
        record = engine.step_records[-1]
        out(format_step(record))
        out(wrap_line("    kernels: " + kernels_of_step(engine.model, record.launch)))
    return [done[i] for i in ids]


# ----------------------------------------------------------------------------- results


def load_results(pattern: str = "h200-*/gpu_results.json", where=None) -> tuple[dict | None, Path | None]:
    """The newest committed results file matching ``pattern`` under ``benchmarks/results`` (None if none);
    ``where(result)`` keeps only the results it accepts (e.g. one thread's runs).

    Newest by the date in the name (``..._20261201.json``, ``h200-2026-11-30/``), not by the
    name itself: CPU results are named after their processor, which would sort them by CPU. Runs
    of one day go by the start time they record (``env.date``, e.g. ``2026-12-02 07:04 UTC``).
    """
    import re

    def stamp(item: tuple[Path, dict]) -> tuple[str, str, str]:
        path, result = item
        dates = re.findall(r"\d{4}-?\d{2}-?\d{2}", str(path.relative_to(RESULTS_DIR)))
        started = result.get("env", {}).get("date", "") if isinstance(result, dict) else ""
        return (dates[-1].replace("-", "") if dates else "", str(started), path.name)

    found = [(path, json.loads(path.read_text())) for path in RESULTS_DIR.glob(pattern)]
    for path, result in sorted(found, key=stamp, reverse=True):
        if where is None or where(result):
            return result, path
    return None, None


def measured_table(gpu: dict, results_path: Path) -> list[tuple[str, str]]:
    """What the GPU session measured, one (what, value) row each: the machine, the kernels (from the
    kernel bench kept beside the results), the decode step, throughput, the story and the tests'
    final state. Only measured values; a step that did not run has no row."""
    m, dec, ours, peer = gpu["machine"], gpu["decode"], gpu["ours"], gpu["peer"]
    rows = [
        ("copy bandwidth (read + write, 2 GiB)", f"{m['copy_bandwidth'] / 1e9:,.0f} GB/s"),
        (f"bf16 matrix product {m['matmul_n']}³", f"{m['matmul_flops'] / 1e12:.1f} TFLOP/s"),
    ]
    bench = results_path.parent / "kernel_bench_tinyllama_heads.json"
    if bench.exists():
        seen = set()
        for r in json.loads(bench.read_text())["rows"]:
            key = (r["batch"], r["context_len"], r["kernel"], r.get("num_kv_splits"))
            if key[:2] in ((64, 4096), (1, 32768)) and key not in seen:
                seen.add(key)
                splits = r.get("num_kv_splits")
                how = "" if splits is None else ", no KV split" if splits == 1 else f", {splits} KV splits"
                rows.append(
                    (
                        f"attention b{r['batch']}×{r['context_len']}: {r['kernel']}{how}",
                        f"{r['ms']:.3f} ms = {r['gb_per_s']:,.0f} GB/s",
                    )
                )
    rows += [
        (f"batch-1 decode step, engine (context {dec['context']})", f"{dec['engine_step_s'] * 1e3:.2f} ms"),
        ("  its forward as a CUDA graph replay", f"{dec['graph_replay_s'] * 1e3:.2f} ms"),
        ("  the same forward eager", f"{dec['eager_forward_s'] * 1e3:.2f} ms"),
        ("  floor: weight bytes ÷ copy bandwidth", f"{dec['floor_s'] * 1e3:.2f} ms"),
        (
            f"{ours['requests']} requests (nano-vllm shape): lifeofprompt",
            f"{ours['tokens_per_s']:,.0f} tok/s ({ours['seconds']:.1f} s)",
        ),
    ]
    if peer.get("tokens_per_s"):
        rows.append(
            (
                f"  transformers {peer.get('transformers', '')} continuous batching",
                f"{peer['tokens_per_s']:,.0f} tok/s (stopped at {peer['seconds']:.0f} s)",
            )
        )
    for label, key in (("alone", "alone"), ("together", "together")):
        for r in gpu.get("story", {}).get(key, []):
            rows.append(
                (
                    f"story {label}: {r['prompt']!r}",
                    f"TTFT {r['ttft_s'] * 1e3:.1f} ms, {r['decode_tokens_per_s']:.0f} tok/s",
                )
            )
    return rows + test_rows(results_path)


def test_rows(results_path: Path) -> list[tuple[str, str]]:
    """The GPU tests' final state: the folder's ``tests_summary.tsv`` where the run came in parts, else the
    kernel tests' log and the engine tests (their last run)."""
    import re

    def last_count(log: Path) -> str | None:
        found = [
            re.sub(r" in [\d.]+s.*", "", ln.strip())
            for ln in log.read_text().splitlines()
            if re.search(r"^\d+ (passed|failed)", ln.strip())
        ]
        return found[-1] if found else None

    folder, rows = results_path.parent, []
    summary = folder / "tests_summary.tsv"  # a run in parts: its results folder says what each part ran
    if summary.exists():
        return [tuple(line.split("\t", 1)) for line in summary.read_text().splitlines() if "\t" in line]
    if (folder / "kernel_gpu_tests.log").exists():
        rows.append(("tests/gpu/test_kernels_gpu.py", last_count(folder / "kernel_gpu_tests.log")))
    runs = [folder / "pytest_gpu.txt"] + sorted(folder.glob("rerun-*/pytest_gpu.txt"))
    runs = [r for r in runs if r.exists() and last_count(r)]
    if runs:
        rows.append(("tests/gpu/test_engine_gpu.py", last_count(runs[-1])))
    return rows


def gap_above_prediction(curve: list[dict]) -> list[tuple[int, float, float, float]]:
    """Per batch size: measured step, roofline prediction and the gap between them, in ms."""
    return [
        (r["batch"], r["step_s"] * 1e3, r["predicted_s"] * 1e3, (r["step_s"] - r["predicted_s"]) * 1e3)
        for r in curve
        if "step_s" in r and "predicted_s" in r
    ]


def _finish(fig, path: Path | None, ax=None):
    """Legend and grid on ``ax`` (if given), tight layout, and a PNG at ``path`` (if given)."""
    if ax is not None:
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=110)
    return fig


def plot_throughput(groups: dict[str, list[dict]], title: str, path: Path | None = None):
    """Horizontal bars of output tokens/s per peer, one panel per workload (ours first, in blue)."""
    import matplotlib.pyplot as plt

    groups = {name: [r for r in rows if r.get("tokens_per_s")] for name, rows in groups.items()}
    groups = {name: rows for name, rows in groups.items() if rows}
    import textwrap

    fig, axes = plt.subplots(1, max(1, len(groups)), figsize=(5.2 * max(1, len(groups)), 3.4), squeeze=False)
    for ax, (name, rows) in zip(axes[0], groups.items()):
        labels = ["\n".join(textwrap.wrap(r["peer"], 22, break_on_hyphens=False)) for r in rows]
        ax.barh(labels, [r["tokens_per_s"] for r in rows], color=["C0"] + ["C7"] * (len(rows) - 1))
        for i, r in enumerate(rows):
            ax.text(r["tokens_per_s"], i, f" {r['tokens_per_s']:,.0f}", va="center", fontsize=8)
        ax.set_title("\n".join(textwrap.wrap(name, 48)), fontsize=9)
        ax.set_xlabel("output tokens / s (higher is better)")
        ax.invert_yaxis()
        ax.margins(x=0.25)
    fig.suptitle("\n".join(textwrap.wrap(title, 62 * len(groups) or 62)), fontsize=9)
    return _finish(fig, path)


def plot_batching_curve(
    rows: list[dict],
    title: str,
    floor_s: float | None = None,
    path: Path | None = None,
    *,
    floor_label: str | None = None,
    predicted_label: str | None = None,
):
    """Measured decode step time against batch size, with the roofline prediction and a floor line.

    ``floor_label`` and ``predicted_label`` say what the two lines are when the defaults would not: a line
    drawn from a copy rate, say, is an estimate and may lie above a measured step, so it must not be called a floor.
    """
    import matplotlib.pyplot as plt

    rows = [r for r in rows if "step_s" in r]
    fig, ax = plt.subplots(figsize=(6.4, 4))
    ax.plot([r["batch"] for r in rows], [r["step_s"] * 1e3 for r in rows], "o-", label="measured decode step")
    if rows and "predicted_s" in rows[0]:
        ax.plot(
            [r["batch"] for r in rows],
            [r["predicted_s"] * 1e3 for r in rows],
            "s--",
            label=predicted_label or "roofline: max(bytes/bandwidth, FLOPs/rate)",
        )
    if floor_s:
        floor_label = floor_label or "weight bytes ÷ bandwidth (batch-1 floor)"
        ax.axhline(floor_s * 1e3, color="gray", lw=0.8, ls=":", label=floor_label)
    ax.set_xscale("log", base=2)
    ax.set_xticks([r["batch"] for r in rows], [str(r["batch"]) for r in rows])
    ax.set_ylim(bottom=0)
    ax.set_xlabel("sequences in the decode step (batch size)")
    ax.set_ylabel("step time (ms)")
    import textwrap

    ax.set_title("\n".join(textwrap.wrap(title, 80)), fontsize=9)
    return _finish(fig, path, ax)


def plot_cpu_linear(result: dict, path: Path | None = None):
    """``benchmarks/cpu_linear.py``'s table drawn: weight bytes read per second by each product path, by rows."""
    import matplotlib.pyplot as plt

    rows = result["rows"]
    paths = [k for k in rows[0] if k != "rows"]
    fig, ax = plt.subplots(figsize=(6.8, 4))
    for i, name in enumerate(paths):  # markers and dashes differ too: two paths can run at the same speed
        ax.plot(
            [r["rows"] for r in rows],
            [r[name]["weight_GB_per_s"] for r in rows],
            color=f"C{i}",
            label=name,
            marker="osD^v"[i % 5],
            ls="-" if i % 2 == 0 else "--",
            markersize=7 - i,
            lw=1.4,
        )
    ax.axhline(
        result["sum_read_GB_per_s"],
        color="gray",
        lw=0.8,
        ls=":",
        label=f"memory read by sum(): {result['sum_read_GB_per_s']:.0f} GB/s",
    )
    ax.set_xscale("log", base=2)
    ax.set_xticks([r["rows"] for r in rows], [str(r["rows"]) for r in rows])
    ax.set_ylim(bottom=0)
    ax.set_xlabel("rows multiplied by every weight matrix (decode batch size)")
    ax.set_ylabel("weight bytes read per second (GB/s)")
    env = result["env"]
    cpu = cpu_label(env["cpu"], env.get("cpu_flags", "").split()) if env.get("cpu") else env["machine"]
    ax.set_title(
        f"SmolLM2-135M's 120 layer matrices, fp32, {result['threads']} thread\n"
        f"{cpu}, torch {env['torch']}, {env['date']}",
        fontsize=9,
    )
    return _finish(fig, path, ax)


def decode_breakdown(decode: dict) -> list[tuple[str, float]]:
    """The batch-1 decode step in parts (ms), from the GPU script's ``decode`` section."""
    parts = [
        ("engine step (execute, sampling, host)", decode.get("engine_step_s")),
        ("  the same without the fused kernels", decode.get("engine_step_unfused_s")),
        ("CUDA graph replay (the forward)", decode.get("graph_replay_s")),
        ("same forward eager (launch-bound)", decode.get("eager_forward_s")),
        ("  kernel time in it: matmuls", decode.get("eager_kernel_time_by_kind_s", {}).get("matmul")),
        ("  attention", decode.get("eager_kernel_time_by_kind_s", {}).get("attention")),
        ("  store_kv", decode.get("eager_kernel_time_by_kind_s", {}).get("store_kv")),
        ("  fused element-wise kernels", decode.get("eager_kernel_time_by_kind_s", {}).get("fused")),
        ("  small element-wise kernels", decode.get("eager_kernel_time_by_kind_s", {}).get("other")),
        ("greedy sampling", decode.get("sample_greedy_s")),
        ("top-k/top-p sampling", decode.get("sample_topk_topp_s")),
        ("host: fill static buffers", decode.get("host_fill_static_s")),
        ("floor: weight bytes ÷ copy bandwidth", decode.get("floor_s")),
    ]
    return [(name, value * 1e3) for name, value in parts if value is not None]


# ----------------------------------------------------------------------------- the step timeline

TIMELINE_COLORS = {"forward": "C0", "schedule": "C1", "inputs": "C2", "sample": "C3", "outputs": "C4"}


def plot_step_timeline(runs: dict, num_forwards: int = 4, title: str = ""):
    """One row per run (``{label: spans}``, ``lessons/step_timeline.py``), two panels each: ``num_forwards``
    decode forwards from the middle of the run (the forward's lane above, the host's work below), and the
    same lanes magnified around the start of the second of them, where a step's host work shows."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    fig, axes = plt.subplots(
        len(runs), 2, figsize=(10, 1.9 * len(runs) + 1.0), squeeze=False, gridspec_kw={"width_ratios": [2, 1]}
    )
    shown = {label: middle_forwards(spans, num_forwards) for label, spans in runs.items()}
    host_s = max(host_seconds_per_forward(spans) for spans in runs.values())
    half_ms = max(0.5, 1.5 * host_s * 1e3)  # the magnified window: each side of a forward's start
    for (left, right), (label, spans) in zip(axes, runs.items()):
        steady = shown[label]
        t0 = steady[0].start
        draw_lanes(left, spans, t0, 0, (steady[-1].end - t0) * 1e3)
        left.set_title(label, fontsize=9, loc="left")
        t1 = steady[1].start
        draw_lanes(right, spans, t1, -half_ms, half_ms)
        right.axvline(0, color="black", lw=0.8, ls=":")
        right.set_title("magnified: around a forward's start", fontsize=8, loc="left")
    axes[-1, 0].set_xlabel("milliseconds from the first forward shown")
    axes[-1, 1].set_xlabel("milliseconds from that forward's start")
    handles = [Patch(color=c, label=what) for what, c in TIMELINE_COLORS.items()]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return fig


def middle_forwards(spans, count: int) -> list:
    """``count`` consecutive forwards from the middle of a run (its steady decode)."""
    ran = forwards(spans)
    middle = max(0, len(ran) // 2 - count // 2)
    return ran[middle : middle + count]


def host_seconds_per_forward(spans) -> float:
    return sum(s.end - s.start for s in spans if s.what != "forward") / max(1, len(forwards(spans)))


def draw_lanes(ax, spans, t0: float, x_min: float, x_max: float) -> None:
    """The forward's lane and the host's, in ms from ``t0``, between ``x_min`` and ``x_max``: one bar
    collection per part, labelled with it."""
    for what, color in TIMELINE_COLORS.items():
        bars = [((s.start - t0) * 1e3, (s.end - s.start) * 1e3) for s in spans if s.what == what]
        bars = [(x, w) for x, w in bars if x + w >= x_min and x <= x_max]
        lane = 1 if what == "forward" else 0
        ax.broken_barh(bars, (lane - 0.35, 0.7), color=color, label=what)
    ax.set_xlim(x_min, x_max)
    ax.set_yticks([0, 1], ["host work", "forward"])
    ax.set_ylim(-0.6, 1.6)
    ax.grid(axis="x", alpha=0.3)

"""The measurements appendix's side-by-side numbers: the two batch-1 steps and the memory rates, with sources."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch

from lifeofprompt.lessons import reconcile, roofline
from lifeofprompt.lessons.machine_profile import PROFILE_CONTEXT, PROFILE_DECODE_STEPS, MachineProfile

REPO = Path(__file__).resolve().parents[1]
WEIGHTS = reconcile.batch1_weight_bytes()


def profile(**overrides) -> MachineProfile:
    fields = dict(
        name="AMD EPYC, 1 thread",
        read_bandwidth=32e9,
        copy_bandwidth=24e9,
        matmul_flops=1e11,
        decode_step_s=0.020,
        measured_at="2026-12-01 14:43 UTC",
        load_average=0.25,
    )
    return MachineProfile(**(fields | overrides))


def bench(step_s=0.026, fastest_s=0.024, read=24e9, load=None, timed_steps=None) -> dict:
    row = dict(batch=1, context=128, step_s=step_s, min_step_s=fastest_s, predicted_s=0.024)
    if timed_steps is not None:
        row["timed_steps"] = timed_steps
    b1 = dict(step_s=step_s, read_bandwidth=read, floor_s=WEIGHTS / read, ratio=step_s / (WEIGHTS / read))
    if load is not None:
        b1["load_average"] = load
    return {
        "env": {"date": "2026-12-01 16:59 UTC"},
        "threads": 1,
        "dtype": "float32",
        "batching_curve": [dict(batch=2, context=128, step_s=0.04), row],
        "batch1_step": b1,
        "machine": dict(name="CPU", bandwidth=22e9, flops=1e11),
        "decode_floor_s": WEIGHTS / 22e9,
    }


def linear() -> dict:
    rows = [
        {"rows": 1, "linear": {"ms": 33.8, "weight_GB_per_s": 12.6}, "rowwise": {"ms": 20.4, "weight_GB_per_s": 20.8}},
        {"rows": 2, "linear": {"ms": 60.0, "weight_GB_per_s": 7.6}, "rowwise": {"ms": 21.0, "weight_GB_per_s": 20.1}},
    ]
    return {
        "env": {"date": "2026-12-01 10:18 UTC"},
        "threads": 1,
        "weight_bytes": 424673280,
        "sum_read_GB_per_s": 28.4,
        "rows": rows,
    }


def test_the_profile_names_its_threads():
    assert profile().threads == 1 and profile(name="AMD EPYC, 2 threads").threads == 2
    assert profile(name="NVIDIA H200").threads is None


def test_each_step_sits_against_its_own_runs_floor():
    comparison = reconcile.compare_steps(profile(), bench(), "cpu_engine_x.json")
    p, b = comparison.profile, comparison.benchmark
    assert p.step_s == 0.020 and b.step_s == 0.026 and comparison.benchmark_fastest_s == 0.024
    assert p.floor_s == pytest.approx(WEIGHTS / 32e9) and b.floor_s == pytest.approx(WEIGHTS / 24e9)
    assert b.over_floor == pytest.approx(0.026 / (WEIGHTS / 24e9))
    assert comparison.step_ratio == pytest.approx(1.3) and comparison.read_ratio == pytest.approx(0.75)
    assert b.weights_read_rate == pytest.approx(WEIGHTS / 0.026)
    assert f"fastest of {PROFILE_DECODE_STEPS}" in p.how and f"{PROFILE_CONTEXT}-token prompt" in p.how
    assert "median" in b.how and "128 tokens of context" in b.how and "16:59" in b.when
    assert p.load_average == 0.25 and b.load_average is None and p.threads == b.threads == 1
    # 1.25x and 1.30x of their floors: the same distance within 10%, not within 1%
    assert comparison.same_distance_from_floor() and not comparison.same_distance_from_floor(0.01)


def test_a_slower_engine_is_not_blamed_on_the_machine():
    comparison = reconcile.compare_steps(profile(), bench(step_s=0.040, read=32e9), "x.json")
    assert comparison.read_ratio == 1.0 and not comparison.same_distance_from_floor()


def test_a_recorded_load_and_step_count_are_shown():
    comparison = reconcile.compare_steps(profile(), bench(load=1.5, timed_steps=5), "x.json")
    assert comparison.benchmark.load_average == 1.5 and "median of 5 decode steps" in comparison.benchmark.how
    rates = reconcile.read_rates(comparison, bench(load=1.5), linear(), "cpu_linear_x.json")
    assert "load 1.50" in rates[1].run and "load not recorded" in rates[3].run


def test_every_rate_says_what_moved_where_and_what_uses_it():
    comparison = reconcile.compare_steps(profile(), bench(), "cpu_engine_x.json")
    rates = reconcile.read_rates(comparison, bench(), linear(), "cpu_linear_x.json")
    by_name = {r.name: r for r in rates}
    assert [r.bytes_per_s / 1e9 for r in rates[:5]] == pytest.approx([32, 24, 22, 28.4, 20.8])
    assert by_name["profile's read"].used_for.startswith(f"the profile's floor, {WEIGHTS / 32e9 * 1e3:.1f} ms")
    assert f"{WEIGHTS / 24e9 * 1e3:.1f} ms" in by_name["benchmark's read"].used_for
    assert f"the weights alone: {WEIGHTS / 22e9 * 1e3:.1f} ms" in by_name["benchmark's copy"].used_for
    assert by_name["weights through one product row"].measures.endswith("(rowwise), weight bytes ÷ time")
    assert by_name["weights through the profile's step"].bytes_per_s == pytest.approx(WEIGHTS / 0.020)
    assert "14:43" in by_name["profile's read"].run and "cpu_engine_x.json" in by_name["benchmark's read"].run
    assert "cpu_linear_x.json" in by_name["product table's read"].run and all(r.threads == 1 for r in rates)
    assert f"{roofline.CPU_READ_BYTES >> 20} MiB in 2 MiB pages" in by_name["benchmark's read"].measures
    table = reconcile.rates_table(rates).splitlines()
    assert len(table) == 2 + len(rates) and all(line.count("|") == 7 for line in table)


def test_the_product_tables_read_is_described_as_cpu_linear_measures_it():
    source = (REPO / "benchmarks" / "cpu_linear.py").read_text()
    function = next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == "read_bandwidth")
    default = eval(compile(ast.Expression(function.args.defaults[0]), "cpu_linear", "eval"))
    loops = [n.iter for n in ast.walk(function) if isinstance(n, ast.For)]
    assert default == reconcile.LINEAR_SUM_BYTES
    assert [ast.literal_eval(loop.args[0]) for loop in loops] == [reconcile.LINEAR_SUM_REPEATS]
    assert "torch.randn" in ast.get_source_segment(source, function)


def test_the_weight_bytes_are_the_committed_benchmarks_own():
    """The comparison counts the bytes from the model config; the benchmark's floor was counted the same way
    (a run on the GGUF's blocks: the file's own bytes, every tensor as stored)."""
    from lifeofprompt.lessons.quantization import gguf_bytes

    for path in sorted((REPO / "benchmarks" / "results").glob("cpu_engine_*.json")):
        cpu = json.loads(path.read_text())
        if "batch1_step" in cpu:
            b1 = cpu["batch1_step"]
            expected = reconcile.batch1_weight_bytes(getattr(torch, cpu["dtype"]))
            if cpu.get("quantization") == "gguf":
                expected = gguf_bytes().total_bytes
            assert b1["floor_s"] * b1["read_bandwidth"] == pytest.approx(expected, rel=1e-9), path.name

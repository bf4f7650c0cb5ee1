"""Chapter 10 and the measurements appendix: the figure helpers read the benchmark JSON the scripts write."""

import re
from types import SimpleNamespace

import matplotlib

matplotlib.use("Agg")

from lifeofprompt.engine.step_output import Launch  # noqa: E402
from lifeofprompt.figures.engine import decode_breakdown, kernels_of_step, plot_cpu_linear  # noqa: E402

MODEL = SimpleNamespace(config=SimpleNamespace(num_layers=22))


def test_kernels_of_step_names_the_fused_kernels_only_when_used():
    plain = kernels_of_step(MODEL, Launch("eager", 5, None, "torch", "torch"))
    fused = kernels_of_step(MODEL, Launch("CUDA graph replay", 3, 4, "triton", "fused"))
    assert plain.startswith("22 × [RMSNorm, qkv GEMM, RoPE, torch store_kv") and "fused" not in plain
    assert "fused add+RMSNorm" in fused and "fused SiLU·up" in fused and fused.endswith("(batch 3 padded to 4)")
    c_step = kernels_of_step(MODEL, Launch("eager", 2, None, "torch", "c-step (packed)"))
    assert c_step.startswith("22 layers in one C call") and "fused add" not in c_step


def test_decode_breakdown_in_ms_with_the_unfused_step():
    decode = dict(
        engine_step_s=0.0012,
        engine_step_unfused_s=0.0027,
        floor_s=0.00049,
        eager_kernel_time_by_kind_s=dict(fused=0.0001, matmul=0.0008),
    )
    rows = dict(decode_breakdown(decode))
    assert rows["  the same without the fused kernels"] == 2.7
    assert rows["  fused element-wise kernels"] == 0.1 and "  small element-wise kernels" not in rows


def test_cpu_linear_plot_has_one_line_per_path():
    env = dict(machine="test machine", torch="2.x", date="today")
    rows = [
        {"rows": m, "x @ W.T": {"weight_GB_per_s": 10 / m}, "oneDNN packed": {"weight_GB_per_s": 15 / m}}
        for m in (1, 2, 4)
    ]
    fig = plot_cpu_linear(dict(env=env, threads=1, rows=rows, sum_read_GB_per_s=27.0))
    drawn = {line.get_label(): list(line.get_ydata()) for line in fig.axes[0].get_lines()}
    assert drawn["x @ W.T"] == [10.0, 5.0, 2.5] and drawn["oneDNN packed"] == [15.0, 7.5, 3.75]  # each path's data


def numbers(text: str) -> list[float]:
    """The numbers a table cell shows, whatever words and units surround them."""
    return [float(n.replace(",", "")) for n in re.findall(r"\d[\d,]*(?:\.\d+)?", text)]


def test_the_measured_table_has_only_measured_rows_and_the_tests_final_state(tmp_path):
    import json

    from lifeofprompt.figures.engine import measured_table

    gpu = dict(
        machine=dict(copy_bandwidth=4.22e12, matmul_n=8192, matmul_flops=7.146e14),
        decode=dict(context=500, engine_step_s=0.0027, graph_replay_s=0.0026, eager_forward_s=0.016, floor_s=0.00049),
        ours=dict(requests=128, tokens_per_s=9091.4, seconds=7.54),
        peer=dict(available=False),
        story=dict(alone=[dict(prompt="hello there", ttft_s=0.0171, decode_tokens_per_s=368.0)]),
    )
    (tmp_path / "gpu_results.json").write_text(json.dumps(gpu))
    (tmp_path / "kernel_gpu_tests.log").write_text("collected 37 items\n....\n37 passed in 64.42s\n")
    rows = [dict(kernel="triton paged", batch=64, context_len=4096, num_kv_splits=1, ms=0.0814, gb_per_s=3305.1)] * 2
    rows.append(dict(kernel="triton paged", batch=8, context_len=512, num_kv_splits=1, ms=0.01, gb_per_s=1.0))
    (tmp_path / "kernel_bench_tinyllama_heads.json").write_text(json.dumps({"rows": rows}))
    (tmp_path / "pytest_gpu.txt").write_text("F...\n1 failed, 3 passed in 10.83s\n")
    (tmp_path / "rerun-18h37").mkdir()
    (tmp_path / "rerun-18h37" / "pytest_gpu.txt").write_text("....\n4 passed in 26.92s\n")
    table = dict(measured_table(gpu, tmp_path / "gpu_results.json"))
    assert numbers(table["copy bandwidth (read + write, 2 GiB)"]) == [4220]  # the results' numbers, as rounded
    assert numbers(table["attention b64×4096: triton paged, no KV split"]) == [0.081, 3305]
    assert not any("b8×512" in k for k in table) and not any("transformers" in k for k in table)  # the peer did not run
    assert numbers(table["story alone: 'hello there'"]) == [17.1, 368]
    assert table["tests/gpu/test_kernels_gpu.py"] == "37 passed"
    assert table["tests/gpu/test_engine_gpu.py"] == "4 passed"  # the last run counts
    assert all(v and v != "-" for v in table.values())
    # A run that came in parts says what each part ran, and that summary replaces the logs' last counts.
    (tmp_path / "tests_summary.tsv").write_text("tests/gpu, every file\t79 passed, 8 failed\nno tab: ignored\n")
    table = dict(measured_table(gpu, tmp_path / "gpu_results.json"))
    assert table["tests/gpu, every file"] == "79 passed, 8 failed" and "tests/gpu/test_engine_gpu.py" not in table


def test_the_gap_above_the_roofline_per_batch_and_trace_lines_break_between_words():
    from lifeofprompt.figures.engine import gap_above_prediction, wrap_line

    gaps = gap_above_prediction([dict(batch=1, step_s=0.003, predicted_s=0.0005), dict(batch=128, step_s=0.005)])
    assert [(b, round(g, 6)) for b, _, _, g in gaps] == [(1, 2.5)]
    line = wrap_line("    kernels: " + kernels_of_step(MODEL, Launch("eager", 5, None, "torch")), width=60)
    assert all(len(piece) <= 60 for piece in line.splitlines()) and len(line.splitlines()) > 1
    assert (
        line.replace("\n" + " " * 13, " ").split()
        == ("kernels: " + kernels_of_step(MODEL, Launch("eager", 5, None, "torch"))).split()
    )


def test_load_results_reads_the_committed_folder_and_takes_the_newest_date(tmp_path, monkeypatch):
    from lifeofprompt.figures import engine

    assert engine.RESULTS_DIR.is_dir() and (engine.RESULTS_DIR.parent / "bench_engine.py").exists()
    assert engine.load_results("cpu_engine_*.json")[0] is not None  # the committed CPU results
    for name in (
        "cpu_engine_amd-epyc_20261201.json",
        "cpu_engine_intel-xeon_20261130.json",
        "cpu_engine_20261129.json",
    ):
        (tmp_path / name).write_text(f'{{"name": "{name}"}}')
    monkeypatch.setattr(engine, "RESULTS_DIR", tmp_path)
    result, path = engine.load_results("cpu_engine_*.json")  # by date, not by CPU name
    assert path.name == "cpu_engine_amd-epyc_20261201.json" and result["name"] == path.name
    assert engine.load_results("nothing_*.json") == (None, None)
    older, path = engine.load_results("cpu_engine_*.json", where=lambda r: "intel" in r["name"])
    assert path.name == "cpu_engine_intel-xeon_20261130.json"


def test_runs_of_one_day_go_by_the_time_they_started(tmp_path, monkeypatch):
    """Two CPUs' runs of one day: the later start wins, whatever their names sort to."""
    import json

    from lifeofprompt.figures import engine

    for name, started in (
        ("cpu_engine_amd-epyc_20261202.json", "2026-12-02 00:36 UTC"),
        ("cpu_engine_amd-epyc-avx2_20261202.json", "2026-12-02 07:04 UTC"),
    ):
        (tmp_path / name).write_text(json.dumps({"env": {"date": started}}))
    monkeypatch.setattr(engine, "RESULTS_DIR", tmp_path)
    assert engine.load_results("cpu_engine_*.json")[1].name == "cpu_engine_amd-epyc-avx2_20261202.json"

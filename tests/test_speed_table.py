"""benchmarks/speed_table.py and the CPU names result files carry: one row per CPU actually measured."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from lifeofprompt.env import cpu_label, cpu_vector_isa

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_engine  # noqa: E402
import speed_table  # noqa: E402

ZEN4 = ["avx", "avx2", "avx512f", "avx512bw", "fma"]
ZEN3 = ["avx", "avx2", "fma"]


def test_the_vector_isa_is_the_widest_the_flags_name():
    assert cpu_vector_isa(ZEN4) == "AVX-512" and cpu_vector_isa(ZEN3) == "AVX2"
    assert cpu_vector_isa(ZEN4 + ["amx_tile", "amx_bf16"]) == "AMX"
    assert cpu_vector_isa(["fp", "asimd", "sve"]) == "SVE" and cpu_vector_isa(["fp", "asimd"]) == "NEON"
    assert cpu_label("AMD EPYC", ZEN3) == "AMD EPYC (AVX2)"


def test_two_cpus_of_one_name_get_their_own_files_and_rows(tmp_path):
    """A Zen 3 and a Zen 4 VM both call themselves "AMD EPYC": their results must not overwrite or hide each other."""
    older = {"model": "AMD EPYC", "simd_flags": ZEN4, "flags": ""}  # a file from before vector_isa
    newer = {"model": "AMD EPYC", "vector_isa": "AVX2", "simd_flags": ZEN3, "flags": ""}
    assert bench_engine.cpu_file_slug(older) == "amd-epyc-avx-512"
    assert bench_engine.cpu_file_slug(newer) == "amd-epyc-avx2"
    for name, cpu, date, ratio in (
        ("a.json", older, "2026-12-01", 2.0),
        ("b.json", older, "2026-12-02", 2.5),
        ("c.json", newer, "2026-12-02", 1.5),
    ):
        (tmp_path / name).write_text(
            json.dumps(
                {
                    "cpu": cpu,
                    "env": {"date": date},
                    "threads": 1,
                    "dtype": "float32",
                    "mixed": {},
                    "mixed_speedup": ratio,
                }
            )
        )
    rows = speed_table.newest(speed_table.read_results(tmp_path))
    assert [(r["cpu"], r["mixed_speedup"]) for r in rows] == [("AMD EPYC (AVX-512)", 2.5), ("AMD EPYC (AVX2)", 1.5)]


def test_another_benchmarks_results_beside_them_are_left_out(tmp_path):
    """``benchmarks/async_scheduling.py`` also writes a "mixed" figure, with its CPU as a plain name."""
    (tmp_path / "async_scheduling_x_1t.json").write_text(
        json.dumps({"cpu": "Intel Xeon", "mixed": {"median_ratio": 1}})
    )
    assert speed_table.read_results(tmp_path) == []

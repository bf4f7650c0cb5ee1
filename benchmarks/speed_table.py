"""The CPU speed table: the newest ``bench_engine.py`` result for each CPU (and thread count and
dtype) found in ``benchmarks/results/``, as markdown for the README.

Ratios differ from one processor to the next (1.37x transformers at batch 1 on one AMD EPYC, 0.47x
on an Intel Xeon), so the README shows one row per CPU measured rather than one machine's numbers.

    python benchmarks/speed_table.py              # newest result per CPU, threads and dtype
    python benchmarks/speed_table.py --all        # every result file
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"

# Result files written before bench_engine.py recorded the CPU: all came from one AMD EPYC VM
# (2 cores, x86-64) on 2026-11-30. Their "env" says so much; the name comes from that session.
LEGACY_CPU = "AMD EPYC"
LEGACY_NOTE = (
    "inferred: written on 2026-11-30, before result files named their CPU; "
    "their env.machine (Linux x86_64, 2 CPU cores) matches the AMD EPYC VM of that day"
)

COLUMNS = [  # (header, result key): each ratio is ours ÷ the peer, output tokens/s
    ("mixed ÷ HF static", "mixed_speedup"),
    ("fixed-64 ÷ HF CB", "fixed64_speedup"),
    ("batch-1 ÷ HF generate", "batch1_speedup"),
    ("mixed ÷ llama.cpp", "mixed_vs_llama_cpp"),
    ("batch-1 ÷ llama.cpp", "batch1_vs_llama_cpp"),
    ("batch-1 step ÷ read floor", "batch1_floor_ratio"),  # lower is better: 1.0 is the floor
]


def cpu_name(result: dict) -> tuple[str, bool]:
    """The CPU a result names, with its widest vector instructions (one name, "AMD EPYC", covers VMs
    with and without AVX-512), and whether it was inferred (older files name none)."""
    from lifeofprompt.env import cpu_label

    cpu = result.get("cpu", {})
    if cpu.get("model") and cpu.get("simd_flags"):
        return cpu_label(cpu["model"], cpu["simd_flags"]), False
    if cpu.get("model"):
        return cpu["model"], False
    if result.get("env", {}).get("cpu"):
        return result["env"]["cpu"], False
    machine = result.get("env", {}).get("machine", "")
    if "x86_64" in machine:
        return LEGACY_CPU, True
    return f"unknown ({machine or 'no machine recorded'})", True


def dtype_of(result: dict) -> str:
    """The weights' format: ``quantization`` or ``dtype`` when recorded; older files only say it in ``model``."""
    if result.get("quantization"):  # weights kept as blocks: what a step reads
        return result["quantization"]
    if result.get("dtype"):
        return {"float32": "fp32", "bfloat16": "bf16"}.get(result["dtype"], result["dtype"])
    model = result.get("model", "")
    return model.split("(", 1)[1].split(",", 1)[0].strip() if "(" in model else "?"


def read_results(folder: Path) -> list[dict]:
    """One row per CPU engine result (files with a mixed or batch-1 measurement) in ``folder``."""
    rows = []
    for path in sorted(folder.glob("*.json")):
        try:
            result = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if not isinstance(result, dict) or not ({"mixed", "batch1"} & result.keys()):
            continue
        if not isinstance(result.get("cpu", {}), dict):  # another benchmark's file (its CPU as a plain name)
            continue
        cpu, inferred = cpu_name(result)
        rows.append(
            dict(
                cpu=cpu,
                inferred=inferred,
                date=result.get("env", {}).get("date", "?"),
                threads=result.get("threads", "?"),
                dtype=dtype_of(result),
                file=path.name,
                **{key: result.get(key) for _, key in COLUMNS},
            )
        )
        step = result.get("batch1_step", {})
        rows[-1]["batch1_floor_ratio"] = step.get("ratio")
        rows[-1]["floor_unpaired"] = "ratio" in step and "paired" not in step  # an older file's way (†)
    return rows


def newest(rows: list[dict]) -> list[dict]:
    """The newest row for each (CPU, threads, dtype): ratios at other settings are other measurements."""
    latest: dict[tuple, dict] = {}
    for row in sorted(rows, key=lambda r: (r["date"], r["file"])):
        latest[(row["cpu"], row["threads"], row["dtype"])] = row
    return sorted(latest.values(), key=lambda r: (r["cpu"], str(r["threads"]), r["dtype"]))


def markdown(rows: list[dict]) -> str:
    header = ["CPU", "date", "threads", "weights"] + [name for name, _ in COLUMNS] + ["file"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        ratios = [f"{row[key]:.2f}×" if isinstance(row[key], (int, float)) else "–" for _, key in COLUMNS]
        if row.get("floor_unpaired"):
            ratios[-1] += " †"
        cpu = row["cpu"] + (" *" if row["inferred"] else "")
        cells = [cpu, row["date"].split(" ")[0], str(row["threads"]), row["dtype"], *ratios, f"`{row['file']}`"]
        lines.append("| " + " | ".join(cells) + " |")
    if any(row.get("floor_unpaired") for row in rows):
        lines.append("")
        lines.append(
            "† the step's median against the best read of another moment; newer files take steps and reads "
            "in turns and give the median of their ratios, so the VM's drift between moments cancels."
        )
    if any(row["inferred"] for row in rows):
        lines.append("")
        lines.append(f"\\* {LEGACY_NOTE}.")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--results", type=Path, default=RESULTS, help="folder of bench_engine.py JSON files")
    parser.add_argument("--all", action="store_true", help="every result file, not only the newest per CPU")
    args = parser.parse_args(argv)
    rows = read_results(args.results)
    if not rows:
        print(f"no CPU engine results in {args.results}", file=sys.stderr)
        return 1
    print(markdown(rows if args.all else newest(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Two checkouts of the engine measured in turns by ``bench_engine.py``: is the second as fast as the first?

A refactor must not cost speed, and these machines drift (the same run can differ 2x minutes apart), so
the two trees run one after the other, ``--pairs`` times (before, after, before, ...). Each run's own
peer (transformers) is timed in the same run, so each panel gives a ratio, ours over the peer's; the
comparison is the median over the pairs of after's ratio over before's, per panel, and the same for our
tokens/s alone and for the batch-1 step.

    python benchmarks/compare_trees.py --before /tmp/old --after . --pairs 5

Each tree is a checkout with its own ``.venv`` (or give ``--python``), importing its own package. The
table goes to stdout and, with ``--out``, a JSON and a Markdown file beside the other results.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

PANELS = ("mixed", "fixed64", "batch1")
SMALL = ["--mixed", "8", "--fixed", "4", "--decode-tokens", "32", "--curve", "1", "4", "--pairs", "1"]


def run_once(tree: Path, python: Path, out: Path) -> dict:
    """One ``bench_engine.py`` run of ``tree``, its results file read back."""
    command = [str(python), "benchmarks/bench_engine.py", *SMALL, "--out", str(out)]
    subprocess.run(command, cwd=tree, check=True, capture_output=True, text=True)
    return json.loads(next(out.glob("cpu_engine_*.json")).read_text())


def figures(result: dict) -> dict:
    """Per panel: ours over the peer, and our tokens/s; and the batch-1 step in seconds."""
    out = {"batch1_step_s": result["batch1_step"]["step_s"]}
    for panel in PANELS:
        ours, peer = (row["tokens_per_s"] for row in result[panel][:2])
        out[f"{panel} ratio"], out[f"{panel} ours tok/s"] = ours / peer, ours
    return out


def compare(runs: list[tuple[dict, dict]]) -> dict:
    """Median over the pairs of after over before, per figure (a step time: before over after, so >1 is faster)."""
    table = {}
    for name in runs[0][0]:
        changes = [
            (b[name] / a[name]) if name.endswith("_s") else (a[name] / b[name]) for b, a in runs
        ]  # fmt: skip
        table[name] = {"median": statistics.median(changes), "each": changes}
    return table


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", type=Path, required=True)
    parser.add_argument("--after", type=Path, required=True)
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--out", type=Path, help="write <stem>.json and <stem>.md here")
    args = parser.parse_args(argv)
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    runs, commits = [], {}
    for name, tree in trees.items():
        git = ["git", "-C", str(tree), "log", "-1", "--format=%h %s"]
        commits[name] = subprocess.run(git, capture_output=True, text=True).stdout.strip()[:100]
    with tempfile.TemporaryDirectory() as scratch:
        for i in range(args.pairs):
            pair = []
            for name, tree in trees.items():
                out = Path(scratch) / f"{name}{i}"
                result = run_once(tree, tree / ".venv" / "bin" / "python", out)
                pair.append(figures(result))
                print(f"pair {i + 1} {name}: " + ", ".join(f"{k} {v:.3g}" for k, v in pair[-1].items()), flush=True)
            runs.append(tuple(pair))
    table = compare(runs)
    cpu = f"{result['cpu']['model']} ({result['cpu'].get('vector_isa', '')}), {result['threads']} thread"
    lines = [
        f"# bench_engine.py, two trees in turns ({args.pairs} pairs), {cpu}, {time.strftime('%Y-%m-%d %H:%M UTC')}",
        "",
        f"Each run: `bench_engine.py {' '.join(SMALL)}` (SmolLM2-135M fp32; the peer: transformers, same run).",
        "",
        f"before: {commits['before']}",
        f"after: {commits['after']}",
        "",
        "| figure | after ÷ before, median (step: before ÷ after) | each pair |",
        "|---|---|---|",
    ]
    for name, row in table.items():
        lines.append(f"| {name} | {row['median']:.3f} | {', '.join(f'{x:.3f}' for x in row['each'])} |")
    print("\n".join(lines))
    if args.out:
        stem = args.out / f"compare_trees_{time.strftime('%Y%m%d_%H%M')}"
        stem.with_suffix(".json").write_text(json.dumps(dict(commits=commits, cpu=cpu, table=table), indent=1))
        stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

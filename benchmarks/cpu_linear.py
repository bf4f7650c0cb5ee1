"""How fast the CPU streams a model's weights through each matrix-product path, by batch rows.

For every row count ``M`` it multiplies ``x [M, in]`` by all of SmolLM2-135M's 120 layer matrices
in turn (425 MB of fp32: more than any cache, as in a real forward) and reports milliseconds and
the weight bytes read per second, for:

every path of ``lifeofprompt.model.linear`` available on this machine (``linear`` is ``x @ W.T``, what
``nn.Linear`` and transformers run; ``onednn`` uses weights reordered once; ``rowwise`` is the
compiled kernel), and, for scale, how fast the threads read memory with ``tensor.sum()``. Shapes
are random numbers of SmolLM2's sizes. The engine does a shorter version of this at start-up
(``lifeofprompt.cpu.linear_calibration``) and keeps the fastest path per shape and row count.

    python benchmarks/cpu_linear.py                # one thread, writes results/cpu_linear_<cpu>_<date>.json and .png
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from lifeofprompt.lessons.story_model import SMOLLM2_135M
from lifeofprompt.model.linear import Linear, available_paths, run_path

RESULTS = Path(__file__).resolve().parent / "results"


def layer_weights(config, seed: int = 0) -> list[torch.Tensor]:
    """Random weights with the shapes of every fused layer matrix (qkv, o, gate_up, down)."""
    g = torch.Generator().manual_seed(seed)
    h, i = config.hidden_size, config.intermediate_size
    qkv = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
    shapes = [(qkv, h), (h, config.num_heads * config.head_dim), (2 * i, h), (h, i)]
    return [torch.randn(*s, generator=g) for _ in range(config.num_layers) for s in shapes]


def as_modules(weights: list[torch.Tensor]) -> list[Linear]:
    """Each weight in a ``Linear``, prepacked for oneDNN (the packed copy is only read by that path)."""
    modules = []
    for w in weights:
        module = Linear(w.shape[1], w.shape[0], bias=False)
        module.weight.data = w
        module.prepack()
        modules.append(module)
    return modules


def time_pass(path: str, modules: list[Linear], rows: int, reps: int) -> float:
    """Seconds for one pass of ``rows`` rows through every matrix (median of ``reps`` after a warm-up)."""
    xs = {m.in_features: torch.randn(rows, m.in_features) for m in modules}
    times = []
    for _ in range(reps + 1):
        start = time.perf_counter()
        for m in modules:
            run_path(path, xs[m.in_features], m)
        times.append(time.perf_counter() - start)
    return sorted(times[1:])[len(times[1:]) // 2]


def read_bandwidth(nbytes: int = 256 << 20) -> float:
    """Bytes per second one ``sum()`` over a large fp32 tensor reads."""
    x = torch.randn(nbytes // 4)
    x.sum()
    start = time.perf_counter()
    for _ in range(5):
        x.sum()
    return 5 * nbytes / (time.perf_counter() - start)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8, 16, 32, 64, 256])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from lifeofprompt import env_info

    weights = layer_weights(SMOLLM2_135M)
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    modules = as_modules(weights)
    rows_out = []
    with torch.no_grad():
        for rows in args.rows:
            row = {"rows": rows}
            for name in available_paths():
                seconds = time_pass(name, modules, rows, args.reps)
                row[name] = {"ms": seconds * 1e3, "weight_GB_per_s": nbytes / seconds / 1e9}
            rows_out.append(row)
            print(
                f"M={rows:<4} "
                + "  ".join(
                    f"{k} {v['ms']:7.1f} ms {v['weight_GB_per_s']:5.1f} GB/s" for k, v in row.items() if k != "rows"
                ),
                flush=True,
            )
    result = {
        "env": env_info(),
        "threads": args.threads,
        "weight_bytes": nbytes,
        "sum_read_GB_per_s": read_bandwidth() / 1e9,
        "load_average": os.getloadavg()[0],
        "rows": rows_out,
    }
    print(f"{args.threads} thread(s) read memory with sum() at {result['sum_read_GB_per_s']:.1f} GB/s")
    args.out.mkdir(parents=True, exist_ok=True)
    from bench_engine import cpu_description, cpu_file_slug  # results are named after the CPU they ran on

    result["cpu"] = cpu_description()
    threads = "" if args.threads == 1 else f"_{args.threads}t"
    path = args.out / f"cpu_linear_{cpu_file_slug(result['cpu'])}{threads}_{time.strftime('%Y%m%d')}.json"
    path.write_text(json.dumps(result, indent=2, default=str))
    import matplotlib

    matplotlib.use("Agg")
    from lifeofprompt.figures.engine import plot_cpu_linear

    plot_cpu_linear(result, path.with_suffix(".png"))
    print(f"wrote {path} and its plot")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

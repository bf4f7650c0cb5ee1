"""The batch-1 step with GGUF block weights (Q8_0, Q4_1) on a GPU, each against its own bytes' floor, beside bf16.

    python3 benchmarks/gpu_block_step.py [--out DIR] [--work DIR] [--cpu-dry-run]

A decode step at batch 1 reads every weight once, so its floor is the bytes it reads ÷ the memory
bandwidth: bf16 reads 16 bits a weight, Q8_0 8.5, Q4_1 5. Two measurements, each beside that floor:

* **products**: the Triton block kernel (``kernels/block_matmul.py``) alone on each of TinyLlama's five
  matrix shapes, 1 and 16 activation rows, timed by triton's ``do_bench`` (median, L2 flushed before
  every call, as a decode step's weights are never in L2), next to torch's bf16 product of the same
  weights dequantized; and a few tile choices for 1 row (a sweep, to check the default's heuristic).
* **forward**: ``load_model('tinyllama-1.1b-random', device='cuda')`` (bf16, RANDOM weights) as
  loaded ("float") and ``quantize_model``-ed to each format, one token through the whole model
  (``NoCacheMetadata`` of one row), timed with CUDA events: eager, and replayed from a CUDA graph
  (the launch cost removed) on the torch path and on the fused-kernel path. Floor: the bytes of the
  matrices and norms ÷ copy bandwidth.

Copy bandwidth (bytes read + written, as ``gpu_check.py machine`` measures it) comes from
``WORK/machine.json`` when that step ran, else is measured here. Writes ``OUT/block_step.json`` and
prints a table. ``--cpu-dry-run`` runs the same code on the CPU: the products at tiny shapes in
Triton's interpreter, the forward on a tiny random Llama (its products on the CPU block path), no
graphs: a smoke test of the script, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from lifeofprompt.lessons.flops import matrix_shapes
from lifeofprompt.model.config import TINYLLAMA_1_1B

RANDOM_LABEL = "tinyllama-1.1b-random: TinyLlama-1.1B shapes, bf16, RANDOM WEIGHTS (speed only)"
TINYLLAMA = matrix_shapes(TINYLLAMA_1_1B)  # qkv 2560 x 2048, o, gate_up 11264 x 2048, down, head 32000 x 2048
DRY_SHAPES = {"qkv": (96, 64), "o": (64, 64), "gate_up": (160, 64), "down": (64, 100), "head": (256, 64)}
FORMATS = ("q8_0", "q4_1")
SWEEP = (dict(split_k=1), dict(block_n=16), dict(block_n=64), dict(block_n=16, split_k=1), dict(block_k=64))


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/lifeofprompt_gpu_out"))
    parser.add_argument("--work", default=os.environ.get("WORK", "/tmp/lifeofprompt_gpu_work"))
    parser.add_argument("--cpu-dry-run", action="store_true", help="tiny shapes on the CPU (interpreter): a smoke test")
    parser.add_argument("--formats", default=",".join(FORMATS), help="comma-separated block formats")
    parser.add_argument("--no-sweep", action="store_true", help="skip the tile sweep")
    parser.add_argument("--no-forward", action="store_true", help="time the products only")
    parser.add_argument(
        "--deadline", type=float, default=45, help="seconds after which the sweep and graphs are skipped"
    )
    args = parser.parse_args(argv)
    args.formats = [f for f in args.formats.split(",") if f]
    if unknown := set(args.formats) - set(FORMATS):
        parser.error(f"unknown formats {sorted(unknown)}: use {', '.join(FORMATS)}")
    args.device = "cpu" if args.cpu_dry_run else "cuda"
    return args


# ----------------------------------------------------------------------------- timing


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def bench_call(fn, device: str) -> float:
    """Median seconds of one call: ``do_bench`` on a GPU (L2 flushed before each), the wall clock on a CPU."""
    if device == "cuda":
        from triton.testing import do_bench

        try:
            return do_bench(fn, warmup=10, rep=40, return_mode="median") / 1e3
        except TypeError:  # a triton without return_mode
            return do_bench(fn, warmup=10, rep=40, quantiles=[0.5])[0] / 1e3
    fn()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_calls(fn, device: str, calls: int = 20, rounds: int = 5) -> float:
    """Seconds per call: the median over ``rounds`` of ``calls`` back-to-back calls (CUDA events on a GPU)."""
    fn()
    sync(device)
    per_call = []
    for _ in range(rounds):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            end.synchronize()
            per_call.append(start.elapsed_time(end) / 1e3 / calls)
        else:
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            per_call.append((time.perf_counter() - t0) / calls)
    return statistics.median(per_call)


def graph_time(fn, calls: int = 20) -> float:
    """Seconds per call of ``fn`` captured once in a CUDA graph and replayed (no launch cost from the host)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()  # compile, build plans, warm the allocator outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return time_calls(graph.replay, "cuda", calls)


def copy_bandwidth(args) -> tuple[float, str]:
    """Bytes read + written per second of a device copy: from ``gpu_check.py machine`` if it ran, else measured."""
    part = Path(args.work) / "machine.json"
    if part.exists() and "copy_bandwidth" in (machine := json.loads(part.read_text())):
        return machine["copy_bandwidth"], str(part)
    nbytes = (16 << 20) if args.cpu_dry_run else (1 << 30)
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=args.device).normal_()
    dst = torch.empty_like(src)
    return 2 * nbytes / bench_call(lambda: dst.copy_(src), args.device), "measured here (copy of 1 GiB)"


# ----------------------------------------------------------------------------- products


def random_blocks(out_features: int, in_features: int, fmt: str, device: str):
    from lifeofprompt.model.block_formats import quantize

    weight = torch.randn(out_features, in_features, device=device) * 0.02
    return quantize(weight.to(torch.bfloat16), fmt)


def product_row(name, fmt, rows, blocks, bandwidth, device) -> dict:
    """One matrix, one format, ``rows`` activation rows: the block kernel and torch's bf16 product."""
    from lifeofprompt.kernels.block_matmul import _num_sms, block_matmul, choose_tiles

    from lifeofprompt.model.block_formats import dequantize

    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # the interpreter's bf16 dot is wrong
    x = torch.randn(rows, blocks.in_features, device=device).to(dtype)
    w = dequantize(blocks, dtype)
    seconds = bench_call(lambda: block_matmul(x, blocks), device)
    float_seconds = bench_call(lambda: x @ w.t(), device)
    tiles = choose_tiles(rows, blocks, _num_sms(0) if device == "cuda" else None)
    floor, float_floor = blocks.nbytes / bandwidth, w.numel() * w.element_size() / bandwidth
    return dict(
        matrix=name,
        shape=[blocks.out_features, blocks.in_features],
        format=fmt,
        rows=rows,
        bytes=blocks.nbytes,
        seconds=seconds,
        floor_s=floor,
        over_floor=seconds / floor,
        read_bandwidth=blocks.nbytes / seconds,
        tiles=tiles.__dict__,
        float_dtype=str(dtype).removeprefix("torch."),
        float_bytes=w.numel() * w.element_size(),
        float_seconds=float_seconds,
        float_over_floor=float_seconds / float_floor,
        speedup_over_float=float_seconds / seconds,
    )


def sweep_rows(name, fmt, blocks, bandwidth, device) -> list[dict]:
    """One row through ``blocks`` with each tile choice of ``SWEEP``, against the floor."""
    from lifeofprompt.kernels.block_matmul import block_matmul

    x = torch.randn(1, blocks.in_features, device=device).to(torch.bfloat16 if device == "cuda" else torch.float32)
    rows = []
    for options in SWEEP:
        try:
            seconds = bench_call(lambda o=options: block_matmul(x, blocks, **o), device)
            rows.append(
                dict(
                    matrix=name,
                    format=fmt,
                    options=options,
                    seconds=seconds,
                    over_floor=seconds * bandwidth / blocks.nbytes,
                )
            )
        except Exception as exc:  # noqa: BLE001 - a tile choice that does not compile is a result too
            rows.append(dict(matrix=name, format=fmt, options=options, error=repr(exc)[:300]))
    return rows


def products(args, bandwidth: float, start: float) -> dict:
    shapes = DRY_SHAPES if args.cpu_dry_run else TINYLLAMA
    out = dict(rows=[], sweep=[])
    for fmt in args.formats:
        for name, (out_features, in_features) in shapes.items():
            blocks = random_blocks(out_features, in_features, fmt, args.device)
            for rows in (1, 16):
                out["rows"].append(product_row(name, fmt, rows, blocks, bandwidth, args.device))
            if not args.no_sweep and time.perf_counter() - start < args.deadline / 2:
                out["sweep"] += sweep_rows(name, fmt, blocks, bandwidth, args.device)
    return out


# ----------------------------------------------------------------------------- the whole forward


def build_model(args):
    """The random TinyLlama in bf16 on the GPU; a tiny random Llama in fp32 on the CPU for a dry run."""
    if not args.cpu_dry_run:
        from lifeofprompt import load_model

        return load_model("tinyllama-1.1b-random", device="cuda")[0]
    from dataclasses import replace

    from lifeofprompt.model.config import TINYLLAMA_1_1B
    from lifeofprompt.model.llama import LlamaForCausalLM

    config = replace(
        TINYLLAMA_1_1B, name="tiny-random (dry run)", vocab_size=512, hidden_size=64, intermediate_size=128,
        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=256,
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def step_bytes(model) -> int:
    """Bytes a one-token step reads: the matrices (blocks or floats) and the norms; one embedding row aside."""
    from lifeofprompt.model.quantized_linear import LAYER_MATRICES, QuantizedLinear

    def size(module) -> int:
        if isinstance(module, QuantizedLinear):
            return module.nbytes
        return module.weight.numel() * module.weight.element_size()

    matrices = [layer.get_submodule(name) for layer in model.layers for name in LAYER_MATRICES] + [model.lm_head]
    norms = [m for name, m in model.named_modules() if name.endswith("norm")]
    return sum(size(m) for m in matrices) + sum(m.weight.numel() * m.weight.element_size() for m in norms)


def forward_row(args, fmt: str, bandwidth: float, start: float) -> dict:
    """One token through the whole model in ``fmt`` ("float": the model as loaded, bf16 on a GPU): eager and
    graphed (the graphs skipped past the deadline)."""
    from lifeofprompt.model.attention import NoCacheMetadata
    from lifeofprompt.model.layers import fused_kernels
    from lifeofprompt.model.quantized_linear import quantize_model

    model = build_model(args)
    if fmt != "float":
        quantize_model(model, fmt)
    ids = torch.tensor([1234 % model.config.vocab_size], device=args.device)
    positions = torch.tensor([100], device=args.device)
    meta = NoCacheMetadata.for_lengths([1], device=args.device)
    nbytes = step_bytes(model)
    row = dict(format=fmt, dtype=str(model.dtype).removeprefix("torch."), step_bytes=nbytes, floor_s=nbytes / bandwidth)
    with torch.no_grad():
        row["eager_s"] = time_calls(
            lambda: model(ids, positions, meta), args.device, calls=5 if args.cpu_dry_run else 10
        )
        for mode, name in [] if args.cpu_dry_run else [("off", "torch"), ("auto", "fused")]:
            if time.perf_counter() - start > args.deadline:
                row[f"graph_{name}_error"] = "skipped: past the deadline"
                continue
            try:
                with fused_kernels(mode):  # the layers' own fused kernels on, or off (model/layers.py)
                    row[f"graph_{name}_s"] = graph_time(lambda: model(ids, positions, meta))
            except Exception as exc:  # noqa: BLE001 - report it, keep the other numbers
                row[f"graph_{name}_error"] = repr(exc)[:300]
    for key in [k for k in row if k.endswith("_s") and k != "floor_s"]:
        row[key.removesuffix("_s") + "_over_floor"] = row[key] / row["floor_s"]
    return row  # the model goes with this frame; forwards() empties the cache before the next


def forwards(args, bandwidth: float, start: float) -> list[dict]:
    rows = []
    for fmt in ["float", *args.formats]:
        try:
            rows.append(forward_row(args, fmt, bandwidth, start))
        except Exception as exc:  # noqa: BLE001 - one format failing keeps the others
            rows.append(dict(format=fmt, error=repr(exc)[:500]))
        if args.device == "cuda":
            torch.cuda.empty_cache()
    return rows


# ----------------------------------------------------------------------------- report


def print_table(result: dict) -> None:
    ms = lambda s: "-" if s is None else f"{s * 1e3:.3f} ms"  # noqa: E731
    print(f"\n{result['label']} | {result['device']} | copy bandwidth {result['copy_bandwidth'] / 1e9:.0f} GB/s")
    head = ("matrix", "fmt", "rows", "blocks", "floor", "x floor", "float", "speedup")
    print("{:<8} {:<5} {:>4} {:>11} {:>11} {:>7} {:>11} {:>7}".format(*head))
    for r in result["products"]["rows"]:
        print(
            f"{r['matrix']:<8} {r['format']:<5} {r['rows']:>4} {ms(r['seconds']):>11} {ms(r['floor_s']):>11} "
            f"{r['over_floor']:>7.2f} {ms(r['float_seconds']):>11} {r['speedup_over_float']:>7.2f}"
        )
    for r in result.get("forward", []):
        if "error" in r:
            print(f"forward {r['format']}: ERROR {r['error']}")
            continue
        timings = ", ".join(
            f"{k.removesuffix('_s')} {ms(v)}" for k, v in r.items() if k.endswith("_s") and k != "floor_s"
        )
        size = f"{r['step_bytes'] / 1e6:8.1f} MB, floor {ms(r['floor_s'])}"
        print(f"forward {r['format']:<5} {r['dtype']:<8} {size}: {timings}")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: use --cpu-dry-run", file=sys.stderr)
        return 2
    import lifeofprompt.kernels  # noqa: F401 - first, so the interpreter is chosen before anything imports triton

    start = time.perf_counter()
    torch.manual_seed(0)
    if args.cpu_dry_run:
        torch.set_num_threads(1)
    bandwidth, source = copy_bandwidth(args)
    result = dict(
        label=RANDOM_LABEL if not args.cpu_dry_run else "CPU DRY RUN (tiny shapes, interpreter) - not a measurement",
        device=torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        versions=dict(torch=torch.__version__, triton=__import__("triton").__version__),
        copy_bandwidth=bandwidth,
        copy_bandwidth_source=source,
    )
    result["products"] = products(args, bandwidth, start)
    if not args.no_forward:
        result["forward"] = forwards(args, bandwidth, start)
    result["seconds"] = time.perf_counter() - start
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "block_step.json").write_text(json.dumps(result, indent=1, default=str))
    print_table(result)
    print(f"[block_step] done in {result['seconds']:.1f} s -> {Path(args.out) / 'block_step.json'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

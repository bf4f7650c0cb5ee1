"""Batch-1 decode at long contexts with the KV pool in fp32 and in q8_0 (``kv_cache_dtype``), in turns.

A decode step at context N reads the weights and N tokens of keys and values in every layer. The engine
runs with its defaults (the GGUF's blocks, every CPU speed-up timed at start-up) and only the pool's form
differs. The context is not prefilled: a sequence's block table points at a pool already N tokens long
(what it holds does not change the work), and the step decodes the token after it. Each context times
runs of steps of each form in turns (``--pairs`` of them), and gives the median of the pairs' ratios
with their spread, beside each form's floor: weight bytes + N tokens of cache bytes over the read rate,
measured in the same turns.

    python benchmarks/kv_cache_dtype.py --threads 2            # contexts 256 1024 2048 4096
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_engine import RESULTS, cpu_description, cpu_file_slug  # noqa: E402

FORMS = ("auto", "q8_0")
STEPS = 8  # decode steps per timed run


def engine(form: str, context: int):
    from lifeofprompt import LLM

    blocks = -(-(context + 4 * STEPS * 12) // 16) + 1
    return LLM("smollm2-135m", kv_cache_dtype=form, num_kv_blocks=blocks, max_num_seqs=1, log_stats=False)


def decode_run(llm, context: int, seed: int) -> float:
    """The median seconds of ``STEPS`` batch-1 decode steps after a pointed-at context of ``context`` tokens."""
    from lifeofprompt.engine.sampling_params import SamplingParams
    from lifeofprompt.engine.sequence import Sequence
    from lifeofprompt.lessons.greedy_loop import step

    runner = llm.engine.runner
    rng = random.Random(seed)
    seq = Sequence(f"long-{seed}", [rng.randint(3, 9999) for _ in range(context + 1)], SamplingParams(temperature=0))
    seq.block_table = list(range(runner.resolved.num_kv_blocks - 1))
    seq.num_computed_tokens = context  # the pool already holds the context: only the decode is run
    step(runner, [seq], [1])  # warm-up
    seconds = []
    for _ in range(STEPS):
        start = time.perf_counter()
        step(runner, [seq], [1])
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def read_seconds(buffer: torch.Tensor) -> float:
    start = time.perf_counter()
    buffer.sum()
    return time.perf_counter() - start


def measure(context: int, pairs: int) -> dict:
    from lifeofprompt.cpu.huge_pages import huge_page_buffer
    from lifeofprompt.engine.memory import kv_bytes_per_token
    from lifeofprompt.model.quantized_linear import weight_bytes

    engines = {form: engine(form, context) for form in FORMS}
    model = engines["auto"].engine.model
    reads = {}
    for form in FORMS:
        nbytes = weight_bytes(model) + context * kv_bytes_per_token(model.config, model.dtype, form)
        reads[form] = (nbytes, huge_page_buffer(nbytes // 4 * 4).view(torch.float32).fill_(1.0))
    runs = {form: [] for form in FORMS}
    floors = {form: [] for form in FORMS}
    for pair in range(pairs):
        for form in FORMS:
            floors[form].append(read_seconds(reads[form][1]))
            runs[form].append(decode_run(engines[form], context, seed=pair))
    ratios = [a / q for a, q in zip(runs["auto"], runs["q8_0"])]
    record = dict(context=context, pairs=pairs, speedup=statistics.median(ratios), spread=[min(ratios), max(ratios)])
    for form in FORMS:
        to_floor = [s / f for s, f in zip(runs[form], floors[form])]
        record[form] = dict(
            step_s=statistics.median(runs[form]),
            bytes=reads[form][0],
            floor_s=statistics.median(floors[form]),
            step_over_floor=statistics.median(to_floor),
            startup_log=[
                line for line in engines[form].engine.startup_log if line.startswith(("KV", "decode", "steps"))
            ],
        )
    return record


def main(argv=None) -> int:
    from lifeofprompt import env_info

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 2048, 4096])
    parser.add_argument("--pairs", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    for context in args.contexts:
        row = measure(context, args.pairs)
        rows.append(row)
        a, q = row["auto"], row["q8_0"]
        print(
            f"context {context}: fp32 cache {a['step_s'] * 1e3:.2f} ms ({a['step_over_floor']:.2f}x its floor), "
            f"q8_0 {q['step_s'] * 1e3:.2f} ms ({q['step_over_floor']:.2f}x), q8_0 {row['speedup']:.2f}x faster "
            f"({row['spread'][0]:.2f}-{row['spread'][1]:.2f})",
            flush=True,
        )
    cpu = cpu_description()
    record = dict(env=env_info(), cpu=cpu, threads=args.threads, rows=rows)
    path = RESULTS / f"kv_cache_dtype_{cpu_file_slug(cpu)}_{args.threads}t_{time.strftime('%Y%m%d')}.json"
    path.write_text(json.dumps(record, indent=2, default=str))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

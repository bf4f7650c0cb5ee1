"""The step's host time at batch 1 and 32, at a context of 64 and of 4,096 tokens: does it grow with the context?

A step's host work is everything but the forward: schedule, prepare the flat batch, sample, update the
scheduler, make the outputs. None of it needs a sequence's history, so none of it should grow with
the context. Here the model's forward is a stub that returns zero logits of the right shape (the
tiny random model's vocabulary), so what is timed is the host work alone; sampling a zero row is the
same work at any context. Each figure is the median of the decode steps of one run, and the two
contexts take turns, run after run (64, 4,096, 64, ...), so a machine that drifts moves both.

    python benchmarks/step_host_time.py            # 5 pairs; results/step_host_time_<cpu>_<date>.{json,md}
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from lifeofprompt.engine.llm_engine import LLMEngine
from lifeofprompt.engine.sampling_params import SamplingParams
from lifeofprompt.env import cpu_label
from lifeofprompt.lessons.tiny_models import TINY_SMOLLM2_LAYOUT, tiny_model

BLOCK_SIZE = 16
CONTEXTS = (64, 4096)
BATCHES = (1, 32)
RESULTS = Path(__file__).parent / "results"


def engine_for(batch: int, context: int, steps: int) -> LLMEngine:
    """An engine on the tiny random model, its pool large enough for ``batch`` sequences of the context,
    its forward a stub (host work only)."""
    config = replace(TINY_SMOLLM2_LAYOUT, max_position_embeddings=8192)
    model, tokenizer = tiny_model(config=config)
    blocks = batch * -(-(context + steps + 1) // BLOCK_SIZE) + 1
    engine = LLMEngine(
        model, tokenizer=tokenizer, num_kv_blocks=blocks, block_size=BLOCK_SIZE, max_num_seqs=batch,
        max_num_batched_tokens=batch * context, log_stats=False, cpu_tuning="linear",
    )  # fmt: skip
    vocab = config.vocab_size
    engine.runner.run_model = lambda ids, positions, meta: torch.zeros(len(meta.logits_indices), vocab)
    return engine


def host_seconds_per_step(batch: int, context: int, steps: int) -> float:
    """The median wall time of ``steps`` decode steps of ``batch`` sequences at ``context`` tokens."""
    engine = engine_for(batch, context, steps)
    params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
    for i in range(batch):
        engine.add_request(str(i), [(7 * i + t) % 300 + 10 for t in range(context)], params)
    engine.step()  # every prompt in one step: from here on, decodes only
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for batch in BATCHES:
        pairs = []
        for _ in range(args.pairs):
            short, long = (host_seconds_per_step(batch, c, args.steps) for c in CONTEXTS)
            pairs.append({"context_64_s": short, "context_4096_s": long, "ratio": long / short})
        ratio = statistics.median(p["ratio"] for p in pairs)
        rows.append({"batch": batch, "pairs": pairs, "median_ratio": ratio})
        print(f"batch {batch:2d}: host time per step at 4,096 ÷ at 64 = {ratio:.3f} (median of {args.pairs} pairs)")
    cpu = cpu_label()
    stamp = datetime.date.today().strftime("%Y%m%d")
    slug = cpu.lower().replace(" ", "-").replace("(", "").replace(")", "").replace("/", "-")
    out = {"cpu": cpu, "date": stamp, "steps": args.steps, "threads": 1, "rows": rows}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"step_host_time_{slug}_{stamp}.json").write_text(json.dumps(out, indent=1))
    lines = [
        f"# Step host time, context 4,096 against 64 ({cpu}, {stamp})",
        "",
        "The forward stubbed; the median of each run's decode steps; the contexts in turns, one thread.",
        "",
        "| batch | per step at 64 (ms, median) | per step at 4,096 (ms, median) | 4,096 ÷ 64 (median of pairs) |",
        "|---|---|---|---|",
    ]
    for row in rows:
        short = statistics.median(p["context_64_s"] for p in row["pairs"]) * 1e3
        long = statistics.median(p["context_4096_s"] for p in row["pairs"]) * 1e3
        lines.append(f"| {row['batch']} | {short:.3f} | {long:.3f} | {row['median_ratio']:.3f} |")
    (RESULTS / f"step_host_time_{slug}_{stamp}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

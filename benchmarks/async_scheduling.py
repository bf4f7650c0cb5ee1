"""Async scheduling on against off, in turns, on the embedded model (the engine as users get it).

Each pair runs the same work with the next step scheduled while this one runs, then one step at a
time, on one engine (the setting is swapped between runs), so the machine's drift hits both; the
figure is the median of the pairs' ratios, with their spread. Three workloads:

* batch-1 decode: the 48-token prompt, 96 tokens after the first, through ``LLM.generate``
  (tokens/s after the first token);
* batch 16: sixteen prompts, 64 tokens each (tokens/s over the whole call);
* the mixed workload of ``bench_engine.py`` (prompts of 16-256 random ids, outputs 16-128, all at once);
* the loop against the step: the batch-1 loop's time per token, on and off, over the decode step
  ``bench_engine.py`` times (``decode_step_curve``: the runner's step at batch 1, sampling included);
* the step's timeline with it on: forward time, and the gap between one forward and the next.

    python benchmarks/async_scheduling.py --threads 1 --pairs 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import date
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import RESULTS, cpu_description, cpu_file_slug, decode_step_curve, mixed_workload, run_engine  # noqa: E402

PROMPT = "today is a beautiful summer day " * 6  # 48 tokens with SmolLM2's tokenizer


def tokens_per_s(llm, prompts, max_tokens: int, after_first: bool) -> float:
    from lifeofprompt import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    if after_first:
        m = outs[0].metrics
        return (max_tokens - 1) / (m.finished_time - m.first_token_time)
    return len(prompts) * max_tokens / (time.perf_counter() - start)


def in_turns(llm, overlap, pairs: int, run) -> dict:
    """``pairs`` runs of ``run() -> tokens/s`` with it on then off; the median ratio on/off and its spread."""
    rows = []
    for _ in range(pairs):
        pair = {}
        for on in (True, False):
            llm.engine.overlap = overlap if on else None
            pair["on" if on else "off"] = run()
        rows.append(pair)
    ratios = [r["on"] / r["off"] for r in rows]
    return dict(pairs=rows, median_ratio=statistics.median(ratios), spread=[min(ratios), max(ratios)])


def loop_against_step(llm, batch1: dict) -> dict:
    """The batch-1 loop's time per token (the median of its runs, on and off) over ``bench_engine.py``'s
    decode step at batch 1 and the run's mean context."""
    step_s = decode_step_curve(llm.engine.runner, [1], context=48 + 48)[0]["step_s"]
    result = dict(step_ms=step_s * 1e3)
    for way in ("on", "off"):
        loop_s = 1 / statistics.median(r[way] for r in batch1["pairs"])
        result[f"loop_{way}_ms"], result[f"loop_{way}_over_step"] = loop_s * 1e3, loop_s / step_s
    return result


def timeline(llm, overlap) -> dict:
    """With it on: the forward's time and the gap between forwards, from the step trace."""
    llm.engine.overlap = overlap
    first = len(llm.engine.step_records)
    tokens_per_s(llm, [PROMPT], 97, after_first=True)
    records = [r for r in list(llm.engine.step_records)[first:] if r.forward_times][5:]
    pairs = list(zip(records, records[1:]))
    return dict(
        forward_ms=1e3 * statistics.median(r.forward_times[1] - r.forward_times[0] for r in records),
        gap_ms=1e3 * statistics.median(b.forward_times[0] - a.forward_times[1] for a, b in pairs),
        planned_before_the_forward_before_ended=sum(b.scheduled_time < a.forward_times[1] for a, b in pairs)
        / len(pairs),
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--mixed", type=int, default=16, help="requests in the mixed workload")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from lifeofprompt import LLM

    llm = LLM(log_stats=False, async_scheduling=True)
    overlap = llm.engine.overlap
    tokens_per_s(llm, [PROMPT], 4, after_first=False)  # warm-up
    batch16 = [f"story number {i}: today is a beautiful summer day and " * 3 for i in range(16)]
    mixed = mixed_workload(args.mixed, seed=0)
    cpu = cpu_description()
    results = dict(
        cpu=cpu["model"],
        vector_isa=cpu["vector_isa"],
        threads=args.threads,
        date=str(date.today()),
        weights=llm.engine.resolved.quantization or llm.engine.resolved.dtype,
        batch1_decode=in_turns(llm, overlap, args.pairs, lambda: tokens_per_s(llm, [PROMPT], 97, after_first=True)),
        batch16=in_turns(llm, overlap, args.pairs, lambda: tokens_per_s(llm, batch16, 64, after_first=False)),
        mixed=in_turns(llm, overlap, args.pairs, lambda: run_engine(llm, *mixed)["tokens_per_s"]),
        timeline_on=timeline(llm, overlap),
    )
    llm.engine.overlap = None
    results["loop_against_step"] = loop_against_step(llm, results["batch1_decode"])
    stem = RESULTS / f"async_scheduling_{cpu_file_slug(cpu)}_{args.threads}t_{date.today():%Y%m%d}"
    stem.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
    for name in ("batch1_decode", "batch16", "mixed"):
        r = results[name]
        print(f"{name}: on/off median {r['median_ratio']:.3f} (spread {r['spread'][0]:.3f}-{r['spread'][1]:.3f})")
    print(f"timeline with it on: {results['timeline_on']}")
    print(f"the loop against the step: {results['loop_against_step']}")
    print(f"wrote {stem.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

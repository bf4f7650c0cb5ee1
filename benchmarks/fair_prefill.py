"""Fair chunked prefill, measured: a short request's time to first token beside a long prefill, and a
mixed workload's throughput, with ``long_prefill_token_threshold`` at its default and off.

    python benchmarks/fair_prefill.py                          # SmolLM2, an 8,000-token prompt
    python benchmarks/fair_prefill.py --long-len 6000 --json out.json

The engine is driven directly, with no HTTP, by ``lifeofprompt/lessons/fair_prefill.py`` (chapter 09
draws the same measurement): the long prompt prefills alone for ``--arrive-after`` steps, then the
short request arrives. Its TTFT is read off its ``RequestMetrics`` (arrival to first token), next to
the step times, so the issue's targets can be checked: TTFT <= 2 x the step time at the threshold
and <= 3 s, and the mixed workload's throughput within 10% of "off".
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from lifeofprompt import LLMEngine, SamplingParams, load_model
from lifeofprompt.lessons.fair_prefill import short_beside_long, synthetic_ids


def engine_for(model, tokenizer, threshold, args):
    return LLMEngine(
        model,
        tokenizer=tokenizer,
        num_kv_blocks=args.num_kv_blocks,
        log_stats=False,
        max_num_batched_tokens=args.budget,
        long_prefill_token_threshold=threshold,
        cpu_tuning=args.cpu_tuning,
    )


def mixed_throughput(engine, long_ids, short_ids, num_short: int) -> dict:
    """One long prompt and ``num_short`` short requests arriving one a step: tokens computed per second."""
    engine.add_request("long", long_ids, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    started, added = time.perf_counter(), 0
    while engine.has_unfinished_requests() or added < num_short:
        if added < num_short:
            engine.add_request(f"s{added}", short_ids, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
            added += 1
        engine.step()
    elapsed = time.perf_counter() - started
    tokens = sum(r.num_batched_tokens for r in engine.step_records)
    return {"elapsed_s": elapsed, "tokens": tokens, "tokens_per_s": tokens / elapsed, "steps": len(engine.step_records)}


def run_description() -> dict:
    """Which machine, threads, versions and load this run had (every result file says so)."""
    import os

    from lifeofprompt import env_info
    from lifeofprompt.env import cpu_model

    return {
        "env": env_info(),
        "cpu": cpu_model(),
        "threads": torch.get_num_threads(),
        "dtype": "float32",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load_average": os.getloadavg()[0],
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--long-len", type=int, default=8000)
    parser.add_argument("--short-len", type=int, default=32)
    parser.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens")
    parser.add_argument("--arrive-after", type=int, default=1, help="steps the long prompt runs alone first")
    parser.add_argument("--num-short", type=int, default=16)
    parser.add_argument("--num-kv-blocks", type=int, default=1024)
    parser.add_argument("--cpu-tuning", default=None, dest="cpu_tuning")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    model, tokenizer = load_model(args.model, dtype=torch.float32, device="cpu")
    vocab = model.config.vocab_size
    long_ids = synthetic_ids(vocab, args.long_len)
    short_ids = synthetic_ids(vocab, args.short_len, stride=104729)
    results = {}
    for name, threshold in (("default", None), ("off", 0)):
        engine = engine_for(model, tokenizer, threshold, args)
        results[name] = {
            "threshold": engine.scheduler.config.long_prefill_token_threshold,
            "short_beside_long": short_beside_long(engine, long_ids, short_ids, args.arrive_after).as_dict(),
            "mixed": mixed_throughput(
                engine_for(model, tokenizer, threshold, args), long_ids, short_ids, args.num_short
            ),
        }
        r = results[name]
        print(
            f"{name:8} threshold {r['threshold']}: short TTFT {r['short_beside_long']['ttft_s']:.2f} s "
            f"({r['short_beside_long']['steps_to_first_token']} steps, longest step "
            f"{r['short_beside_long']['max_step_s']:.2f} s); mixed {r['mixed']['tokens_per_s']:.0f} tokens/s"
        )
    ratio = results["default"]["mixed"]["tokens_per_s"] / results["off"]["mixed"]["tokens_per_s"]
    print(f"mixed throughput, default / off: {ratio:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(run_description(), ratio_mixed_default_over_off=ratio, **results), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

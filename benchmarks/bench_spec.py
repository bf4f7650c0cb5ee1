"""Speculative decoding against plain decoding, on the CPU: the same engine, the same greedy tokens.

Workloads (fixed, in ``lifeofprompt.lessons.speculation``, shared with chapter 14):
  * ``code``: repetitive code editing. A function is in the prompt and the answer repeats most of it
    (add type hints, rename a variable, add a docstring, convert a loop). Prompt lookup should fire.
  * ``open``: open-ended text (a story, an explanation). Prompt lookup rarely fires; what speculation
    costs there is the price of trying.

For each workload, at batch 1 (requests one after another) and batch 8 (eight submitted together), each
mode (``none``; ``ngram`` with k draft tokens; optionally ``draft`` = the model's first L layers) runs in
alternating rounds, starting with a different mode each round; the fastest round of each mode counts.
Greedy, chat template, EOS honoured: both modes produce the same tokens (checked and reported), so the
work is the same and tokens per second compare directly. Model: the embedded SmolLM2-135M-Instruct,
fp32 unless ``--dtype``; one torch thread unless ``--threads``.

    python benchmarks/bench_spec.py                        # the full run (minutes; wants a quiet machine)
    python benchmarks/bench_spec.py --tiny                 # a seconds-long check that the script works
    python benchmarks/bench_spec.py --draft-layers 20      # also self-speculation with the first 20 layers

Targets (issue 15): batch-1 decode on ``code`` with the n-gram drafter >= 1.5x plain (moonshot 2x);
on ``open``, speculation costs at most 5%.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(Path(__file__).resolve().parent))

from lifeofprompt.lessons.speculation import workloads  # noqa: E402  (the same conversations as chapter 14)


def make_llm(mode: str, args, model, tokenizer):
    from lifeofprompt.engine.llm import LLM
    from lifeofprompt.lessons.speculation import first_layers

    spec = None
    if mode == "ngram":
        spec = {
            "method": "ngram",
            "num_speculative_tokens": args.k,
            "prompt_lookup_min": args.lookup_min,
            "prompt_lookup_max": args.lookup_max,
        }
    elif mode == "draft":
        spec = {"model": first_layers(model, args.draft_layers), "num_speculative_tokens": args.k}
    return LLM(
        model,
        tokenizer=tokenizer,
        log_stats=False,
        num_kv_blocks=args.num_kv_blocks,
        max_num_seqs=max(args.batch),
        speculative_config=spec,
    )


def run_batch(llm, prompts, params) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, [o.outputs[0].token_ids for o in outs]


def run_mode(llm, prompts, batch: int, params) -> tuple[float, list[list[int]]]:
    """Wall time of the whole workload in groups of ``batch`` requests, and the tokens."""
    seconds, tokens = 0.0, []
    for i in range(0, len(prompts), batch):
        s, t = run_batch(llm, prompts[i : i + batch], params)
        seconds += s
        tokens += t
    return seconds, tokens


def spec_numbers(llm, before: dict) -> dict:
    spec = llm.engine.spec_stats
    if spec is None:
        return {}
    drafts = spec.num_drafts - before.get("num_drafts", 0)
    drafted = spec.num_draft_tokens - before.get("num_draft_tokens", 0)
    accepted = spec.num_accepted_tokens - before.get("num_accepted_tokens", 0)
    return dict(
        num_drafts=drafts,
        num_draft_tokens=drafted,
        num_accepted_tokens=accepted,
        acceptance_rate=accepted / drafted if drafted else 0.0,
        tokens_per_verify=1 + accepted / drafts if drafts else 1.0,
        accepted_per_pos=[
            n - m
            for n, m in zip(
                spec.num_accepted_tokens_per_pos,
                before.get("num_accepted_tokens_per_pos", [0] * spec.num_speculative_tokens),
            )
        ],
    )


def measure(args, model, tokenizer) -> dict:
    from lifeofprompt.engine.sampling_params import SamplingParams

    modes = ["none", "ngram"] + (["draft"] if args.draft_layers else [])
    llms = {m: make_llm(m, args, model, tokenizer) for m in modes}
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    results = {}
    for name, conversations in workloads().items():
        conversations = conversations[: args.requests]
        prompts = [llms["none"].apply_chat_template(c) for c in conversations]
        for llm in llms.values():  # warm-up: first-call costs out of the timings
            run_batch(llm, prompts[:1], SamplingParams(temperature=0, max_tokens=4))
        for batch in args.batch:
            times = {m: [] for m in modes}
            tokens, spec = {}, {}
            for r in range(args.rounds):
                order = modes[r % len(modes) :] + modes[: r % len(modes)]  # alternate who goes first
                for m in order:
                    before = llms[m].engine.spec_stats.as_dict() if llms[m].engine.spec_stats else {}
                    seconds, tokens[m] = run_mode(llms[m], prompts, batch, params)
                    times[m].append(seconds)
                    spec[m] = spec_numbers(llms[m], before)
            n = sum(len(t) for t in tokens["none"])
            row = {"batch": batch, "requests": len(prompts), "output_tokens": n}
            for m in modes:
                best = min(times[m])
                row[m] = dict(
                    seconds=times[m],
                    best_seconds=best,
                    tokens_per_s=n / best,
                    **spec[m],
                    same_tokens=sum(a == b for a, b in zip(tokens[m], tokens["none"])),
                )
            for m in modes[1:]:
                row[f"{m}_speedup"] = row["none"]["best_seconds"] / row[m]["best_seconds"]
            results[f"{name}_batch{batch}"] = row
            print(
                f"{name:5} batch {batch}: "
                + ", ".join(f"{m} {row[m]['tokens_per_s']:.1f} tok/s" for m in modes)
                + "; "
                + ", ".join(
                    f"{m} {row[f'{m}_speedup']:.2f}x, accepted {row[m]['acceptance_rate']:.0%}, "
                    f"{row[m]['tokens_per_verify']:.2f} tokens/verify"
                    for m in modes[1:]
                ),
                flush=True,
            )
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--lookup-min", type=int, default=2)
    parser.add_argument("--lookup-max", type=int, default=5)
    parser.add_argument("--draft-layers", type=int, default=0, help="also self-speculation with the first L layers")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--requests", type=int, default=8, help="requests per workload (at most 8)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--num-kv-blocks", type=int, default=256)
    parser.add_argument("--tiny", action="store_true", help="seconds: 2 requests, 8 tokens, 1 round, batch 1 and 2")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.tiny:
        args.requests, args.max_tokens, args.rounds, args.batch = 2, 8, 1, [1, 2]
    torch.set_num_threads(args.threads)
    from bench_engine import cpu_description, cpu_file_slug

    from lifeofprompt import load_model
    from lifeofprompt.env import env_info

    model, tokenizer = load_model("smollm2-135m", dtype=getattr(torch, args.dtype), device="cpu")
    results = dict(
        benchmark="speculative decoding",
        model="smollm2-135m",
        dtype=args.dtype,
        threads=args.threads,
        k=args.k,
        prompt_lookup=[args.lookup_min, args.lookup_max],
        draft_layers=args.draft_layers,
        max_tokens=args.max_tokens,
        rounds=args.rounds,
        cpu=cpu_description(),
        env=env_info(),
        tiny=args.tiny,
    )
    results["runs"] = measure(args, model, tokenizer)
    if args.tiny:
        print("tiny check: nothing written")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"cpu_spec_{cpu_file_slug(results['cpu'])}_{args.threads}t_{time.strftime('%Y%m%d')}.json"
    path.write_text(json.dumps(results, indent=2, default=str))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

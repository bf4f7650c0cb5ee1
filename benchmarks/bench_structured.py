"""What a grammar costs per token: the structured-output mask against the batch-1 decode step, on the CPU.

Two numbers, from one run of the embedded SmolLM2-135M-Instruct (fp32, one thread unless
``--threads``):

* the mask alone: for every token of a sampled JSON answer, the time to fill the sequence's
  bitmask row (xgrammar) and apply it to a logits row, timed around exactly those calls;
* the whole step: batch-1 decode with and without ``structured_outputs``, alternating rounds,
  fastest of each (the same number of tokens: ``ignore_eos`` off, so each answer ends when its
  JSON closes; the plain run generates as many tokens).

Target (issue 18): the mask ≤ 10% of a batch-1 decode step.

    python benchmarks/bench_structured.py [--threads 1] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
sys.path.insert(0, str(Path(__file__).resolve().parent))

SCHEMA = {
    "type": "object",
    "required": ["name", "age", "city"],
    "additionalProperties": False,
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer"},
        "city": {"type": "string", "maxLength": 24},
    },
}


def mask_times(llm, prompt, params) -> list[float]:
    """Seconds of fill + apply for each token of one answer (wrapping the two calls)."""
    from lifeofprompt.engine import structured_output

    times = []
    fill, apply = structured_output.GrammarState.fill, structured_output.GrammarBackend.apply

    def timed_fill(self, bitmask, row):
        start = time.perf_counter()
        fill(self, bitmask, row)
        times.append(time.perf_counter() - start)

    def timed_apply(self, logits, bitmask):
        start = time.perf_counter()
        apply(self, logits, bitmask)
        times[-1] += time.perf_counter() - start

    structured_output.GrammarState.fill, structured_output.GrammarBackend.apply = timed_fill, timed_apply
    try:
        llm.generate([prompt], params, use_tqdm=False)
    finally:
        structured_output.GrammarState.fill, structured_output.GrammarBackend.apply = fill, apply
    return times


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from bench_engine import cpu_description, cpu_file_slug

    from lifeofprompt import LLM, SamplingParams
    from lifeofprompt.engine.structured_output import StructuredOutputsParams
    from lifeofprompt.env import env_info

    llm = LLM("smollm2-135m", dtype="float32", log_stats=False, num_kv_blocks=256, max_num_seqs=4)
    prompt = llm.apply_chat_template([{"role": "user", "content": "Describe a person as JSON: name, age and city."}])
    grammar = SamplingParams(temperature=0, max_tokens=96, structured_outputs=StructuredOutputsParams(json=SCHEMA))
    answer = llm.generate([prompt], grammar, use_tqdm=False)[0].outputs[0]  # warm-up, and the length to match
    n = len(answer.token_ids)
    plain = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    best = {"grammar": float("inf"), "plain": float("inf")}
    for r in range(args.rounds):
        for name in ("grammar", "plain") if r % 2 == 0 else ("plain", "grammar"):
            start = time.perf_counter()
            llm.generate([prompt], grammar if name == "grammar" else plain, use_tqdm=False)
            best[name] = min(best[name], time.perf_counter() - start)
    masks = mask_times(llm, prompt, grammar)
    step_s = best["plain"] / n
    mask_s = sorted(masks)[len(masks) // 2]
    results = dict(
        benchmark="structured output mask",
        model="smollm2-135m",
        dtype="float32",
        threads=args.threads,
        cpu=cpu_description(),
        env=env_info(),
        answer=answer.text,
        tokens=n,
        plain_s=best["plain"],
        grammar_s=best["grammar"],
        step_s=step_s,
        mask_median_s=mask_s,
        mask_max_s=max(masks),
        mask_share_of_step=mask_s / step_s,
        grammar_slowdown=best["grammar"] / best["plain"],
    )
    print(
        f"{n} tokens: plain {best['plain']:.2f} s, with the grammar {best['grammar']:.2f} s "
        f"({results['grammar_slowdown']:.3f}x); mask median {mask_s * 1e3:.3f} ms = "
        f"{results['mask_share_of_step']:.1%} of a {step_s * 1e3:.1f} ms step (target <= 10%)"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"cpu_structured_{cpu_file_slug(results['cpu'])}_{args.threads}t_{time.strftime('%Y%m%d')}.json"
    path.write_text(json.dumps(results, indent=2, default=str))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

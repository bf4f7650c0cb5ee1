"""A short request beside a long prompt, through the HTTP server: how soon does the short one get its first token?

    python benchmarks/server_ttft.py                   # SmolLM2, a 6,000-token prompt, then a 32-token one
    python benchmarks/server_ttft.py --json out.json

The server runs the engine with its defaults (on a CPU the step's token budget is what one step
prefills in a quarter second here, and fair chunked prefill caps a long prompt's chunk while others
wait), and once more with the old fixed budget of 2,048 tokens, in the same run. For each, the long
prompt is sent (streamed, one output token), then the short one ``--gap`` seconds later; the short
request's first token is timed from its own send and from the long prompt's, and the long prompt's
total time is said beside it. Each setting is measured ``--repeats`` times; the median is reported.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path

import httpx
import torch

from lifeofprompt import LLMEngine, env_info, load_model
from lifeofprompt.env import cpu_label
from lifeofprompt.lessons.fair_prefill import synthetic_ids
from lifeofprompt.lessons.server_thread import ServerThread
from lifeofprompt.serving.server import ServerConfig

RESULTS = Path(__file__).resolve().parent / "results"


def first_token_time(url: str, prompt: list[int], max_tokens: int, out: dict) -> None:
    """Stream one completion; note when it was sent, its first token and its end."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True}
    out["sent"] = time.perf_counter()
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as response:
        for line in response.iter_lines():
            if line.startswith("data: {") and "first" not in out:
                out["first"] = time.perf_counter()
    out["done"] = time.perf_counter()


def one_round(url: str, long_ids: list[int], short_ids: list[int], gap: float) -> dict:
    long, short = {}, {}
    thread = threading.Thread(target=first_token_time, args=(url, long_ids, 1, long))
    thread.start()
    time.sleep(gap)
    first_token_time(url, short_ids, 4, short)
    thread.join()
    return {
        "short_ttft_s": short["first"] - short["sent"],
        "short_first_token_after_long_arrival_s": short["first"] - long["sent"],
        "long_total_s": long["done"] - long["sent"],
    }


def shifted(ids: list[int], round_index: int, vocab: int) -> list[int]:
    """The same prompt shape with other ids: ``round_index`` moves every id (the first 100 ids, special
    tokens among them, are left out)."""
    return [100 + (t + 7919 * (round_index + 1)) % (vocab - 100) for t in ids]


def measure(model, tokenizer, long_ids, short_ids, args, **settings) -> dict:
    engine = LLMEngine(model, tokenizer=tokenizer, log_stats=False, **settings)
    r = engine.resolved
    rounds = []
    with ServerThread(engine, config=ServerConfig(shutdown_timeout=5)) as server:
        vocab = model.config.vocab_size
        one_round(server.url, shifted(long_ids[:64], 99, vocab), shifted(short_ids, 99, vocab), 0.0)  # warm-up
        for i in range(args.repeats):  # new ids each round: nothing is found in the prefix cache
            long, short = shifted(long_ids, i, vocab), shifted(short_ids, i, vocab)
            rounds.append(one_round(server.url, long, short, args.gap))
    median = {key: statistics.median(x[key] for x in rounds) for key in rounds[0]}
    return dict(
        settings=settings,
        budget=r.max_num_batched_tokens,
        budget_why=r.why["budget"],
        long_prefill_token_threshold=r.scheduler.long_prefill_token_threshold,
        rounds=rounds,
        median=median,
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--long-len", type=int, default=6000)
    parser.add_argument("--short-len", type=int, default=32)
    parser.add_argument("--gap", type=float, default=0.2, help="seconds between the long prompt and the short one")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    long_ids = synthetic_ids(model.config.vocab_size, args.long_len)
    short_ids = synthetic_ids(model.config.vocab_size, args.short_len, stride=104729)
    results = dict(
        env=env_info(),
        cpu=cpu_label(),
        threads=torch.get_num_threads(),
        long_len=args.long_len,
        short_len=args.short_len,
        gap_s=args.gap,
        default=measure(model, tokenizer, long_ids, short_ids, args),
        budget_2048=measure(model, tokenizer, long_ids, short_ids, args, max_num_batched_tokens=2048),
    )
    for name in ("default", "budget_2048"):
        run = results[name]
        m = run["median"]
        print(
            f"{name:12} budget {run['budget']:5d} ({run['budget_why']}), "
            f"fair cap {run['long_prefill_token_threshold']}: short TTFT {m['short_ttft_s']:.2f} s "
            f"({m['short_first_token_after_long_arrival_s']:.2f} s after the long prompt arrived); "
            f"long prompt {m['long_total_s']:.1f} s in all"
        )
    path = Path(args.json) if args.json else None
    if path is not None:
        path.write_text(json.dumps(results, indent=1, default=str))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Batch-1 decode at long contexts with the KV pool in fp32 and in q8_0 (``kv_cache_dtype``), in turns.

A decode step at context N reads the weights and N tokens of keys and values in every layer. The engine
runs with its defaults (the GGUF's blocks, every CPU speed-up timed at start-up) and only the pool's form
differs. The context is not prefilled: a sequence's block table points at a pool already N tokens long
(what it holds does not change the work), and the step decodes the token after it. Each context times
runs of steps of each form in turns (``--pairs`` of them), and gives the median of the pairs' ratios
with their spread, beside each form's floor: weight bytes + N tokens of cache bytes over the read rate,
measured in the same turns.

    python benchmarks/kv_cache_dtype.py --threads 2            # contexts 256 1024 2048 4096
    python benchmarks/kv_cache_dtype.py --threads 2 --peer     # and at 4,096 tokens against llama-server
    python benchmarks/kv_cache_dtype.py --threads 2 --mixed    # and the mixed workload in a small pool

``--peer``: batch-1 decode after a 4,096-token prompt, ours with a q8_0 pool against ``llama-server`` with
``--cache-type-k q8_0 --cache-type-v q8_0 -fa on`` (llama.cpp quantizes V only with flash attention), on the
same GGUF, in turns: decode tokens/s after the first token (ours from the engine's own steps; theirs from
the server's ``timings``), prefix and prompt caches off on both sides.
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
from bench_engine import (  # noqa: E402
    RESULTS,
    cpu_description,
    cpu_file_slug,
    llama_cpp_module,
    mixed_workload,
    run_engine,
)

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


PEER_CONTEXT, PEER_TOKENS = 4096, 65  # the prompt, and the tokens decoded after it (the first, then 64)


def our_decode_rate(llm, prompt: list[int]) -> float:
    """Tokens/s of one request's decode after its first token, from the engine's own step loop."""
    from lifeofprompt.engine.sampling_params import SamplingParams

    engine = llm.engine
    engine.add_request(f"peer-{time.perf_counter_ns()}", {"prompt_token_ids": prompt},
                       SamplingParams(max_tokens=PEER_TOKENS, temperature=0, ignore_eos=True))  # fmt: skip
    first = None
    while engine.has_unfinished_requests():
        outputs = engine.step()
        if first is None and any(out.outputs and out.outputs[0].token_ids for out in outputs):
            first = time.perf_counter()
    return (PEER_TOKENS - 1) / (time.perf_counter() - first)


def peer_phase(threads: int, pairs: int) -> dict:
    """Ours with a q8_0 pool against llama-server with a q8_0 cache, batch 1 at ``PEER_CONTEXT`` tokens."""
    from lifeofprompt import LLM
    from lifeofprompt.model.loader import smollm2_gguf_path

    rng = random.Random(4096)
    prompt = [rng.randint(3, 9999) for _ in range(PEER_CONTEXT)]
    blocks = -(-(PEER_CONTEXT + PEER_TOKENS) // 16) + 1
    llm = LLM("smollm2-135m", kv_cache_dtype="q8_0", num_kv_blocks=blocks, max_num_seqs=1,
              enable_prefix_caching=False, log_stats=False)  # fmt: skip
    llama_cpp = llama_cpp_module()
    args = ("--cache-type-k", "q8_0", "--cache-type-v", "q8_0", "-fa", "on")
    ctx = -(-(PEER_CONTEXT + PEER_TOKENS + 16) // 256) * 256
    server = llama_cpp.LlamaServer(smollm2_gguf_path(), llama_cpp.build(), 1, ctx, threads, extra_args=args)
    ours, theirs = [], []
    with server:
        server.complete(prompt[:64], 2)  # warm-ups
        our_decode_rate(llm, prompt[:64])
        for _ in range(pairs):
            ours.append(our_decode_rate(llm, prompt))
            theirs.append(server.complete(prompt, PEER_TOKENS)["timings"]["predicted_per_second"])
    ratios = [a / b for a, b in zip(ours, theirs)]
    return dict(
        context=PEER_CONTEXT,
        ours_tokens_per_s=statistics.median(ours),
        llama_server_tokens_per_s=statistics.median(theirs),
        ratio=statistics.median(ratios),
        spread=[min(ratios), max(ratios)],
        llama_server_args=list(args),
    )


MIXED_POOL = 32 << 20  # bytes: a pool where the cache, not max_num_seqs, limits how many requests run at once
MIXED_REQUESTS = 16


def mixed_phase(pairs: int) -> dict:
    """``bench_engine.py``'s mixed workload (prompts 16-256, outputs 16-128) in the same ``MIXED_POOL`` bytes
    with each form, in turns: output tokens/s, and the most requests one step ran."""
    from lifeofprompt import LLM

    prompts, out_lens = mixed_workload(MIXED_REQUESTS, seed=5)
    settings = dict(kv_cache_memory=MIXED_POOL, max_num_seqs=32, enable_prefix_caching=False, log_stats=False)
    engines = {form: LLM("smollm2-135m", kv_cache_dtype=form, **settings) for form in FORMS}
    for llm in engines.values():
        run_engine(llm, *mixed_workload(2, seed=9))  # warm-up
    rates, widest = {form: [] for form in FORMS}, {form: 0 for form in FORMS}
    for _ in range(pairs):
        for form, llm in engines.items():
            first = len(llm.engine.step_records)
            rates[form].append(run_engine(llm, prompts, out_lens)["tokens_per_s"])
            widest[form] = max([widest[form]] + [r.num_seqs for r in list(llm.engine.step_records)[first:]])
    ratios = [q / a for a, q in zip(rates["auto"], rates["q8_0"])]
    blocks = {form: llm.engine.resolved.num_kv_blocks for form, llm in engines.items()}
    return dict(pool_bytes=MIXED_POOL, requests=MIXED_REQUESTS, kv_blocks=blocks, most_requests_in_a_step=widest,
                tokens_per_s={form: statistics.median(r) for form, r in rates.items()},
                ratio=statistics.median(ratios), spread=[min(ratios), max(ratios)])  # fmt: skip


def main(argv=None) -> int:
    from lifeofprompt import env_info

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--contexts", type=int, nargs="*", default=[256, 1024, 2048, 4096], help="none: skip")
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--peer", action="store_true", help="also batch-1 at 4,096 tokens against llama-server")
    parser.add_argument("--mixed", action="store_true", help="also the mixed workload in a 32 MiB pool")
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
    if args.mixed:
        record["mixed"] = mixed = mixed_phase(args.pairs)
        print(
            f"mixed workload in {MIXED_POOL >> 20} MiB: blocks {mixed['kv_blocks']}, most requests in a step "
            f"{mixed['most_requests_in_a_step']}, tokens/s {mixed['tokens_per_s']}, q8_0 {mixed['ratio']:.2f}x "
            f"({mixed['spread'][0]:.2f}-{mixed['spread'][1]:.2f})"
        )
    if args.peer:
        record["llama_server"] = peer = peer_phase(args.threads, args.pairs)
        low, high = peer["spread"]
        print(
            f"context {PEER_CONTEXT}, decode: ours (q8_0) {peer['ours_tokens_per_s']:.1f} tok/s, llama-server (q8_0) "
            f"{peer['llama_server_tokens_per_s']:.1f}: {peer['ratio']:.2f}x ({low:.2f}-{high:.2f})"
        )
    only = "" if rows else "_" + "_".join(k for k in ("mixed", "llama_server") if k in record)  # keeps the full run
    path = RESULTS / f"kv_cache_dtype_{cpu_file_slug(cpu)}_{args.threads}t{only}_{time.strftime('%Y%m%d')}.json"
    path.write_text(json.dumps(record, indent=2, default=str))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

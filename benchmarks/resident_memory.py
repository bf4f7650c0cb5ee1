"""Resident memory of a started engine, less its KV pool: fp32 against the GGUF's blocks (and q8_0 / q4_1).

Each setting starts the engine in a fresh Python process with the same ``kv_cache_memory``, runs one
short request (so first-call set-up is included), and reports the process's resident set (VmRSS)
minus the bytes of the KV pool: what the weights and the engine's own copies of them cost. The
start-up timings are read from the cache (run the engine once before measuring, or the timing work
shows up as well).

    python benchmarks/resident_memory.py                      # none and gguf, 1 thread
    python benchmarks/resident_memory.py --settings none gguf q8_0 q4_1 --json /tmp/rss.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KV_BYTES = 64 << 20  # the same small pool in every run, so its share is known and small

CHILD = """
import json, sys, torch
torch.set_num_threads({threads})
from lifeofprompt import LLM, SamplingParams
quantization = None if {quantization!r} == "none" else {quantization!r}
llm = LLM("smollm2-135m", quantization=quantization, kv_cache_memory={kv}, block_activations={activations!r},
          big_step_weights={big_steps!r}, log_stats=False)
llm.generate(["hi my name is"], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
rss = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmRSS"))
pool = llm.engine.runner.kv_cache.nbytes
print(json.dumps(dict(rss=rss, kv_pool=pool, startup_log=llm.engine.startup_log)))
"""


def measure(quantization: str, threads: int, activations: str = "auto", big_steps: str = "auto") -> dict:
    """One fresh process's resident bytes after start-up and a request, and its KV pool's bytes."""
    code = CHILD.format(
        threads=threads, quantization=quantization, kv=KV_BYTES, activations=activations, big_steps=big_steps
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=1800)
    if run.returncode != 0:
        raise RuntimeError(f"{quantization}: {run.stderr[-2000:]}")
    result = json.loads(run.stdout.strip().splitlines()[-1])
    result["without_kv_pool"] = result["rss"] - result["kv_pool"]
    return dict(quantization=quantization, **result)


def main(argv=None) -> int:
    from lifeofprompt.env import cpu_label

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", nargs="+", default=["none", "gguf"], help="quantization settings to compare")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--block-activations",
        default="auto",
        choices=["auto", "integer", "float"],
        help="the engine's block_activations (integer products keep a re-laid copy of the blocks)",
    )
    parser.add_argument(
        "--big-step-weights",
        default="auto",
        choices=["auto", "blocks", "bfloat16", "float32"],
        help="the engine's big_step_weights (a copy of the layer matrices for big steps)",
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    rows = [measure(q, args.threads, args.block_activations, args.big_step_weights) for q in args.settings]
    base = rows[0]["without_kv_pool"]
    for row in rows:
        row["ratio_to_first"] = row["without_kv_pool"] / base
        mib = {k: row[k] / 2**20 for k in ("rss", "kv_pool", "without_kv_pool")}
        print(
            f"{row['quantization']:>5}: resident {mib['rss']:7.1f} MiB, KV pool {mib['kv_pool']:5.1f} MiB, "
            f"without it {mib['without_kv_pool']:7.1f} MiB ({row['ratio_to_first']:.2f}x {rows[0]['quantization']})"
        )
    if args.json:
        record = dict(cpu=cpu_label(), threads=args.threads, date=time.strftime("%Y-%m-%d"), rows=rows)
        record.update(block_activations=args.block_activations, big_step_weights=args.big_step_weights)
        args.json.write_text(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

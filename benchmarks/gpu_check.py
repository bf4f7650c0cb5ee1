"""The GPU issue's checks and measurements, one step per call (``benchmarks/gpu_run.sh`` runs them all).

    python3 benchmarks/gpu_check.py STEP --work DIR [--cpu-dry-run]

Steps: ``env``, ``machine``, ``kernel``, ``decode``, ``ours``, ``peer``, ``story``, ``collectives``, ``summary``.
Each writes ``DIR/STEP.json``; ``summary`` merges them into ``$OUT/gpu_results.json``, draws the
plots and prints the table. Each step runs in its own process under ``timeout`` so one crash
or hang (a CUDA error poisons its process) costs only that step.

Model: TinyLlama-1.1B shapes in bf16 with RANDOM weights (``tinyllama-1.1b-random``) — fine for
speed and kernel correctness, meaningless as text; every result says so. ``--cpu-dry-run``
runs the same code on the CPU with a tiny random Llama and tiny sizes, to flush out bugs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench_engine as bench  # noqa: E402

from lifeofprompt.story import STORY_PROMPTS  # noqa: E402

RANDOM_LABEL = "tinyllama-1.1b-random: TinyLlama-1.1B shapes, bf16, RANDOM WEIGHTS (speed only; text meaningless)"
STORY = list(STORY_PROMPTS)


# ----------------------------------------------------------------------------- set-up


def dry(args) -> bool:
    return args.cpu_dry_run


def device_of(args) -> str:
    return "cpu" if dry(args) else "cuda"


def build_model(args):
    """(model, tokenizer, label): the random TinyLlama on the GPU, a tiny random Llama in a dry run."""
    from lifeofprompt.model.loader import ByteTokenizer, random_tinyllama

    if not dry(args):
        model = random_tinyllama("cuda", torch.bfloat16)
        return model, ByteTokenizer(model.config.vocab_size), RANDOM_LABEL
    from dataclasses import replace

    from lifeofprompt.model.config import TINYLLAMA_1_1B
    from lifeofprompt.model.llama import LlamaForCausalLM

    config = replace(
        TINYLLAMA_1_1B,
        name="tiny-random (dry run)",
        vocab_size=10240,
        hidden_size=128,
        intermediate_size=256,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0, 0.02) if not name.endswith("norm.weight") else p.fill_(1.0)
    model.is_random = True
    model.source = "tiny random Llama (CPU dry run)"
    return model.eval(), ByteTokenizer(config.vocab_size), "tiny random Llama, fp32, CPU DRY RUN"


def median_time(fn, device: str, reps: int = 20) -> float:
    """Median seconds of ``fn``: triton's do_bench on a GPU, wall clock on the CPU."""
    if device == "cuda":
        from triton.testing import do_bench

        try:
            return do_bench(fn, warmup=10, rep=100, return_mode="median") / 1e3
        except TypeError:
            return do_bench(fn, warmup=10, rep=100, quantiles=[0.5])[0] / 1e3
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def load_part(args, name: str) -> dict:
    path = Path(args.work) / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else {}


def machine_from_parts(args):
    from lifeofprompt.lessons.roofline import Machine

    m = load_part(args, "machine")
    if "copy_bandwidth" not in m:
        return None
    return Machine(name=m.get("device", "?"), bandwidth=m["copy_bandwidth"], flops=m["matmul_flops"])


# ----------------------------------------------------------------------------- steps


def structured_output_check() -> dict:
    """Whether the grammar library imports on this machine's Python and compiles a JSON schema (or why not)."""
    import sys

    try:
        from importlib.metadata import version

        import xgrammar

        info = xgrammar.TokenizerInfo([chr(97 + i) for i in range(26)] + ["{", "}", '"', ":"])
        xgrammar.GrammarCompiler(info).compile_json_schema('{"type": "object"}')
        return dict(python=sys.version.split()[0], xgrammar=version("xgrammar"), compiles=True)
    except Exception as exc:  # noqa: BLE001 -- a missing or broken wheel is the finding
        return dict(python=sys.version.split()[0], available=False, error=f"{type(exc).__name__}: {exc}")


def step_env(args) -> dict:
    from lifeofprompt import env_info

    out = {"env": env_info(), "dry_run": dry(args), "structured_output": structured_output_check()}
    if not dry(args):
        props = torch.cuda.get_device_properties(0)
        out["gpu"] = dict(
            name=props.name,
            total_memory=props.total_memory,
            sms=props.multi_processor_count,
            capability=f"{props.major}.{props.minor}",
        )
        try:
            out["nvidia_smi"] = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=20).stdout
        except Exception as exc:  # noqa: BLE001
            out["nvidia_smi"] = repr(exc)
        print(out["nvidia_smi"])
    print(json.dumps(out["env"], indent=1))
    return out


def step_machine(args) -> dict:
    """Device copy bandwidth (bytes read + written) and bf16 matmul rate, by median."""
    device = device_of(args)
    nbytes = (64 << 20) if dry(args) else (1 << 30)
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    copy_s = median_time(lambda: dst.copy_(src), device)
    n = 512 if dry(args) else 8192
    a = torch.randn(n, n, device=device).to(torch.bfloat16)
    b = torch.randn(n, n, device=device).to(torch.bfloat16)
    mm_s = median_time(lambda: a @ b, device, reps=3)
    out = dict(
        device=torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
        copy_bytes=2 * nbytes,
        copy_s=copy_s,
        copy_bandwidth=2 * nbytes / copy_s,
        matmul_n=n,
        matmul_s=mm_s,
        matmul_flops=2 * n**3 / mm_s,
    )
    print(
        f"copy bandwidth {out['copy_bandwidth'] / 1e9:.0f} GB/s; bf16 matmul {out['matmul_flops'] / 1e12:.1f} TFLOP/s"
    )
    return out


def paged_case(batch: int, context: int, device, dtype, num_heads=32, num_kv_heads=4, head_dim=64, block_size=16):
    """A decode batch over a shuffled paged pool, and the same keys as a contiguous cache."""
    g = torch.Generator(device="cpu").manual_seed(0)
    blocks_per_seq = math.ceil(context / block_size)
    num_blocks = batch * blocks_per_seq
    k_pool = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(device, dtype)
    v_pool = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(device, dtype)
    order = torch.randperm(num_blocks, generator=g)
    block_tables = order.view(batch, blocks_per_seq).to(torch.int32).to(device)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    query_start_loc = torch.arange(batch + 1, dtype=torch.int32, device=device)
    query = torch.randn(batch, num_heads, head_dim, generator=g).to(device, dtype)
    return dict(
        query=query,
        k_pool=k_pool,
        v_pool=v_pool,
        block_tables=block_tables,
        seq_lens=seq_lens,
        query_start_loc=query_start_loc,
        max_query_len=1,
        max_seq_len=context,
        scale=head_dim**-0.5,
    )


def step_kernel(args) -> dict:
    """Paged attention at batch 64 × 4,096 (dry: 2 × 64) vs copy bandwidth and vs SDPA; 1 × 32k with/without split."""
    from lifeofprompt.kernels import paged_attention

    from lifeofprompt.model.paged_attention import paged_attention as torch_paged

    device = device_of(args)
    dtype = torch.float32 if dry(args) else torch.bfloat16
    machine = load_part(args, "machine")
    out = {}
    for label, batch, context in (("b64x4096", 2, 64) if dry(args) else ("b64x4096", 64, 4096),):
        case = paged_case(batch, context, device, dtype)
        kv_bytes = (
            2 * batch * context * case["k_pool"].shape[2] * case["k_pool"].shape[3] * case["k_pool"].element_size()
        )
        ours = paged_attention(**case)
        ref = torch_paged(**case)
        err = (ours.float() - ref.float()).abs().max().item()
        t = median_time(lambda: paged_attention(**case), device, reps=3)  # noqa: B023 (timed here, in this pass)
        # SDPA over a contiguous cache of the same lengths: [B, kv_heads, L, D], GQA by repeat.
        k = case["k_pool"][case["block_tables"].long()].flatten(1, 2).transpose(1, 2).contiguous()
        v = case["v_pool"][case["block_tables"].long()].flatten(1, 2).transpose(1, 2).contiguous()
        q = case["query"][:, :, None, :]
        group = q.shape[1] // k.shape[1]
        try:
            sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # noqa: E731, B023
            sdpa()
            sdpa_note = "enable_gqa=True"
        except TypeError:
            k_rep, v_rep = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
            sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(q, k_rep, v_rep)  # noqa: E731, B023
            sdpa_note = "K/V repeated per query head"
        t_sdpa = median_time(sdpa, device, reps=3)
        row = dict(
            batch=batch,
            context=context,
            kv_bytes=kv_bytes,
            seconds=t,
            bandwidth=kv_bytes / t,
            max_abs_err_vs_torch=err,
            sdpa_seconds=t_sdpa,
            sdpa_note=sdpa_note,
            speed_vs_sdpa=t_sdpa / t,
        )
        if machine.get("copy_bandwidth"):
            row["fraction_of_copy_bandwidth"] = row["bandwidth"] / machine["copy_bandwidth"]
        out[label] = row
        print(label, {k_: v_ for k_, v_ in row.items() if isinstance(v_, float)})
    batch, context = (1, 256) if dry(args) else (1, 32768)
    case = paged_case(batch, context, device, dtype)
    kv_bytes = 2 * context * case["k_pool"].shape[2] * case["k_pool"].shape[3] * case["k_pool"].element_size()
    row = dict(batch=batch, context=context, kv_bytes=kv_bytes)
    for name, splits in (("no_split", 1), ("auto_split", None)):
        try:
            t = median_time(lambda: paged_attention(**case, num_kv_splits=splits), device, reps=3)  # noqa: B023
            row[name] = dict(seconds=t, bandwidth=kv_bytes / t)
        except TypeError as exc:
            row[name] = dict(error=repr(exc))
    try:
        from lifeofprompt.kernels.paged_attention import launch_plan

        row["auto_num_kv_splits"] = launch_plan(case["query"], case["k_pool"].shape[2], batch, 1, context)[2]
    except Exception as exc:  # noqa: BLE001
        row["auto_num_kv_splits"] = repr(exc)
    out["b1x32k"] = row
    print("b1x32k", row)
    return out


def step_decode(args) -> dict:
    """Batch-1 decode step at context ≤ 512 against the floor, with a breakdown; then the batching curve."""
    from lifeofprompt.engine.cuda_graphs import DecodeGraphs
    from lifeofprompt.engine.model_runner import ModelRunner
    from lifeofprompt.engine.sampler import Sampler
    from lifeofprompt.engine.sampling_params import SamplingParams
    from lifeofprompt.engine.sequence import Sequence
    from lifeofprompt.lessons.greedy_loop import step as run_step
    from lifeofprompt.lessons.roofline import decode_floor, decode_weight_bytes
    from lifeofprompt.model.layers import fused_kernels

    device = device_of(args)
    model, _, label = build_model(args)
    config, dtype = model.config, model.dtype
    ladder_max = 8 if dry(args) else 128
    context = 64 if dry(args) else 500
    start = time.perf_counter()
    # A dry run takes the GPU's code path too: Triton kernels (interpreted) and the fused ones.
    runner = ModelRunner.for_model(
        model,
        cpu_tuning="off",  # a dry run on a CPU: Triton (interpreted), no CPU speed work, eager
        num_kv_blocks=2048 if dry(args) else 8192,
        attention_backend="triton",
        max_num_seqs=ladder_max,
        max_model_len=min(1024, config.max_position_embeddings),
    )
    graphs = runner.graphs
    out = dict(
        model=label,
        backend=runner.resolved.attention_backend,
        graphs=sorted(graphs.graphs) if graphs else [],
        context=context,
        runner_start_s=time.perf_counter() - start,
        graph_capture_s=graphs.graph_capture_seconds if graphs and graphs.graphs else None,
    )
    seq = Sequence("b1", [(7 * i) % 9000 + 3 for i in range(context)], SamplingParams(temperature=0))
    seq.block_table = list(range(math.ceil((context + 200) / 16)))
    run_step(runner, [seq], [context])

    def one_step():
        run_step(runner, [seq], [1])

    def median_step() -> float:
        """Median wall time of one decode step (after three warm-up steps), sampling and host work included."""
        for _ in range(3):
            one_step()
        steps = []
        for _ in range(10 if dry(args) else 50):
            bench.sync(device)
            t0 = time.perf_counter()
            one_step()
            steps.append(time.perf_counter() - t0)
        return statistics.median(steps)

    out["engine_step_s"] = median_step()
    gpu = runner.speedups
    out["fused_kernels"] = gpu.fused_kernels
    if gpu.fused_kernels:
        # The same step without the fused element-wise kernels: the before/after of NOTES.md's try.
        with fused_kernels("off"):
            if graphs:
                graphs.capture_graphs()
            out["engine_step_unfused_s"] = median_step()
        if graphs:
            graphs.capture_graphs()
    # Breakdown: host prep, the forward (graph replay / eager), sampling.
    buffers = graphs or DecodeGraphs(runner, capture=False)
    t0 = time.perf_counter()
    for _ in range(20):
        buffers.fill([seq], 1)
    out["host_fill_static_s"] = (time.perf_counter() - t0) / 20
    t0 = time.perf_counter()
    for _ in range(20):
        runner.prepare([seq], [1])
    out["host_prepare_eager_s"] = (time.perf_counter() - t0) / 20
    if graphs and graphs.graphs:
        graph, _ = graphs.graphs[1]
        graphs.fill([seq], 1)
        out["graph_replay_s"] = median_time(graph.replay, device)
    ids, positions, meta = runner.prepare([seq], [1])
    meta.slot_mapping = torch.full_like(meta.slot_mapping, -1)  # time the forward without storing
    with torch.no_grad():
        out["eager_forward_s"] = median_time(lambda: runner.model(ids, positions, meta), device)
        logits = runner.model(ids, positions, meta)
    sampler = Sampler()
    greedy, hot = [SamplingParams(temperature=0)], [SamplingParams(temperature=0.8, top_p=0.9, top_k=50)]
    out["sample_greedy_s"] = median_time(lambda: sampler(logits, greedy).token_ids, device)
    out["sample_topk_topp_s"] = median_time(lambda: sampler(logits, hot).token_ids, device)
    try:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
        with torch.no_grad(), profile(activities=acts) as prof:
            runner.model(ids, positions, meta)
            bench.sync(device)
        kinds: dict[str, float] = {}
        launches = 0
        for ev in prof.key_averages():
            dev_us = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0) or 0
            if device == "cuda" and dev_us and not ev.key.startswith(("aten::", "cuda", "Memcpy", "Memset")):
                name = ev.key.lower()
                kind = (
                    "attention"
                    if "paged_attention" in name or "reduce_splits" in name
                    else "store_kv"
                    if "store_kv" in name
                    else "fused"
                    if any(k in name for k in ("rms_norm_kernel", "rotary_kernel", "silu_mul_kernel"))
                    else "matmul"
                    if any(s in name for s in ("gemm", "gemv", "cutlass", "sm90", "cublas", "nvjet"))
                    else "other"
                )
                kinds[kind] = kinds.get(kind, 0.0) + dev_us * 1e-6
                launches += ev.count
        out["eager_kernel_time_by_kind_s"] = kinds
        out["eager_kernel_launches"] = launches
        out["eager_kernel_time_total_s"] = sum(kinds.values())
        out["profile_table"] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)
    except Exception as exc:  # noqa: BLE001
        out["profile_error"] = repr(exc)
    machine = machine_from_parts(args)
    if machine is not None:
        out["weight_bytes_read"] = decode_weight_bytes(config, dtype)
        out["floor_s"] = decode_floor(config, dtype, machine)
        out["engine_step_over_floor"] = out["engine_step_s"] / out["floor_s"]
        if "graph_replay_s" in out:
            out["graph_replay_over_floor"] = out["graph_replay_s"] / out["floor_s"]
    print({k: v for k, v in out.items() if k != "profile_table"})
    # The batching curve (step time vs batch size) against the roofline.
    sizes = [1, 2, 4, 8] if dry(args) else [1, 2, 4, 8, 16, 32, 64, 128]
    rows = bench.decode_step_curve(runner, sizes, context=32 if dry(args) else 512, steps=3 if dry(args) else 10)
    if machine is not None:
        rows = bench.roofline_curve(machine, config, dtype, rows)
    out["batching_curve"] = rows
    for r in rows:
        print(r)
    return out


def engine_kwargs(args) -> dict:
    if dry(args):
        return dict(max_num_seqs=8, max_num_batched_tokens=512, num_kv_blocks=512, log_stats=True)
    return dict(max_num_seqs=256, max_num_batched_tokens=8192, log_stats=True)


def workload(args):
    if dry(args):
        return bench.random_workload(args.requests or 4, 0, (16, 64), (8, 16))
    return bench.nano_vllm_workload(args.requests or 128, seed=0)


def step_ours(args) -> dict:
    """Our engine on the nano-vllm-shaped workload (after a small warm-up run)."""
    from lifeofprompt.engine.llm import LLM

    model, tokenizer, label = build_model(args)
    start = time.perf_counter()
    llm = LLM(model, tokenizer=tokenizer, **engine_kwargs(args))
    out = dict(
        model=label,
        engine_start_s=time.perf_counter() - start,
        startup_log=llm.engine.startup_log,
        memory_plan=dataclasses.asdict(llm.engine.runner.memory_plan) if llm.engine.runner.memory_plan else None,
    )
    prompts, outs = workload(args)
    warm = bench.run_engine(llm, prompts[:4], [8] * min(4, len(prompts)))
    out["warmup_s"] = warm["seconds"]
    (Path(args.work) / "ours.json").write_text(
        json.dumps(dict(out, note="warm-up only (the timed run did not finish)"), default=str)
    )
    result = bench.run_engine(llm, prompts, outs, deadline_s=args.ours_deadline)
    out.update(result)
    out["stats"] = llm.engine.stats
    # The peer's share of the workload (it cannot finish all of it in its cap), run alone on the same engine:
    # the throughput ratio compares the two on the same requests.
    n = min(args.peer_requests, len(prompts))
    subset = bench.run_engine(llm, prompts[:n], outs[:n], deadline_s=args.ours_deadline)
    out["peer_subset"] = {k: subset.get(k) for k in ("requests", "output_tokens", "seconds", "tokens_per_s")}
    print({k: v for k, v in out.items() if k != "startup_log"})
    return out


def step_overlap(args) -> dict:
    """Async scheduling on the GPU: the same decode with eager steps scheduled ahead and one at a time, in
    turns (3 pairs), and with CUDA graphs (one step at a time) beside them; batch 1 (tokens/s after the
    first token) and 16 prompts (the whole call). With it on, the host-side gap between one forward's
    launch ending and the next one's starting, from the trace."""
    import random
    import statistics

    from lifeofprompt.engine.llm import LLM

    model, tokenizer, label = build_model(args)
    settings = dict(max_num_seqs=16, num_kv_blocks=512, log_stats=False)
    eager = LLM(model, tokenizer=tokenizer, enforce_eager=True, async_scheduling=True, **settings)
    graphs = None if dry(args) else LLM(model, tokenizer=tokenizer, **settings)
    overlap = eager.engine.overlap
    rng = random.Random(0)
    vocab = model.config.vocab_size
    tokens = 16 if dry(args) else 64
    batch1 = [[rng.randrange(3, vocab) for _ in range(48)]]
    batch16 = [[rng.randrange(3, vocab) for _ in range(48)] for _ in range(16)]

    def rate(llm, prompts, after_first: bool) -> float:
        run = bench.run_engine(llm, prompts, [tokens] * len(prompts))
        return bench.decode_tokens_per_s(run) if after_first else run["tokens_per_s"]

    out = dict(model=label, tokens=tokens, eager_why=eager.engine.async_scheduling_why)
    for name, prompts, after_first in (("batch1", batch1, True), ("batch16", batch16, False)):
        rate(eager, prompts, after_first)  # warm-up
        rows = []
        for _ in range(3):
            row = {}
            for on in (True, False):
                eager.engine.overlap = overlap if on else None
                row["eager_on" if on else "eager_off"] = rate(eager, prompts, after_first)
            if graphs is not None:
                row["graphs"] = rate(graphs, prompts, after_first)
            rows.append(row)
        out[name] = dict(pairs=rows, on_over_off=statistics.median(r["eager_on"] / r["eager_off"] for r in rows))
    eager.engine.overlap = overlap
    first = len(eager.engine.step_records)
    rate(eager, batch1, True)
    records = [r for r in list(eager.engine.step_records)[first:] if r.forward_times][2:]
    gaps = [b.forward_times[0] - a.forward_times[1] for a, b in zip(records, records[1:])]
    out["gap_ms_median"] = 1e3 * statistics.median(gaps) if gaps else None
    print(out)
    return out


def step_peer(args) -> dict:
    """transformers continuous batching on the same weights and workload (capped in time)."""
    from lifeofprompt.lessons.reference import hf_from_ours

    model, _, label = build_model(args)
    ref = hf_from_ours(model)
    del model
    if not dry(args):
        torch.cuda.empty_cache()
    prompts, outs = workload(args)
    n = min(args.peer_requests, len(prompts))
    prompts, outs = prompts[:n], outs[:n]  # the share it finishes inside its cap; step_ours times the same share
    import transformers

    out = dict(model=label, transformers=transformers.__version__)
    try:
        if dry(args):
            raise RuntimeError("warm-up skipped in the dry run")
        print("warm-up: 2 requests x 4 tokens", flush=True)
        warm = bench.hf_continuous(ref, prompts[:2], [4, 4], timeout_s=20)
        out["warmup"] = {k: v for k, v in warm.items() if k in ("seconds", "note", "available")}
    except Exception as exc:  # noqa: BLE001
        out["warmup_error"] = repr(exc)
    try:
        print(
            f"timed run: {len(prompts)} requests, {sum(outs)} output tokens, cap {args.peer_timeout:.0f} s", flush=True
        )
        out.update(bench.hf_continuous(ref, prompts, outs, timeout_s=args.peer_timeout))
    except Exception as exc:  # noqa: BLE001
        out["error"] = repr(exc)
        traceback.print_exc()
    print(out)
    return out


def step_story(args) -> dict:
    """TTFT and tokens/s for the three story prompts (byte tokenizer of the random twin), alone and together."""
    from lifeofprompt.engine.llm import LLM
    from lifeofprompt.engine.sampling_params import SamplingParams

    model, tokenizer, label = build_model(args)
    llm = LLM(model, tokenizer=tokenizer, **dict(engine_kwargs(args), max_num_seqs=8))
    params = SamplingParams(temperature=0, max_tokens=16 if dry(args) else 128, ignore_eos=True)
    warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for prompt in STORY:  # warm-up: compile every shape we time
        llm.generate([prompt], warm, use_tqdm=False)
    llm.generate(STORY, warm, use_tqdm=False)
    out = dict(
        model=label,
        tokenizer="ByteTokenizer (one id per UTF-8 byte, stand-in for the random twin)",
        max_tokens=params.max_tokens,
        alone=[],
        together=[],
    )

    def describe(o):
        m = o.metrics
        decode_s = m.finished_time - m.first_token_time
        n = len(o.outputs[0].token_ids)
        return dict(
            prompt=o.prompt,
            prompt_tokens=len(o.prompt_token_ids),
            output_tokens=n,
            ttft_s=m.first_token_time - m.arrival_time,
            decode_tokens_per_s=(n - 1) / decode_s if decode_s > 0 else None,
            total_s=m.finished_time - m.arrival_time,
        )

    for prompt in STORY:
        out["alone"].append(describe(llm.generate([prompt], params, use_tqdm=False)[0]))
    out["together"] = [describe(o) for o in llm.generate(STORY, params, use_tqdm=False)]
    for row in out["alone"] + out["together"]:
        print(row)
    return out


def step_collectives(args) -> dict:
    """The distributed path's own cost a step: one process against a process group of rank 0 alone
    (``distributed_executor_backend="mp"``, T = P = 1; NCCL, gloo in a dry run), both eager."""
    from lifeofprompt.lessons.collective_bench import format_overhead, measure_engine, one_rank_overhead

    model, tokenizer, label = build_model(args)
    prompts = [[(7 * i + 13 * k) % 9000 + 3 for i in range(n)] for k, n in enumerate((37, 120, 16, 64))]
    # the same forward in both: eager (the process-group path always is), no C step (a pinned product path)
    engine = dict(
        num_kv_blocks=512, block_size=16, max_num_seqs=8, enforce_eager=True, cpu_tuning="linear", log_stats=False
    )
    max_tokens = 16 if dry(args) else 64
    runs = [
        measure_engine(lambda: (model, tokenizer), prompts, max_tokens, distributed_executor_backend=backend, **engine)
        for backend in ("uni", "mp")
    ]
    out = dict(model=label, prompts=len(prompts), max_tokens=max_tokens, **one_rank_overhead(*runs))
    print(out["group"])
    print(format_overhead(out))
    return out


# ----------------------------------------------------------------------------- summary


def fmt(x, unit="", scale=1.0, digits=1):
    return "-" if x is None else f"{x * scale:.{digits}f}{unit}"


def summary_rows(r: dict) -> list[tuple[str, str, str]]:
    """(figure, value, aim / peer) rows for the printed table."""
    rows = []
    m = r.get("machine", {})
    rows.append(("copy bandwidth", fmt(m.get("copy_bandwidth"), " GB/s", 1e-9, 0), "measured (read+write)"))
    rows.append(("bf16 matmul", fmt(m.get("matmul_flops"), " TFLOP/s", 1e-12), f"{m.get('matmul_n', '?')}³"))
    t = r.get("pytest", {})
    rows.append(("pytest tests/gpu", t.get("summary", "-"), "all pass"))
    k = r.get("kernel", {}).get("b64x4096", {})
    rows.append(
        (
            "paged attn b64×4096",
            fmt(k.get("bandwidth"), " GB/s", 1e-9, 0),
            f"{fmt(k.get('fraction_of_copy_bandwidth'), '%', 100, 0)} of copy (aim ≥70%)",
        )
    )
    rows.append(
        (
            "  vs SDPA contiguous",
            fmt(k.get("seconds"), " ms", 1e3, 3),
            f"SDPA {fmt(k.get('sdpa_seconds'), ' ms', 1e3, 3)}",
        )
    )
    s = r.get("kernel", {}).get("b1x32k", {})
    rows.append(
        (
            "paged attn b1×32k",
            f"split {fmt(s.get('auto_split', {}).get('seconds'), ' ms', 1e3, 3)}",
            f"no split {fmt(s.get('no_split', {}).get('seconds'), ' ms', 1e3, 3)}",
        )
    )
    d = r.get("decode", {})
    rows.append(
        (
            "decode step b1 (engine)",
            fmt(d.get("engine_step_s"), " ms", 1e3, 2),
            f"floor {fmt(d.get('floor_s'), ' ms', 1e3, 2)}; "
            f"ratio {fmt(d.get('engine_step_over_floor'), 'x', 1, 2)} (aim ≤1.5)",
        )
    )
    if d.get("engine_step_unfused_s") is not None:
        rows.append(
            (
                "  same step, fused kernels off",
                fmt(d.get("engine_step_unfused_s"), " ms", 1e3, 2),
                "before/after of NOTES.md's fusion try",
            )
        )
    rows.append(
        (
            "  graph replay / eager fwd",
            fmt(d.get("graph_replay_s"), " ms", 1e3, 2),
            f"eager {fmt(d.get('eager_forward_s'), ' ms', 1e3, 2)}",
        )
    )
    o, p = r.get("ours", {}), r.get("peer", {})
    rows.append(
        (
            f"throughput, {o.get('requests', '?')} req (nano-vllm shape)",
            fmt(o.get("tokens_per_s"), " tok/s", 1, 0),
            "lifeofprompt alone",
        )
    )
    sub = o.get("peer_subset") or {}
    same = sub.get("requests") is not None and sub.get("requests") == p.get("requests")
    finished = p.get("tokens_per_s") and not p.get("timed_out")
    ratio = sub["tokens_per_s"] / p["tokens_per_s"] if same and finished and sub.get("tokens_per_s") else None
    done = f", TIMED OUT at {p['finished_requests']}/{p['requests']}: no ratio" if p.get("timed_out") else ""
    rows.append(
        (
            f"  first {p.get('requests', '?')} req, both engines",
            fmt(sub.get("tokens_per_s") if same else None, " tok/s", 1, 0),
            f"HF CB {fmt(p.get('tokens_per_s'), ' tok/s', 1, 0)}{done}; {fmt(ratio, 'x', 1, 2)} (aim ≥3)",
        )
    )
    if o.get("ttft_median_s") is not None:
        rows.append(
            (
                "  TTFT median, all submitted at once",
                fmt(o.get("ttft_median_s"), " ms", 1e3, 0),
                f"{o.get('steps', '?')} engine steps",
            )
        )
    c = r.get("collectives", {})
    if c.get("overhead_s") is not None:
        rows.append(
            (
                "distributed path, 1 rank (mp)",
                fmt(c["overhead_s"], " ms", 1e3, 3),
                f"decode step {fmt(c['decode_step_one_rank_s'], ' ms', 1e3, 2)} "
                f"vs {fmt(c['decode_step_single_s'], ' ms', 1e3, 2)}"
                f" in one process; collectives {fmt(c['collective_share'], '%', 100, 1)} of it",
            )
        )
    for row in r.get("story", {}).get("alone", []):
        rows.append(
            (
                f"story '{row['prompt']}'",
                f"TTFT {fmt(row['ttft_s'], ' ms', 1e3, 1)}",
                f"{fmt(row['decode_tokens_per_s'], ' tok/s', 1, 0)}",
            )
        )
    o = r.get("overlap", {})
    for name in ("batch1", "batch16"):
        if name in o:
            graphs = [p["graphs"] for p in o[name]["pairs"] if "graphs" in p]
            rows.append(
                (
                    f"async scheduling on/off, eager {name}",
                    fmt(o[name]["on_over_off"], "×", 1, 3),
                    f"CUDA graphs {fmt(max(graphs) if graphs else None, ' tok/s', 1, 0)} (one step at a time)",
                )
            )
    return rows


def step_summary(args) -> dict:
    work = Path(args.work)
    out_dir = Path(args.out)
    results = {
        "label": RANDOM_LABEL if not dry(args) else "CPU DRY RUN (tiny random model) - not a measurement",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    for name in STEPS:
        if name != "summary":
            part = work / f"{name}.json"
            results[name] = (
                json.loads(part.read_text())
                if part.exists()
                else {"missing": "step failed or timed out (see gpu_log.txt)"}
            )
    pytest_txt = work / "pytest.txt"
    if pytest_txt.exists():
        import re

        lines = [line for line in pytest_txt.read_text().splitlines() if line.strip()]
        counts = [line.strip("= ") for line in lines if re.search(r"\d+ (passed|failed|skipped|error)", line)]
        results["pytest"] = {"summary": counts[-1] if counts else "no pytest summary (timeout?)", "tail": lines[-40:]}
    bench_txt = work / "kernels_bench.txt"
    if bench_txt.exists():
        results["kernels_bench"] = bench_txt.read_text()[-6000:]
    rows = summary_rows(results)
    results["summary_table"] = rows
    (out_dir / "gpu_results.json").write_text(json.dumps(results, indent=1, default=str))
    device = results.get("machine", {}).get("device", "?")
    try:
        curve = results.get("decode", {}).get("batching_curve", [])
        if curve:
            bench.plot_batching_curve(
                curve,
                out_dir / "batching_curve.png",
                f"decode step vs batch, context {curve[0].get('context', '?')} — {device}, "
                f"{results['date']}\n{results['label']}",
                results.get("decode", {}).get("floor_s"),
            )
        o, p = results.get("ours", {}), results.get("peer", {})
        bars = [dict(peer="lifeofprompt", tokens_per_s=o["tokens_per_s"])] if o.get("tokens_per_s") else []
        if p.get("tokens_per_s"):
            bars.append(dict(peer="transformers CB", tokens_per_s=p["tokens_per_s"]))
        if bars:
            bench.plot_throughput(
                {f"{o.get('requests', '?')} requests, nano-vllm shape": bars},
                out_dir / "throughput.png",
                f"{device}, {results['date']} — {results['label']}",
            )
    except Exception:  # noqa: BLE001
        traceback.print_exc()
    width = max(len(r[0]) for r in rows)
    print("\n" + "=" * 100)
    print(results["label"], "|", device, "|", results["date"])
    for name, value, aim in rows:
        print(f"{name:<{width}}  {value:>22}  {aim}")
    print("=" * 100)
    return {}


STEPS = {
    "env": step_env,
    "machine": step_machine,
    "kernel": step_kernel,
    "decode": step_decode,
    "ours": step_ours,
    "peer": step_peer,
    "story": step_story,
    "overlap": step_overlap,
    "collectives": step_collectives,
    "summary": step_summary,
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="one step of the GPU checks")
    parser.add_argument("step", choices=list(STEPS))
    parser.add_argument("--work", default=os.environ.get("WORK", "/tmp/lifeofprompt_gpu_work"))
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/lifeofprompt_gpu_out"))
    parser.add_argument("--cpu-dry-run", action="store_true")
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--peer-timeout", type=float, default=100)
    parser.add_argument(
        "--peer-requests", type=int, default=32, help="the first N requests, run by both engines for the ratio"
    )
    parser.add_argument("--ours-deadline", type=float, default=40, help="seconds before our timed run stops counting")
    args = parser.parse_args(argv)
    Path(args.work).mkdir(parents=True, exist_ok=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if not dry(args) and not torch.cuda.is_available():
        print("no CUDA device: use --cpu-dry-run", file=sys.stderr)
        return 2
    if dry(args):
        torch.set_num_threads(1)
    start = time.perf_counter()
    result = STEPS[args.step](args)
    if args.step != "summary":
        result["step_seconds"] = time.perf_counter() - start
        (Path(args.work) / f"{args.step}.json").write_text(json.dumps(result, indent=1, default=str))
    print(f"[{args.step}] done in {time.perf_counter() - start:.1f} s", flush=True)
    sys.stderr.flush()
    os._exit(0)  # no waiting on leftover threads (a timed-out peer) or slow teardown


if __name__ == "__main__":
    sys.exit(main())

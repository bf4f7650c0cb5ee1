"""A worker process: ranks 1 … T×P-1. It holds one shard of the weights and of the KV pool, and
runs whatever step rank 0 sends (broadcast, or down the pipeline), until rank 0 says stop or goes away.

Started with ``spawn`` (a fresh interpreter: no forked torch threads or CUDA state). It
leaves by itself when the driver dies, however it dies: a watchdog thread sees the parent pid
change (the driver's death reparents us) and exits at once; a driver that dies mid-collective
also closes its sockets, which fails the worker's collective. ``prctl(PR_SET_PDEATHSIG)`` is
not used: it fires when the *thread* that started us ends, and an engine may be built in a
short-lived thread.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

WATCHDOG_PERIOD_S = 0.2
IDLE_TIMEOUT = timedelta(days=1)  # a worker may wait this long for the next step (an idle server)


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs, picklable: no model, no tensors (the weights arrive by scatter)."""

    rank: int  # in the world: stage * tensor_parallel_size + tensor-parallel rank
    world_size: int
    tensor_parallel_size: int
    port: int
    config: object  # the full model's ModelConfig
    dtype: str  # "float32"
    device: str  # "cpu", "cuda:1"
    backend: str  # "gloo", "nccl"
    num_blocks: int
    block_size: int
    threads: int
    parent_pid: int
    host: str = "127.0.0.1"
    kv_cache_dtype: str = "auto"  # the pool's form (model/kv_cache_formats.py), the driver's


def watch_parent(parent_pid: int) -> None:
    """Exit this process as soon as the driver that started it is gone."""

    def loop():
        while os.getppid() == parent_pid:
            time.sleep(WATCHDOG_PERIOD_S)
        os._exit(3)

    threading.Thread(target=loop, name="lifeofprompt-parent-watchdog", daemon=True).start()


def main(spec: WorkerSpec) -> None:
    """A spawned worker's whole life: build its shard, join the group, receive the weights, serve steps."""
    watch_parent(spec.parent_pid)
    plan, model, cache = build_shard(spec)
    store = dist.TCPStore(spec.host, spec.port, spec.world_size, is_master=False, timeout=timedelta(seconds=60))
    store.set(f"started/{spec.rank}", "1")  # rank 0 waits for every worker before the timed collectives
    dist.init_process_group(spec.backend, store=store, rank=spec.rank, world_size=spec.world_size, timeout=IDLE_TIMEOUT)
    run_shard(spec, plan, model, cache)


def main_under_torchrun(spec: WorkerSpec) -> None:
    """A rank > 0 that torchrun started (on this machine or another): the same, joined through torchrun's
    rendezvous (``MASTER_ADDR``/``MASTER_PORT``), with one more group every rank makes: the timed world."""
    plan, model, cache = build_shard(spec)
    dist.init_process_group(
        spec.backend, init_method="env://", rank=spec.rank, world_size=spec.world_size, timeout=IDLE_TIMEOUT
    )
    from . import collectives

    collectives.use_world(dist.new_group(list(range(spec.world_size)), timeout=IDLE_TIMEOUT))  # rank 0's timed world
    run_shard(spec, plan, model, cache)


def build_shard(spec: WorkerSpec):
    """``(plan, model, cache)``: this rank's empty shard and KV pool (before any collective: it takes a while)."""
    from ..model.attention import PagedKVCache
    from .sharded_model import ShardedLlamaForCausalLM
    from .sizes import ShardPlan

    torch.set_num_threads(spec.threads)
    device = torch.device(spec.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    stages = spec.world_size // spec.tensor_parallel_size
    plan = ShardPlan.for_world_rank(spec.config, spec.rank, spec.tensor_parallel_size, stages)
    model = ShardedLlamaForCausalLM.empty(plan, device, getattr(torch, spec.dtype))
    cache = PagedKVCache.for_model(
        plan.config, spec.num_blocks, spec.block_size, model.dtype, device, kv_dtype=spec.kv_cache_dtype
    )
    return plan, model, cache


def run_shard(spec: WorkerSpec, plan, model, cache) -> None:
    """In the group: make the stage groups, receive the weights, serve steps until stop; leave the group."""
    from .sharded_model import shard_names

    try:
        stages = spec.world_size // spec.tensor_parallel_size
        model.set_tp_group(tensor_parallel_groups(spec.tensor_parallel_size, stages, IDLE_TIMEOUT)[plan.stage])
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name in shard_names(plan):  # the order rank 0 sends them in
                dist.recv(params[name].data, src=0)
        serve(model, cache, model.device)
    except Exception as exc:  # the group failed (rank 0 gone, timed out, a peer died): say so in one line
        print(
            f"lifeofprompt parallel worker rank {spec.rank}: {type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}; exiting",
            file=sys.stderr,
            flush=True,
        )
        raise SystemExit(1) from None
    finally:
        dist.destroy_process_group()


def tensor_parallel_groups(size: int, stages: int, timeout) -> list:
    """One group per pipeline stage, of its ``size`` ranks (every rank makes every group, in order).
    With one stage the tensor-parallel group is the whole world: None."""
    if stages == 1:
        return [None]
    return [dist.new_group(list(range(s * size, (s + 1) * size)), timeout=timeout) for s in range(stages)]


@torch.no_grad()
def serve(model, cache, device) -> None:
    """Run every step rank 0 sends on this shard; answer reports; return on stop.

    One stage: each step is broadcast from rank 0 (``step.receive``). Several: it comes down the
    pipe from the stage before (``pipeline.receive``) and goes on with this stage's hidden states.
    """
    from . import collectives, pipeline, step

    staged = model.plan.num_stages > 1
    graphs = None  # this rank's decode graphs, once rank 0 asks (P = 1)
    while True:
        if staged:
            wire, header, payload = pipeline.receive(model.plan, device, model.tp_group)
        else:
            header, payload = step.receive(device)
        if header[0] == step.STOP:
            return
        if header[0] == step.REPORT:
            dist.gather_object(shard_report(model, cache), None, dst=0)
            continue
        if header[0] == step.PLANS:  # the CPU product paths the driver chose
            from ..model.linear import apply_plans

            plans = [None]
            dist.broadcast_object_list(plans, src=0, group=collectives.WORLD)
            apply_plans(model, plans[0])
            continue
        if header[0] == step.CAPTURE:  # the same sizes, in the same order, on every rank
            from .rank_graphs import RankDecodeGraphs

            graphs = RankDecodeGraphs(model, cache, **step.receive_capture(header, device))
            continue
        if header[0] == step.REPLAY:
            graphs.run(*step.receive_replay(header, graphs.max_blocks_per_seq, device))
            continue
        input_ids, positions, meta = step.unpack(header, payload, cache)
        model.shard_forward(input_ids, positions, meta, wire=(wire, payload) if staged else None)


def shard_report(model, cache) -> dict:
    """What this rank holds: its weights' shapes and bytes, its KV pool, the block table it last ran."""
    from .sharded_model import weight_report

    tables = model.last_block_tables
    from . import collectives

    plan = model.plan
    products = {
        name: module.plan.describe() if getattr(module, "plan", None) else None
        for name, module in model.named_modules()
        if hasattr(module, "prepack")
    }
    return dict(
        products=products,
        rank=plan.world_rank,
        collectives=collectives.snapshot(),
        collective_calls=collectives.samples(),
        tp_rank=plan.rank,
        stage=plan.stage,
        layers=plan.layers,
        pid=os.getpid(),
        weights=weight_report(model),
        kv_shape=tuple(cache.kv.shape),
        stage_times=list(model.stage_clock.times),
        kv_nbytes=cache.nbytes,
        block_tables=None if tables is None else tables.tolist(),
    )

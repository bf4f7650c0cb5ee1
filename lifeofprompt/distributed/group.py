"""The driver's side of tensor and pipeline parallelism: start the workers, split the weights, watch them, end them.

The driver process is rank 0 (as in vLLM): it keeps the engine, the one scheduler and the one
block manager, runs its own shard through the ordinary ``ModelRunner``, and samples. Ranks
1 … T×P-1 are worker processes (``worker.py``), started with ``spawn`` (none in a world of one:
``executor.py``). All join one
``torch.distributed`` process group: gloo on the CPU, NCCL on CUDA, rendezvous through a
``TCPStore`` that rank 0 opens on 127.0.0.1 at a port the kernel picks (port 0: no race for
a "free" port). Each pipeline stage's T ranks also form a group for their all-reduces. Rank
0 then sends each rank its slice of every weight it holds, so a worker never holds the full
model, even for a moment.

Faults. gloo waits 30 minutes for a silent peer by default; rank 0 waits ``timeout_s``
(20 s) instead, and a monitor thread watches the workers' process handles: when one dies it
kills the others, which fails rank 0's pending collective at once. Either way the step
raises ``WorkerFailedError`` naming what happened, and every worker is gone. Workers wait
for steps without a deadline (an idle server sends none) and leave when the driver dies
(``worker.watch_parent``).

Under ``torchrun`` (``_launch_under_torchrun``) nothing is spawned: torchrun started every
rank, on one machine or several, and each runs the same script; rank 0 drives as above.

One parallel engine per process: ``torch.distributed`` keeps one default group.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import sys
import threading
import time
import weakref
from datetime import timedelta
from multiprocessing.connection import wait as wait_for

import torch
import torch.distributed as dist

from ..errors import ConfigError, WorkerFailedError
from . import collectives, pipeline, step
from .sharded_model import ShardedLlamaForCausalLM, load_shard, shard_weights, weight_report
from .sizes import ShardPlan, check_pipeline_parallel_size, check_tensor_parallel_size
from .worker import WorkerSpec, tensor_parallel_groups
from .worker import main as worker_main

DEFAULT_TIMEOUT_S = 20.0  # a hung worker is reported within this (the issue asks for <= 30 s)
JOIN_TIMEOUT_S = 5.0
START_TIMEOUT_S = 180.0  # spawn + import torch, on a busy 2-core machine
logger = logging.getLogger("lifeofprompt.engine")


def check_world(full_model, size: int, stages: int, timeout_s: float) -> str:
    """The sizes the model's shapes allow, one group per process, enough GPUs; returns the backend."""
    check_tensor_parallel_size(full_model.config, size)
    check_pipeline_parallel_size(full_model.config, stages)
    if dist.is_initialized():
        raise ConfigError(
            "a parallel engine is already running in this process (torch.distributed has one "
            "default group): call shutdown() on it first",
            param="tensor_parallel_size",
        )
    if not 0 < timeout_s <= 30:
        raise ConfigError(f"the collective timeout must be in (0, 30] seconds, got {timeout_s}")
    if full_model.device.type != "cuda":
        return "gloo"
    if torch.cuda.device_count() < size * stages:
        raise ConfigError(
            f"{size} x {stages} ranks need {size * stages} GPUs; this machine has {torch.cuda.device_count()}",
            param="tensor_parallel_size",
        )
    return "nccl"


def spawn_workers(specs: list[WorkerSpec]) -> list:
    """One ``spawn``ed process per worker rank, started with this script's ``__main__`` hidden."""
    context = multiprocessing.get_context("spawn")
    processes = []
    for spec in specs:
        name = f"lifeofprompt-tp-rank{spec.rank}"
        process = context.Process(target=worker_main, args=(spec,), name=name, daemon=True)
        with _main_module_hidden():
            process.start()
        processes.append(process)
    return processes


class ParallelGroup:
    """Rank 0's handle on the workers. ``launch`` returns it with the driver's own shard."""

    def __init__(
        self,
        size: int,
        processes: list,
        backend: str,
        device: torch.device,
        timeout_s: float,
        stages: int = 1,
        worker_threads: int = 1,
    ):
        self.size, self.processes, self.backend, self.device = size, processes, backend, device
        self.worker_threads = worker_threads
        self.worker_plans_source = ""  # where the workers' product paths came from (start-up log)
        self.stages = stages
        self.world_size = size * stages
        self.timeout_s = timeout_s
        self.error: WorkerFailedError | None = None
        self.dead: tuple[int, int | None] | None = None  # (rank, exit code) the monitor saw die
        self.closed = False
        self.stage_group = None  # stage 0's tensor-parallel group (P > 1)
        self.driver_plan = None  # rank 0's ShardPlan, once the weights are out
        self.full_weight_bytes = 0  # the whole model's, for the start-up log (set as the weights go out)
        self._lock = threading.RLock()  # one step's collectives at a time
        self._closing = threading.Event()
        self._monitor = threading.Thread(target=self._watch, name="lifeofprompt-tp-monitor", daemon=True)
        self._monitor.start()

    # ------------------------------------------------------------------ start

    @classmethod
    def launch(
        cls,
        full_model,
        size: int,
        num_blocks: int,
        block_size: int,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        worker_threads: int | None = None,
        stages: int = 1,
        kv_cache_dtype: str = "auto",
    ) -> tuple[ParallelGroup, ShardedLlamaForCausalLM]:
        """Start ``size * stages - 1`` workers, split ``full_model`` over all ranks; ``(group, rank 0's shard)``."""
        backend = check_world(full_model, size, stages, timeout_s)
        world, device = size * stages, full_model.device
        threads = worker_threads or max(1, torch.get_num_threads() // world)
        if "TORCHELASTIC_RUN_ID" in os.environ:
            return cls._launch_under_torchrun(
                full_model, size, stages, num_blocks, block_size, timeout_s, backend, threads, kv_cache_dtype
            )
        store = dist.TCPStore(
            "127.0.0.1", 0, world, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s)
        )
        dtype = str(full_model.dtype).removeprefix("torch.")
        specs = [
            WorkerSpec(
                rank,
                world,
                size,
                store.port,
                full_model.config,
                dtype,
                f"cuda:{rank}" if device.type == "cuda" else "cpu",
                backend,
                num_blocks,
                block_size,
                threads,
                os.getpid(),
                kv_cache_dtype=kv_cache_dtype,
            )
            for rank in range(1, world)
        ]
        group = cls(size, spawn_workers(specs), backend, device, timeout_s, stages, threads)
        try:
            group._wait_until_started(store)
            with group.guard():
                dist.init_process_group(
                    backend, store=store, rank=0, world_size=world, timeout=timedelta(seconds=timeout_s)
                )
                collectives.reset()  # this process's counts start with its group, as the new workers' do
                model = group._send_weights(full_model)
        except BaseException:
            group.shutdown()
            raise
        logger.debug("parallel: %d x %d ranks up", size, stages)
        return group, model

    @classmethod
    def _launch_under_torchrun(
        cls, full_model, size, stages, num_blocks, block_size, timeout_s, backend, threads, kv_cache_dtype="auto"
    ):
        """The same engine when torchrun started every rank (``--nnodes``, on one machine or several).

        Every node runs the same script. Torchrun's rank 0 drives, exactly as with spawned workers;
        on every other rank this call becomes the worker and ends the process when rank 0 stops.
        Nobody's process handle is watched (they may be on other machines): the timeout does it.
        """
        from .worker import main_under_torchrun

        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if world != size * stages:
            raise ConfigError(
                f"torchrun started {world} ranks, but {size} x {stages} = {size * stages} are asked for",
                param="tensor_parallel_size",
            )
        device = full_model.device
        if rank > 0:
            local = f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if device.type == "cuda" else "cpu"
            main_under_torchrun(
                WorkerSpec(
                    rank,
                    world,
                    size,
                    0,
                    full_model.config,
                    str(full_model.dtype).removeprefix("torch."),
                    local,
                    backend,
                    num_blocks,
                    block_size,
                    threads,
                    os.getppid(),
                    kv_cache_dtype=kv_cache_dtype,
                )
            )
            raise SystemExit(0)
        group = cls(size, [], backend, device, timeout_s, stages, threads)
        try:
            dist.init_process_group(
                backend, init_method="env://", rank=0, world_size=world, timeout=timedelta(seconds=START_TIMEOUT_S)
            )
            collectives.use_world(dist.new_group(list(range(world)), timeout=timedelta(seconds=timeout_s)))
            collectives.reset()  # this process's counts start with its group, as every other rank's do
            with group.guard():
                model = group._send_weights(full_model)
        except BaseException:
            group.shutdown()
            raise
        return group, model

    def _wait_until_started(self, store) -> None:
        """Until every worker has imported torch and reached the store (slow on a busy machine, so not
        under the collective timeout); a worker that dies on the way is named at once."""
        keys = [f"started/{rank}" for rank in range(1, self.world_size)]
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if store.check(keys):
                return
            time.sleep(0.1)
            for rank, p in enumerate(self.processes, start=1):
                if not p.is_alive():
                    p.join(1.0)
                    raise WorkerFailedError(
                        f"parallel worker rank {rank} exited with code {p.exitcode} while "
                        "starting (its traceback is above)",
                        rank=rank,
                        exitcode=p.exitcode,
                    )
            if time.monotonic() > deadline:
                raise WorkerFailedError(f"the parallel workers did not start within {START_TIMEOUT_S:g} s")

    @torch.no_grad()
    def _send_weights(self, full_model) -> ShardedLlamaForCausalLM:
        """Each rank's slice of each weight it holds, sent from here one tensor at a time; rank 0 keeps its own."""
        config = full_model.config
        self.full_weight_bytes = sum(p.numel() * p.element_size() for p in full_model.parameters())
        groups = tensor_parallel_groups(self.size, self.stages, timedelta(seconds=self.timeout_s))  # every rank, first
        self.stage_group = groups[0]
        for rank in range(1, self.world_size):
            plan = ShardPlan.for_world_rank(config, rank, self.size, self.stages)
            for tensor in shard_weights(full_model, plan).values():
                dist.send(tensor.to(self.device), dst=rank)
        plan = self.driver_plan = ShardPlan.for_world_rank(config, 0, self.size, self.stages)
        model = ShardedLlamaForCausalLM.empty(plan, self.device, full_model.dtype, self.guard)
        model.set_tp_group(groups[0])
        load_shard(model, shard_weights(full_model, plan))
        for attr in ("source", "is_random", "dtype_reason"):
            setattr(model, attr, getattr(full_model, attr, getattr(model, attr, None)))
        return model

    def shutdown_with(self, owner) -> None:
        """End the workers when ``owner`` (the engine) is garbage-collected, or at interpreter exit."""
        weakref.finalize(owner, self.shutdown)

    # ------------------------------------------------------------------ faults

    @contextlib.contextmanager
    def guard(self):
        """Around every use of the group: one at a time, and any failure becomes ``WorkerFailedError``."""
        if self.error is not None:
            raise self.error
        if self.closed:
            raise WorkerFailedError("the parallel workers were shut down: build a new engine")
        if self.dead is not None:
            raise self._fail(None)
        with self._lock:
            start = time.monotonic()
            try:
                yield
            except WorkerFailedError:
                raise
            except Exception as exc:  # gloo/NCCL: a closed connection, a timeout
                timed_out = time.monotonic() - start >= self.timeout_s or "timed out" in str(exc).lower()
                raise self._fail(exc, timed_out) from exc

    def _watch(self) -> None:
        """The monitor thread: the first worker to die makes the others go, so no collective waits on it."""
        sentinels = {p.sentinel: rank for rank, p in enumerate(self.processes, start=1)}
        while not self._closing.is_set():
            ready = wait_for(list(sentinels), timeout=0.5)
            if ready and not self._closing.is_set():
                rank = sentinels[ready[0]]
                self.processes[rank - 1].join(1.0)  # its pipe closes a moment before it can be reaped
                self.dead = (rank, self.processes[rank - 1].exitcode)
                self._kill_workers()
                return

    def _fail(self, exc: Exception | None, timed_out: bool = False) -> WorkerFailedError:
        """Name what happened, end every worker, leave the group; the error every later call gets too.

        After a timeout the others fail too (rank 0 drops its connections), so a death seen then
        is a consequence, not the cause: the hung worker is the news.
        """
        if self.dead is None and not timed_out:  # the collective may fail before the monitor wakes
            deadline = time.monotonic() + 1.0
            while self.dead is None and time.monotonic() < deadline:
                time.sleep(0.02)
        if self.dead is not None and not timed_out:
            rank, code = self.dead
            how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
            error = WorkerFailedError(
                f"parallel worker rank {rank} {how}; the engine shut the other workers down and cannot serve any more",
                rank=rank,
                exitcode=code,
            )
        else:
            error = WorkerFailedError(
                f"a parallel worker did not answer within {self.timeout_s:g} s (hung?) "
                f"or the group failed ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
                "the engine shut every worker down and cannot serve any more"
            )
        self.error = error
        self._close(graceful=False)
        return error

    # ------------------------------------------------------------------ the end

    def shutdown(self) -> None:
        """Tell the workers to stop, wait for them, and leave the process group (idempotent)."""
        self._close(graceful=self.error is None and self.dead is None)

    def _close(self, graceful: bool) -> None:
        if self.closed:
            return
        self.closed = True
        self._closing.set()
        if graceful and dist.is_initialized():
            try:
                with self._lock:
                    self._command(step.STOP)
            except Exception:
                graceful = False
        for p in self.processes:
            p.join(JOIN_TIMEOUT_S if graceful else 0.1)
        self._kill_workers()
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        collectives.use_world(None)

    def _command(self, command: int) -> None:
        """Stop, report or plans to every rank: broadcast with one stage, down the pipe with several (``pipeline``)."""
        if self.stages == 1:
            step.send_command(command, self.device)
        else:
            if self.driver_plan is None:
                raise WorkerFailedError("the parallel group never finished starting")
            pipeline.send_command(self.driver_plan, command, self.device, self.stage_group)

    def _kill_workers(self) -> None:
        for p in self.processes:
            if p.is_alive():
                p.kill()
        for p in self.processes:
            p.join(JOIN_TIMEOUT_S)

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    # ------------------------------------------------------------------ looking inside

    def share_plans(self, plans: dict, source: str) -> None:
        """Send every worker the CPU product paths to use, chosen once by the driver's speed-ups
        (``CpuSpeedups.share_with``: timed for the workers' thread count where it differs); ``source``
        says where they came from, for the start-up log."""
        self.worker_plans_source = source
        with self.guard():
            self._command(step.PLANS)
            dist.broadcast_object_list([plans], src=0, group=collectives.WORLD)

    def report(self, driver_model, driver_cache) -> list[dict]:
        """Per rank (0 first): its weights' shapes and bytes, its KV pool's shape and bytes, its last block table."""
        from .worker import shard_report

        with self.guard():
            self._command(step.REPORT)
            reports = [None] * self.world_size
            dist.gather_object(shard_report(driver_model, driver_cache), reports, dst=0)
        return reports

    def describe(self, driver_model, steps_in_flight: int = 1) -> list[str]:
        """The start-up log's lines about the split: who is who, what each rank holds, and why."""
        plan, c = driver_model.plan, driver_model.full_config
        h, k, i = plan.config.num_heads, plan.config.num_kv_heads, plan.config.intermediate_size
        per_rank, full = weight_report(driver_model)["nbytes"], max(self.full_weight_bytes, 1)
        embed = c.vocab_size * c.hidden_size * driver_model.embed_tokens.weight.element_size()
        embed *= 1 if c.tie_word_embeddings else 2
        shared = f", each KV head on {plan.kv_replication} ranks" if plan.kv_replication > 1 else ""
        padded = (
            f" (vocabulary padded {c.vocab_size} -> {plan.vocab[1] - plan.vocab[0]} x {self.size})"
            if c.vocab_size % self.size
            else ""
        )
        others = (
            f"ranks 1-{self.world_size - 1} are spawned workers, pids {', '.join(map(str, self.worker_pids))}"
            if self.world_size > 1
            else "no other rank: distributed_executor_backend='mp' runs the distributed path alone, to measure its cost"
        )
        lines = [
            f"parallel: {self.size} tensor x {self.stages} pipeline = {self.world_size} "
            f"rank{'s' * (self.world_size > 1)} over {self.backend} (rank 0 is this process and samples; {others}); "
            f"collective timeout {self.timeout_s:g} s",
            f"split: q/k/v by heads ({h} of {c.num_heads} query and {k} of {c.num_kv_heads} KV heads per "
            f"rank{shared}), gate/up by columns ({i} of {c.intermediate_size}); o_proj and down_proj row-parallel, "
            "one all-reduce each",
            f"embedding and LM head: vocab-parallel, {plan.vocab[1] - plan.vocab[0]} rows per rank{padded}; "
            f"replicated they would keep {_mib(embed)} ({embed / full:.0%} of the weights) on every "
            "rank; the price is one all-reduce of [tokens, hidden] after the lookup and one gather of the sampled "
            "rows' logits to rank 0",
            f"weights on rank 0: {_mib(per_rank)} of {_mib(full)} ({per_rank / full:.1%}; "
            f"1/{self.world_size} = {1 / self.world_size:.1%}); each rank's KV pool holds only its {k} KV "
            f"head{'s' if k > 1 else ''}" + (" of its stage's layers" if self.stages > 1 else ""),
        ]
        if self.stages > 1:
            stages = [
                ShardPlan.for_world_rank(c, s * self.size, self.size, self.stages).layers for s in range(self.stages)
            ]
            lines.insert(
                3,
                "pipeline: contiguous stages of layers "
                + ", ".join(f"{a}-{b - 1}" for a, b in stages)
                + "; each step goes stage to stage with its hidden states by send/recv, "
                + (
                    f"up to {steps_in_flight} steps in flight, one per micro-batch group of requests, so the "
                    "stages overlap (as vLLM's batch queue keeps steps in flight); fewer busy groups than stages "
                    "leave stages idle (the bubble)"
                    if steps_in_flight > 1
                    else "one step at a time (no overlap: each stage waits while the others run, the bubble)"
                ),
            )
        if self.worker_plans_source:
            lines.append(f"workers' CPU matrix products: {self.worker_plans_source}, sent to every rank")
        return lines


@contextlib.contextmanager
def _main_module_hidden():
    """Start a spawned worker without it re-running the caller's script.

    ``spawn`` re-imports the parent's ``__main__`` in the child (by path, or by name under
    ``python -m``), so a script that builds an engine at its top level, without an
    ``if __name__ == "__main__":`` guard, would build another one in every worker. A worker
    needs nothing from that script (its target and spec live in lifeofprompt), so the path and
    the name are hidden while it starts, as they already are for ``python -c`` and notebooks.
    """
    main = sys.modules.get("__main__")
    saved = {
        name: main.__dict__[name] for name in ("__file__", "__spec__") if main is not None and name in main.__dict__
    }
    try:
        for name in saved:
            if name == "__file__":
                del main.__file__
            else:
                main.__spec__ = None
        yield
    finally:
        for name, value in saved.items():
            setattr(main, name, value)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"

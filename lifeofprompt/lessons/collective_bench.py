"""Timing the links on this machine (notebook 15; the cost-model fits are in benchmarks/NOTES.md): gloo
collectives between spawned processes, and the parallel engine's own steps, with the collectives it ran counted.

``time_collectives(world, sizes)`` starts ``world`` fresh processes (spawn, one torch thread
each, a file rendezvous, so no port can clash and the calling process keeps no process group
of its own: a parallel engine may still start in it) and times each of the engine's kinds of
collective at each message size: the mean of single calls on rank 0, after a warm-up, back to
back as the engine meets them (its collective time is their sum, stalls included).
``parallelism.fit_cost_model`` turns those times into L and β.

``measure_engine`` runs ``LLM(tensor_parallel_size=T, pipeline_parallel_size=P)`` on a model,
and returns its step times and the collectives rank 0 ran (``distributed.collectives``), so
the fit can be set beside what the engine measured (``measure_llm``: the same on an engine already
built). ``one_rank_overhead`` sets one engine beside itself as a process group of one rank: what
the distributed path alone costs a step. ``check_cost_model`` does both at one ``T``,
the engine between two timings, and sets each kind of the engine's calls beside the fit.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from datetime import timedelta

OPS = ("all_reduce", "broadcast", "gather")


def _one_call(op: str, tensor, parts, rank: int) -> None:
    from ..distributed import collectives

    if op == "all_reduce":
        collectives.all_reduce(tensor)
    elif op == "broadcast":
        collectives.broadcast(tensor, src=0)
    elif op == "gather":
        collectives.gather(tensor, parts if rank == 0 else None, dst=0)
    elif op == "send":  # a ping-pong between ranks 0 and 1: two messages per call
        if rank == 0:
            collectives.send(tensor, 1)
            collectives.recv(tensor, 1)
        elif rank == 1:
            collectives.recv(tensor, 0)
            collectives.send(tensor, 0)
    else:
        raise ValueError(f"unknown collective {op!r}")


def _bench_worker(rank: int, world: int, init_file: str, ops, sizes, repeats: int, queue) -> None:
    """One process of the benchmark: every op at every size, ``repeats`` timed calls each."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )
    try:
        times = {(op, n): [] for op in ops for n in sizes}
        tensors = {n: torch.ones(max(1, n // 4), dtype=torch.float32) for n in sizes}
        parts = {n: [torch.empty_like(t) for _ in range(world)] for n, t in tensors.items()}
        for op in ops:
            for i in range(repeats + 3):  # round-robin over the sizes: a load that comes and
                for n in sizes:  # goes hits them all alike; three warm-up rounds
                    start = time.perf_counter()
                    _one_call(op, tensors[n], parts[n], rank)
                    if i >= 3:
                        times[op, n].append(time.perf_counter() - start)
        # the mean: the engine's collective time is a sum of calls, stalls included; the median: a typical call
        results = {
            stat: {(op, tensors[n].numel() * 4): f(t) / (2 if op == "send" else 1) for (op, n), t in times.items()}
            for stat, f in (("mean", statistics.fmean), ("median", statistics.median))
        }
        if rank == 0:
            queue.put(results)
    finally:
        dist.destroy_process_group()


def time_collectives(
    world: int, sizes, ops=OPS, repeats: int = 30, timeout_s: float = 300, statistic: str = "mean"
) -> dict:
    """``{(op, bytes): mean seconds of one call on rank 0}`` for ``world`` spawned gloo processes
    (``statistic="median"``: the median call; ``"both"``: ``{"mean": ..., "median": ...}``)."""
    import multiprocessing

    from ..distributed.group import _main_module_hidden

    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    with tempfile.TemporaryDirectory(prefix="lifeofprompt-bench-") as folder:
        init_file = os.path.join(folder, "rendezvous")
        processes = [
            context.Process(
                target=_bench_worker, args=(r, world, init_file, tuple(ops), tuple(sizes), repeats, queue), daemon=True
            )
            for r in range(world)
        ]
        with _main_module_hidden():
            for p in processes:
                p.start()
        try:
            results = queue.get(timeout=timeout_s)
        finally:
            for p in processes:
                p.join(10)
                if p.is_alive():
                    p.kill()
                    p.join(5)
    return results if statistic == "both" else results[statistic]


# ----------------------------------------------------------------------------- the engine, measured


@dataclass
class EngineRun:
    """One parallel engine's run: its decode step times, and what rank 0's collectives did."""

    tensor_parallel_size: int
    pipeline_parallel_size: int
    steps: int
    decode_step_s: float  # median wall time of a step that only decoded
    mean_step_s: float
    collectives: dict = field(default_factory=dict)  # op -> calls, bytes, seconds (rank 0)
    reports: list = field(default_factory=list)  # per rank: weights, KV pool, block tables
    startup_lines: list = field(default_factory=list)
    tokens: list = field(default_factory=list)
    step_tokens: list = field(default_factory=list)  # rows of each step: the all-reduces' sizes
    wall_s: float = float("nan")  # the whole measured generate
    max_in_flight: int = 1  # most steps in the pipe at once (pipeline overlap)
    call_samples: dict = field(default_factory=dict)  # op -> [(bytes, seconds), ...] of rank 0's calls

    def tokens_per_s(self) -> float:
        return sum(len(t) for t in self.tokens) / self.wall_s

    @property
    def label(self) -> str:
        return f"T={self.tensor_parallel_size}, P={self.pipeline_parallel_size}"

    def collective_seconds_per_step(self) -> float:
        return sum(v["seconds"] for v in self.collectives.values()) / max(self.steps, 1)


def measure_engine(
    model_factory,
    prompts,
    max_tokens: int,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    **engine_kwargs,
) -> EngineRun:
    """Build the engine, warm it up, then generate ``prompts`` greedily with the collectives counted.

    ``model_factory()`` returns ``(model, tokenizer)`` (a fresh copy: rank 0 keeps only its
    shard). The engine is shut down before this returns, so the next one can start.
    """
    from ..engine.llm import LLM

    model, tokenizer = model_factory()
    llm = LLM(
        model,
        tokenizer=tokenizer,
        tensor_parallel_size=tensor_parallel_size,
        pipeline_parallel_size=pipeline_parallel_size,
        **engine_kwargs,
    )
    try:
        return measure_llm(llm, prompts, max_tokens)
    finally:
        llm.shutdown()


def measure_llm(llm, prompts, max_tokens: int) -> EngineRun:
    """``measure_engine`` on an engine already built, which stays up (to look inside it before its shutdown)."""
    from ..distributed import collectives
    from ..engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    engine = llm.engine
    collectives.reset()
    before = len(engine.step_records)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    records = list(engine.step_records)[before:]
    stats, calls = collectives.snapshot(), collectives.samples()
    reports = engine.parallel.report(engine.model, engine.runner.kv_cache) if engine.parallel else []
    lines = engine.startup_log
    sizes = (engine.parallel.size, engine.parallel.stages) if engine.parallel else (1, 1)
    times = [r.end_time - r.start_time for r in records if r.start_time is not None and r.end_time is not None]
    decode = [
        r.end_time - r.start_time
        for r in records
        if r.start_time is not None and r.end_time is not None and all(s.kind == "decode" for s in r.scheduled)
    ]
    return EngineRun(
        *sizes,
        len(records),
        statistics.median(decode) if decode else float("nan"),
        sum(times) / max(len(times), 1),
        stats,
        reports,
        lines,
        [o.outputs[0].token_ids for o in outputs],
        [r.num_batched_tokens for r in records],
        wall,
        max((1 + len(r.overlapped) for r in records), default=1),
        calls,
    )


def one_rank_overhead(single: EngineRun, one_rank: EngineRun) -> dict:
    """What the distributed path costs a step: the same engine as one process, and as a process group of
    rank 0 alone (``distributed_executor_backend="mp"`` at T = P = 1), on the same prompts, the
    single one built to run the same forward (eager, no C step: a pinned product path).

    ``overhead_s``: the difference of their median decode steps (the broadcasts, the all-reduces,
    the packing of each step's inputs). ``collective_share``: the collectives' counted seconds in
    the one-rank engine's mean step; under NCCL a call returns once launched, so there it is the
    host's share only, and the step times say the rest.
    """
    per_step = one_rank.collective_seconds_per_step()
    return dict(
        decode_step_single_s=single.decode_step_s,
        decode_step_one_rank_s=one_rank.decode_step_s,
        overhead_s=one_rank.decode_step_s - single.decode_step_s,
        overhead_fraction=one_rank.decode_step_s / single.decode_step_s - 1,
        collective_s_per_step=per_step,
        collective_share=per_step / one_rank.mean_step_s,
        calls_per_step={op: v["calls"] / max(one_rank.steps, 1) for op, v in one_rank.collectives.items()},
        steps=one_rank.steps,
        tokens_equal=single.tokens == one_rank.tokens,
        group=next((line for line in one_rank.startup_lines if line.startswith("parallel:")), ""),
    )


def format_overhead(o: dict) -> str:
    """``one_rank_overhead``'s answer in one line, for a log."""
    calls = ", ".join(f"{n:g} {op}" for op, n in sorted(o["calls_per_step"].items()))
    return (
        f"median decode step {o['decode_step_single_s'] * 1e3:.3f} ms in one process, "
        f"{o['decode_step_one_rank_s'] * 1e3:.3f} ms through a process group of one rank: "
        f"{o['overhead_s'] * 1e3:+.3f} ms ({o['overhead_fraction']:+.1%}) a step; collectives "
        f"{o['collective_s_per_step'] * 1e3:.3f} ms a step ({o['collective_share']:.1%} of it; {calls} a step)"
    )


# ----------------------------------------------------------------------------- the cost model, checked

GRID = (64, 256, 1024, 4096, 16384, 65536, 262144, 2**20, 2**22, 2**24)  # message sizes timed, in bytes


@dataclass
class CostModelCheck:
    """``check_cost_model``'s answer: one engine run beside L + n/β fitted on the sizes it never sent."""

    run: EngineRun
    fit_sizes: dict  # op -> the grid's sizes outside that op's own messages: the fit's
    held_out: dict  # op -> the grid's sizes among them: timed, kept aside to judge the fit
    timed: dict  # (op, bytes) -> mean seconds of a call, the timings before and after averaged
    typical: dict  # (op, bytes) -> median seconds of a call, likewise
    models: dict  # op -> CostModel fitted to the means on fit_sizes
    typical_models: dict  # op -> CostModel fitted to the medians
    predictions: list  # parallelism.CollectivePrediction per op (rank 0's waits)
    last_arrival: object  # the all-reduces at each call's shortest wait over the ranks (the link alone)
    loads: tuple  # 1-minute load average before the first timing, after the engine, after the second

    @property
    def total_error(self) -> float:
        from .parallelism import total_error

        return total_error(self.predictions)

    @property
    def typical_error(self) -> float:
        from .parallelism import total_error

        return total_error(self.predictions, typical=True)

    def held_out_errors(self, op: str, typical: bool = False) -> list[float]:
        from .parallelism import relative_errors

        times = self.typical if typical else self.timed
        model = (self.typical_models if typical else self.models)[op]
        return relative_errors(model, self.held_out[op], [times[op, n] for n in self.held_out[op]])


def check_cost_model(
    model_factory,
    prompts,
    max_tokens: int,
    tensor_parallel_size: int,
    grid=GRID,
    ops=OPS,
    repeats: int = 20,
    timer=time_collectives,
    engine=measure_engine,
    **engine_kwargs,
) -> CostModelCheck:
    """Time the collectives on ``grid`` in ``T`` fresh processes, run the engine at that ``T``, time them again.

    The fit is the average of the two timings, for each kind on the sizes outside the engine's own
    messages of that kind (``parallelism.split_sizes``), so a load that rises or falls while this
    runs weighs on the fit about as it weighed on the engine, where one timing before (or after)
    would not see it. The engine runs with ``P = 1``.
    Rank 0's wait in a collective also holds its wait for the slowest rank to arrive, which the
    back-to-back timing never sees and which grows with the load; ``last_arrival`` reads each
    all-reduce at its shortest wait over the ranks instead, the link's own time.
    ``timer`` and ``engine`` stand in for the real ones in tests.
    """
    from .parallelism import fit_cost_model, last_arrival_calls, predict_calls, split_sizes

    loads = [os.getloadavg()[0]]
    before = timer(tensor_parallel_size, grid, ops=ops, repeats=repeats, statistic="both")
    run = engine(model_factory, prompts, max_tokens, tensor_parallel_size, 1, **engine_kwargs)
    loads.append(os.getloadavg()[0])
    after = timer(tensor_parallel_size, grid, ops=ops, repeats=repeats, statistic="both")
    loads.append(os.getloadavg()[0])
    timed = {key: (before["mean"][key] + after["mean"][key]) / 2 for key in before["mean"]}
    typical = {key: (before["median"][key] + after["median"][key]) / 2 for key in before["median"]}
    ops = [op for op in ops if run.call_samples.get(op)]  # T = 1 sends nothing
    split = {op: split_sizes(grid, [n for n, _ in run.call_samples[op]]) for op in ops}
    fit, held_out = {op: split[op][0] for op in ops}, {op: split[op][1] for op in ops}
    models = {op: fit_cost_model(fit[op], [timed[op, n] for n in fit[op]]) for op in ops}
    typical_models = {op: fit_cost_model(fit[op], [typical[op, n] for n in fit[op]]) for op in ops}
    predictions = [predict_calls(op, run.call_samples[op], models[op], typical_models[op]) for op in ops]
    ranks = [run.call_samples["all_reduce"]] + [r["collective_calls"]["all_reduce"] for r in run.reports[1:]]
    last = predict_calls("all_reduce", last_arrival_calls(ranks), models["all_reduce"], typical_models["all_reduce"])
    return CostModelCheck(run, fit, held_out, timed, typical, models, typical_models, predictions, last, tuple(loads))

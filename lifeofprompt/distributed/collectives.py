"""The collectives a step runs, counted: calls, bytes and seconds per kind, in this process.

Every broadcast, all-reduce, gather, send and receive of the hot path goes through these thin
wrappers of ``torch.distributed``, so rank 0 (and each worker, through ``ParallelGroup.report``)
can say how many of each a step runs, how many bytes it moves and how long it waited: the
numbers a cost model of the links is fitted to. On the CPU, gloo's calls return when they are
done, so the wall time around one is its cost; under NCCL it is only the launch.
"""

from __future__ import annotations

import time
from collections import defaultdict, deque

import torch
import torch.distributed as dist

STATS: dict[str, dict[str, float]] = defaultdict(lambda: {"calls": 0, "bytes": 0, "seconds": 0.0})
# The last calls of each kind, one (bytes, seconds) each: a typical call's time by size, which a long
# stall (the OS running another process first) moves far less than it moves the sum.
SAMPLES: dict[str, deque] = defaultdict(lambda: deque(maxlen=SAMPLES_PER_OP))
SAMPLES_PER_OP = 8192
WORLD = None  # the group of every rank the step's broadcasts and sends use (None: the default group)


def use_world(group) -> None:
    """Under torchrun rank 0 runs its collectives in a copy of the world with a short timeout: the
    default group's timeout also bounds the rendezvous, and nodes may start minutes apart."""
    global WORLD
    WORLD = group


def reset() -> None:
    STATS.clear()
    SAMPLES.clear()


def samples() -> dict[str, list[tuple[int, float]]]:
    """``op -> [(bytes, seconds), ...]`` of the last ``SAMPLES_PER_OP`` calls of each kind, in order."""
    return {op: list(values) for op, values in SAMPLES.items()}


def snapshot() -> dict[str, dict[str, float]]:
    """A plain copy (picklable, for reports)."""
    return {op: dict(values) for op, values in STATS.items()}


def _run(op: str, tensor: torch.Tensor, call, *args, **kwargs):
    start = time.perf_counter()
    result = call(*args, **kwargs)
    seconds, nbytes = time.perf_counter() - start, tensor.numel() * tensor.element_size()
    entry = STATS[op]
    entry["calls"] += 1
    entry["bytes"] += nbytes
    entry["seconds"] += seconds
    SAMPLES[op].append((nbytes, seconds))
    return result


def broadcast(tensor: torch.Tensor, src: int = 0, group=None) -> None:
    _run("broadcast", tensor, dist.broadcast, tensor, src=src, group=group or WORLD)


def all_reduce(tensor: torch.Tensor, group=None) -> None:
    _run("all_reduce", tensor, dist.all_reduce, tensor, group=group or WORLD)


def gather(tensor: torch.Tensor, parts, dst: int, group=None) -> None:
    _run("gather", tensor, dist.gather, tensor, parts, dst=dst, group=group or WORLD)


def send(tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
    _run("send", tensor, dist.send, tensor, dst=dst, group=WORLD, tag=tag)


def recv(tensor: torch.Tensor, src: int) -> None:
    _run("recv", tensor, dist.recv, tensor, src=src, group=WORLD)


def irecv(tensor: torch.Tensor, src: int, tag: int = 0):
    """A receive posted now and waited for later (``wait_recv``): counted, and timed, when it is waited for."""
    return dist.irecv(tensor, src=src, group=WORLD, tag=tag)


def wait_recv(tensor: torch.Tensor, work) -> None:
    _run("recv", tensor, work.wait)

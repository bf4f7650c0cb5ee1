"""Pipeline parallelism's wire (P > 1): each step travels down the stages with its hidden states,
and its logits come back to rank 0 later, so several steps can be in the pipe at once.

With one stage, rank 0 broadcasts each step's inputs to every rank (``step.py``) and every rank
works on that step at the same moment. Stages cannot work that way and overlap: a broadcast of
step B to every rank waits for the last stage to finish step A, so stage 0 would never run B
while stage 1 runs A. So with P > 1 a step goes the way its hidden states go:

* rank 0 broadcasts the step's header and payload (``step.pack``) to its own stage's T ranks
  only (``first_hop``; nothing with T = 1);
* each rank of stage s runs its layers, then sends header, payload and hidden states to the
  rank of stage s + 1 that holds the same slice (``send_on``): a micro-batch moving down a pipe;
* the last stage gathers its logits to its tensor-parallel rank 0, which sends them to rank 0.

Rank 0 posts the receive of a step's logits (``PendingLogits``, an ``irecv``) before it sends
the step on, and waits for it only when the engine collects that step. ``submit`` therefore
returns once stage 0 has done its part, and the engine may submit another micro-batch group's
step (``engine/pipeline_overlap.py``) while the later stages run the first. Every stage runs the
steps in the order they were submitted, one at a time. Nothing can deadlock: every blocking send
goes down the pipe, to a stage that posts its receive once it has finished the steps before it,
and the only message going up (logits) always finds its receive posted already. Each step's logits
carry a tag from the step's number (every rank counts the steps it runs, all in the same order), so
with several receives posted each matches its own step.

Commands (stop, report, plans) travel the same way, behind any step still in the pipe, so a stage
answers a report only after it has run every step it was sent.

Every rank also notes when it started and ended its layers for each step (``StageClock``): the
ranks on one machine share ``time.monotonic``, so a test can see stage 1 running one step while
stage 0 runs the next.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque

import torch

from . import collectives
from .step import HEADER, STEP, payload_size

STAGE_TIMES = 4096  # steps each rank remembers the times of
LOGITS_TAGS = 1024  # step k's logits travel with tag 1 + k % LOGITS_TAGS (gloo; NCCL keeps order anyway)


def logits_tag(step_number: int) -> int:
    """The tag of step ``step_number``'s logits: with several receives posted, each matches its own step."""
    return 1 + step_number % LOGITS_TAGS


class StageClock:
    """``(step, start, end)`` of this rank's layers for its last ``STAGE_TIMES`` steps, numbered from 0
    (every rank runs every step, in the same order, so step k is the same step on every rank)."""

    def __init__(self):
        self.times: deque[tuple[int, float, float]] = deque(maxlen=STAGE_TIMES)
        self.num_steps = 0

    def note(self, start: float) -> None:
        self.times.append((self.num_steps, start, time.monotonic()))
        self.num_steps += 1


class PendingLogits:
    """Rank 0: one submitted step's logits ``[rows, vocab]``, on their way back from the last stage."""

    def __init__(self, rows: int, vocab_size: int, src: int, tag: int, device, guard=None):
        self.logits = torch.empty(rows, vocab_size, dtype=torch.float32, device=device)
        self.work = collectives.irecv(self.logits, src=src, tag=tag)
        self.guard = guard or contextlib.nullcontext
        self.done = False

    def wait(self) -> torch.Tensor:
        """Block until they are here (the group's timeout bounds the wait; a dead worker fails it at once)."""
        if not self.done:
            with self.guard():
                collectives.wait_recv(self.logits, self.work)
            self.done = True
        return self.logits


def first_hop(plan, header: torch.Tensor, payload: torch.Tensor | None, group) -> None:
    """Rank 0: a step's (or a command's) header and payload to the other tensor-parallel ranks of stage 0."""
    if plan.size > 1:
        collectives.broadcast(header, src=0, group=group)
        if payload is not None:
            collectives.broadcast(payload, src=0, group=group)


def send_on(
    plan, header: torch.Tensor, payload: torch.Tensor | None = None, hidden: torch.Tensor | None = None
) -> None:
    """Header, payload and hidden states to this rank's peer in the next stage (nothing from the last stage)."""
    if plan.is_last_stage:
        return
    dst = plan.peer(plan.stage + 1)
    collectives.send(header, dst)
    if payload is not None:
        collectives.send(payload, dst)
    if hidden is not None:
        collectives.send(hidden.contiguous(), dst)


def send_command(plan, command: int, device, group) -> None:
    """Rank 0: a header with no payload (stop, report, plans), down the pipe behind any step in it."""
    header = torch.zeros(HEADER, dtype=torch.long, device=device)
    header[0] = command
    first_hop(plan, header, None, group)
    send_on(plan, header)


def receive(plan, device, group) -> tuple[torch.Tensor, list[int], torch.Tensor | None]:
    """Ranks > 0: the next header (and a step's payload), from rank 0 in stage 0, else from the stage before.

    Returns ``(header, its values, payload or None)``. A command is passed on down the pipe here,
    before this rank acts on it; a step is passed on with its hidden states (``send_on``).
    """
    header = torch.empty(HEADER, dtype=torch.long, device=device)
    source = None if plan.is_first_stage else plan.peer(plan.stage - 1)
    _take(header, source, group)
    values = header.tolist()
    if values[0] != STEP:
        send_on(plan, header)
        return header, values, None
    payload = torch.empty(payload_size(values), dtype=torch.long, device=device)
    _take(payload, source, group)
    return header, values, payload


def _take(tensor: torch.Tensor, source: int | None, group) -> None:
    if source is None:
        collectives.broadcast(tensor, src=0, group=group)
    else:
        collectives.recv(tensor, src=source)

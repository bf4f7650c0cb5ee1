"""Pipeline overlap: up to P scheduler steps in flight, one per micro-batch group, so P stages work at once.

With P pipeline stages and one step at a time, each stage idles while the others run: (P − 1)/P
of the time (chapter 15's bubble). A sequence's next step cannot start before its last one has
sampled (that token is its input), but another sequence's step can. So, as vLLM's V0 engine did
with its "virtual engines" (V1 keeps up to P scheduled batches in a batch queue instead), the
requests are split among P micro-batch groups, each scheduled on its own:

* ``Scheduler.add`` gives each new request the group with the fewest requests (vLLM V0 gave it to
  the virtual engine with the fewest unfinished ones); a request keeps its group, preempted or not;
* ``Scheduler.schedule(group=g)`` builds a step of group g's requests only. A group has at most one
  step in flight, so a sequence is never in two steps in flight, and a group's preemptions only
  ever evict its own requests, never one whose step is still in the pipe.

Why one scheduler object and one block manager, where vLLM v0 keeps P schedulers, each with 1/P
of the KV blocks: one pool strands nothing when the groups hold different amounts (one long
request, say), and the engine's queue, limits, aborts and statistics keep working unchanged. It is
safe with steps in flight because every stage runs the steps in the order they were submitted
(``distributed/pipeline.py``): a block freed by an abort while its step is in the pipe, then given
to a later step of another group, is written by that later step after the earlier one, on every
stage, and a block enters the prefix cache only once the step that filled it has been collected.

``advance`` is one engine step. It submits a step for each group that has none in flight and has
work (stage 0 runs it, ``ModelRunner.submit``, and returns without its logits), round robin, until
P are in flight or nobody else can go; then it collects the oldest: waits for its logits, samples,
and hands it back, and the engine updates exactly as after a single step. With fewer busy groups
than stages (one request, or all but one group finished) fewer steps are in flight and stages idle:
that is the bubble, and ``StepRecord.overlapped`` (the steps in flight beside each one) shows it.

What it costs: each group's step is a forward of its own, so P groups take about P times the
steps, each with its fixed costs (scheduling, packing, the sends, sampling; on GPUs, kernels over
fewer rows). It pays when a stage's compute is larger than those; with the tiny test model on a
busy 2-core machine it is not, and one step at a time is faster (chapter 15 measures both;
``pipeline_overlap=False`` turns it off).

N-gram speculation overlaps too. A group's verify (its last token and drafts, 1 + k rows per
request) is packed at submit time and travels down the stages like any step; when it comes back,
``collect`` samples it (``step_output.sample_step``) and the scheduler keeps the accepted drafts
and rolls the rest back (``Scheduler.update_from_output``), as after a single step. Only that group then gets
new drafts (``Scheduler.running_of``): the other groups' requests may have steps in the pipe whose
rows were packed from their drafts, and drafting for them would change what their sampling and
rollback read. So a request's drafts change only while its group has no step in flight, and
``advance`` checks, as each step comes back, that they are still the ones it was sent with. Blocks
that only rejected drafts reached go back at collection, after every stage has run that step. A
draft model stays out (it runs in one process only: ``SpeculativeConfigError`` at P > 1).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass
class InFlight:
    """A submitted step: the engine's started step (batch, trace, drafts), its logits on their way back."""

    started: object  # llm_engine.StartedStep
    pending: object  # (distributed.pipeline.PendingLogits, its launch)


class PipelineOverlap:
    def __init__(self, scheduler, runner, depth: int, start_step):
        self.scheduler, self.runner, self.depth = scheduler, runner, depth
        self.start_step = start_step  # the engine's bookkeeping as a step starts (``LLMEngine._start_step``)
        self.in_flight: deque[InFlight] = deque()
        self.next_group = 0  # round robin: the group after the last one submitted
        self.max_in_flight = 0

    def advance(self):
        """Submit what can go, then collect the oldest step: ``(started, StepOutput)``, or None when idle."""
        self.submit_ready()
        if not self.in_flight:
            return None
        done = self.in_flight.popleft()
        self.check_drafts(done)
        batch = done.started.batch
        return done.started, self.runner.collect(done.pending, batch.seqs, batch.num_scheduled_tokens)

    def submit_ready(self) -> None:
        """One step for each group with work and none in flight, in turn, up to ``depth`` in flight."""
        for _ in range(self.depth):
            if len(self.in_flight) >= self.depth:
                return
            group, self.next_group = self.next_group, (self.next_group + 1) % self.depth
            if any(f.started.batch.group == group for f in self.in_flight) or not self.scheduler.has_work(group):
                continue
            batch = self.scheduler.schedule(group)
            if batch.is_empty:  # waiting, but no room for its first chunk yet
                continue
            busy = {seq.seq_id for f in self.in_flight for seq in f.started.batch.seqs}
            assert busy.isdisjoint(seq.seq_id for seq in batch.seqs), "a sequence in two steps in flight"
            started = self.start_step(batch)
            started.record.overlapped = [f.started.batch.step for f in self.in_flight]
            pending = self.runner.submit(batch.seqs, batch.num_scheduled_tokens)
            self.in_flight.append(InFlight(started, pending))
            self.max_in_flight = max(self.max_in_flight, len(self.in_flight))

    @staticmethod
    def check_drafts(done: InFlight) -> None:
        """A verify's rows were packed from its drafts when it was submitted: sampling and rollback read
        ``seq.spec_token_ids`` again now, so nobody may have drafted for its requests in between."""
        batch = done.started.batch
        now = {seq.seq_id: list(seq.spec_token_ids) for seq in batch.seqs if seq.spec_token_ids}
        if now != done.started.drafts:
            raise AssertionError(
                f"step {batch.step}: drafts changed while it was in the pipe (sent {done.started.drafts}, now {now})"
            )

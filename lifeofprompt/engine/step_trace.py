"""The step trace: what each step did, kept for people (the notebooks, the demo, the figures), not for the step.

The scheduler hands the runner a ``ScheduledBatch`` (who runs, how many tokens) with its trace, a
``StepRecord`` (``Scheduler.schedule`` fills it: each request's share with its kind and block table,
who was admitted and preempted); the engine adds, once the step ran, who finished, how long it took
and how it ran, and keeps it (``LLMEngine.step_records``).
``lifeofprompt.figures.schedule.format_steps`` prints them, one line per request, as the demo and
chapter 08 show them.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ScheduledRequest:
    """One request's share of one step (a trace line)."""

    request_id: str
    kind: str  # "prefill", "prefill chunk", "recompute", "decode", "verify"
    start: int  # num_computed_tokens before the step: first position computed
    num_tokens: int  # tokens computed this step
    num_cached_tokens: int  # tokens claimed from the prefix cache when admitted this step (else 0)
    block_table: list[int]  # the block table after this step's allocation
    num_draft_tokens: int = 0  # a verify: the drafts checked (num_tokens = 1 + num_draft_tokens)
    num_accepted_tokens: int | None = None  # a verify, after the step: drafts kept (the rest rolled back)

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


@dataclass
class StepRecord:
    """What one step did: its requests' shares, who came and went, when it ran and how."""

    step: int
    num_scheduled_tokens: list[int] = field(default_factory=list)
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    admitted: list[str] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)  # filled in after the step ran
    num_waiting: int = 0  # after scheduling
    num_running: int = 0
    num_free_blocks: int = 0
    group: int | None = None  # its micro-batch group (pipeline overlap), else None
    overlapped: list[int] = field(default_factory=list)  # steps still in flight when this one was submitted
    start_time: float | None = None
    end_time: float | None = None
    launch: object = None  # how the runner ran it (step_output.Launch), once it ran
    scheduled_time: float | None = None  # async scheduling: when it was planned (while the step before ran)
    forward_times: tuple | None = None  # async scheduling: when its forward began and ended on the forward thread

    @property
    def num_batched_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    @property
    def num_seqs(self) -> int:
        return len(self.scheduled)

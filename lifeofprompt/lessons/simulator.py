"""The scheduler without the model: the same ``Scheduler`` and ``BlockManager``, timed by the roofline.

A real CPU step of even a small model takes a good fraction of a second, so sweeping arrival
rates over thousands of requests on the engine would take hours. The scheduling decisions do
not need the model, only its timing: the simulator runs the very same scheduler code, and
advances a virtual clock by ``roofline.predict_step_time`` for each step's shape (new tokens,
cached context, sequences). Tokens are fake (every output token is 0; prompts are seeded
random ids, so nothing is shared by accident) and each request stops at its ``max_tokens``.
Its knobs are the engine's, with the engine's defaults: ``long_prefill_token_threshold`` (fair
chunked prefill) goes through the same ``fair_prefill_threshold`` rule into the same
``Scheduler.fair_chunk``, so a simulated step is cut exactly as a real one would be.

``calibrate`` fits the machine's fixed per-step overhead on steps measured on the real engine,
and ``compare_steps`` puts predicted and measured step times side by side: the gap is the
part of a real step the roofline does not model (Python, per-sequence bookkeeping, the
attention of the plain-torch backend).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from ..engine.block_manager import BlockManager
from ..engine.config import SchedulerConfig, fair_prefill_threshold
from ..engine.sampling_params import SamplingParams
from ..engine.scheduler import Scheduler
from ..engine.sequence import Sequence
from ..engine.step_trace import StepRecord
from ..errors import RequestTooLargeError
from ..latency import RequestTiming, summarize
from ..loadtest.arrivals import ArrivalPattern, Dispatcher, all_at_once, sample_lengths
from ..model.config import ModelConfig
from .roofline import Machine, predict_step_time
from .story_model import SMOLLM2_135M


@dataclass(frozen=True)
class SimRequest:
    prompt_len: int
    output_len: int


def random_workload(num_requests: int, prompt_lens=(16, 256), output_lens=(16, 128), seed: int = 0) -> list[SimRequest]:
    """Seeded prompt and output lengths: an ``int`` each (fixed) or ``(low, high)`` (uniform)."""
    prompts = sample_lengths(num_requests, prompt_lens, seed)
    outputs = sample_lengths(num_requests, output_lens, seed + 1)
    return [SimRequest(p, o) for p, o in zip(prompts, outputs)]


# A CPU of the kind this project's notebooks run on (2 cores); replace it with ``measure_machine()``.
DEFAULT_MACHINE = Machine(name="reference CPU (assumed)", bandwidth=10e9, flops=50e9, overhead_s=0.03)


def step_shape(record: StepRecord) -> tuple[int, int, int]:
    """``(new tokens, cached context tokens read, sequences)`` of a step: what the roofline needs."""
    return record.num_batched_tokens, sum(r.start for r in record.scheduled), len(record.scheduled)


@dataclass
class SimResult:
    timings: list[RequestTiming]  # per request, in request order (error set when rejected)
    steps: list[StepRecord]
    num_preemptions: int
    policy: str
    summary: dict = field(default_factory=dict)

    @property
    def duration(self) -> float:
        return self.steps[-1].end_time if self.steps else 0.0


class Simulator:
    def __init__(
        self,
        config: ModelConfig = SMOLLM2_135M,
        dtype=torch.float32,
        machine: Machine | None = None,
        num_blocks: int = 1024,
        block_size: int = 16,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        enable_prefix_caching: bool = True,
        static_batch_size: int | None = None,
        keep_steps: bool = True,
        long_prefill_token_threshold: int | None = None,
    ):
        """``long_prefill_token_threshold`` as ``LLMEngine``'s: None takes the engine's default (a quarter
        of the budget), 0 turns fair prefill off. Static batching never chunks, so it has none."""
        self.config, self.dtype = config, dtype
        self.machine = machine or DEFAULT_MACHINE
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching)
        max_model_len = min(config.max_position_embeddings, num_blocks * block_size)
        if static_batch_size is not None:
            from .static_batching import StaticScheduler

            self.scheduler = StaticScheduler(self.block_manager, static_batch_size, max_model_len)
        else:
            fair = fair_prefill_threshold(long_prefill_token_threshold, max_num_batched_tokens)
            limits = SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_model_len, fair)
            self.scheduler = Scheduler(self.block_manager, limits)
        self.keep_steps = keep_steps
        self._step_time_cache: dict[tuple[int, int, int], float] = {}

    @property
    def policy(self) -> str:
        return "continuous" if type(self.scheduler) is Scheduler else "static"

    def step_time(self, record: StepRecord) -> float:
        shape = step_shape(record)
        t = self._step_time_cache.get(shape)
        if t is None:
            t = self._step_time_cache[shape] = predict_step_time(self.machine, self.config, self.dtype, *shape)
        return t

    def run(
        self,
        requests: list[SimRequest],
        arrivals: ArrivalPattern | None = None,
        seed: int = 0,
        max_steps: int = 1_000_000,
    ) -> SimResult:
        """Serve ``requests`` arriving as ``arrivals`` says (default: all at once); times in seconds from 0."""
        arrivals = arrivals or all_at_once(len(requests))
        if arrivals.num_requests != len(requests):
            raise ValueError(f"{len(requests)} requests but the arrival pattern has {arrivals.num_requests}")
        rng = np.random.default_rng(seed)
        dispatcher = Dispatcher(arrivals)
        sched = self.scheduler
        timings: list[RequestTiming | None] = [None] * len(requests)
        index_of: dict[str, int] = {}
        steps: list[StepRecord] = []
        t = 0.0
        for _ in range(max_steps):
            for i in dispatcher.due(t):
                req = requests[i]
                timings[i] = RequestTiming(arrival_time=t, num_prompt_tokens=req.prompt_len)
                seq = Sequence(
                    f"r{i}",
                    rng.integers(100, self.config.vocab_size, req.prompt_len).tolist(),
                    SamplingParams(temperature=0, max_tokens=req.output_len, ignore_eos=True),
                    arrival_time=t,
                )
                index_of[seq.request_id] = i
                try:
                    sched.check_fits(seq)
                    sched.add(seq)
                except RequestTooLargeError as exc:
                    timings[i].error = str(exc)
                    dispatcher.finished()
            if dispatcher.done and not sched.has_unfinished():
                break
            batch = sched.schedule()
            if batch.is_empty:
                next_time = dispatcher.next_time()
                if next_time is None:
                    break  # nothing can ever run again
                t = max(t, next_time)
                continue
            record = batch.trace
            record.start_time = t
            for seq in batch.seqs:
                timing = timings[index_of[seq.request_id]]
                if timing.first_scheduled_time is None:
                    timing.first_scheduled_time = t
            t += self.step_time(record)
            record.end_time = t
            sampled = [
                0 if s.num_computed_tokens + n == len(s) else None
                for s, n in zip(batch.seqs, batch.num_scheduled_tokens)
            ]
            update = sched.update_from_output(batch, sampled)  # a request ends at its max_tokens
            for seq in batch.seqs:
                timing = timings[index_of[seq.request_id]]
                if seq.seq_id in update.new_tokens:
                    timing.token_times.append(t)
                    if timing.first_token_time is None:
                        timing.first_token_time = t
            for seq in update.finished:
                timings[index_of[seq.request_id]].finished_time = t
                record.finished.append(seq.request_id)
                dispatcher.finished()
            if self.keep_steps:
                steps.append(record)
        result = SimResult(timings, steps, sched.num_preemptions, self.policy)
        result.summary = summarize(timings)
        return result


# ----------------------------------------------------------------------------- against the real engine


def calibrate(machine: Machine, config: ModelConfig, dtype, records: list[StepRecord]) -> Machine:
    """The machine with ``overhead_s`` = the median of (measured − roofline) over real engine steps."""
    bare = replace(machine, overhead_s=0.0)
    residuals = [
        (r.end_time - r.start_time) - predict_step_time(bare, config, dtype, *step_shape(r))
        for r in records
        if r.start_time is not None and r.end_time is not None
    ]
    if not residuals:
        raise ValueError("no timed steps to calibrate on")
    return replace(machine, overhead_s=max(0.0, statistics.median(residuals)))


def compare_steps(machine: Machine, config: ModelConfig, dtype, records: list[StepRecord]) -> dict:
    """Measured and predicted seconds of each real step, and how far apart they are."""
    shapes = [step_shape(r) for r in records]
    measured = np.array([r.end_time - r.start_time for r in records])
    predicted = np.array([predict_step_time(machine, config, dtype, *s) for s in shapes])
    ratio = predicted / measured
    return {
        "num_tokens": [s[0] for s in shapes],
        "num_seqs": [s[2] for s in shapes],
        "measured_s": measured.tolist(),
        "predicted_s": predicted.tolist(),
        "total_measured_s": float(measured.sum()),
        "total_predicted_s": float(predicted.sum()),
        "median_ratio": float(np.median(ratio)),
        "mean_abs_error": float(np.mean(np.abs(predicted - measured) / measured)),
    }

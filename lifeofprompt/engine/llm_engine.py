"""``LLMEngine``: requests in, one ``step()`` at a time, ``RequestOutput``s out.

One step, as vLLM's engine core runs it (``step``): the scheduler picks who runs and how many
tokens (``Scheduler.schedule``; the block manager gives their cache slots), the model runner
computes them and samples (``ModelRunner.execute``), and the scheduler takes the new tokens
(``Scheduler.update_from_output``): sequences advance, and those that stopped on a token (EOS unless
``ignore_eos``, a stop token id, ``max_tokens``, the context limit) finish and give their blocks back.
Then, outside the step's lock, the output processor turns the new tokens into text, finds stop
strings and makes the ``RequestOutput``s (``output_processor.py``); an answer a stop string ended
leaves the scheduler at the next step. The start-up log is written in ``startup_log.py``.

Requests may arrive while it runs. ``add_request`` and ``abort`` are safe from other threads
(the HTTP server calls them from its event loop while an engine thread drives ``step()``):
they only touch a small inbox under a lock, and ``step()`` applies the inbox first. An abort
that arrives while no step is running is applied immediately, so its blocks are free when
``abort`` returns.

Every time is ``time.monotonic()``: arrival, first scheduled, first token, each token, finish
(``RequestMetrics``), so ``lifeofprompt.latency`` can read TTFT and TPOT straight off them.

With ``speculative_config`` (``speculative.py``) each step ends by asking the drafter for the next
tokens of every decoding request; the next step verifies them, and the tokens a verify keeps are
then taken one by one, exactly as single tokens are, so a stop inside an accepted run ends the
output there and streaming hands out each step's kept tokens together.

With ``pipeline_parallel_size`` P > 1 (and ``pipeline_overlap``, the default) a ``step()`` keeps up
to P steps in flight, one per micro-batch group of requests, so the stages work at once; each call
collects the oldest and returns what it changed (``pipeline_overlap.py``). With n-gram speculation
a group's verify travels down the stages like any step, and only that group gets new drafts when it
comes back (``Scheduler.running_of``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, replace

import torch

from ..errors import (
    ConfigError,
    InvalidRequestError,
    QueueFullError,
    SpeculativeConfigError,
)
from ..model.loader import DEFAULT_MODEL, load_model, prepare_for_device
from ..texts import evaluation_text
from .async_scheduling import AsyncScheduling, time_decode
from .async_scheduling import choose as async_choice
from .block_manager import BlockManager
from .config import EngineConfig
from .logs import log_to_stderr
from .model_runner import ModelRunner, plan_kv_blocks
from .output_processor import NewTokens, OutputProcessor, _Completion, _Request, failed
from .outputs import RequestMetrics, RequestOutput
from .pipeline_overlap import PipelineOverlap
from .sampling_params import SamplingParams
from .scheduler import ScheduledBatch, Scheduler
from .sequence import Sequence, SequenceStatus
from .spec_decode import SpecDecoder
from .startup_log import startup_lines
from .step_output import StepOutput
from .step_trace import StepRecord

logger = logging.getLogger("lifeofprompt.engine")
log_to_stderr(logger, "engine", defer_to_root=False)  # like vLLM: the start-up lines show without any set-up

# ----------------------------------------------------------------------------- the engine


@dataclass
class StartedStep:
    """A step on its way: what the scheduler gave it, its trace, the drafts its verifies check (by seq_id), and
    when it started."""

    batch: ScheduledBatch
    record: StepRecord
    drafts: dict
    start_time: float


class LLMEngine:
    def __init__(self, model=DEFAULT_MODEL, *, clock=time.monotonic, **settings):
        """Start an engine, in this order (``engine/README.md`` walks it): the settings checked
        (``EngineConfig``, before anything loads), the model loaded, speculation's drafter, the other
        ranks of a split model, the runner's start-up (every automatic choice, frozen in
        ``self.resolved``), then the block manager, the scheduler and the start-up log."""
        self.config = EngineConfig.from_settings(model=model, **settings)
        self.clock = clock
        self.model, self.tokenizer = self._load()
        self.model_config = self.model.config  # the whole model's (a split model's rank 0 holds a shard)
        self.spec = SpecDecoder.start(self.config, self.model, self.tokenizer)  # None without speculation
        self.parallel, runner_config = self._start_ranks()  # no ranks in one process
        draft_bytes = self.spec.draft_bytes_per_block() if self.spec is not None else 0
        speedups = prepare_for_device(self.model, runner_config, split=self.parallel is not None)
        self.runner = ModelRunner(self.model, runner_config, speedups, draft_kv_bytes_per_block=draft_bytes)
        self.resolved = r = self.runner.resolved
        if self.parallel is not None:
            self.runner.speedups.share_with(self.parallel, self.model)
        if self.spec is not None:
            self.spec.attach(self.runner)
        if r.kv_cache_dtype == "fp8":  # scales from the shipped text, never from whatever arrives first
            self.runner.calibrate_kv_cache(self.tokenizer.encode(evaluation_text()))
        self._start_books()
        self.pipeline = None  # P > 1: up to P steps in flight, one per micro-batch group (pipeline_overlap.py)
        if r.scheduler.num_groups > 1:
            self.pipeline = PipelineOverlap(self.scheduler, self.runner, r.scheduler.num_groups, self._start_step)
        self.overlap = self._start_async_scheduling()  # None: one step at a time
        self.startup_log = startup_lines(self)
        if self.config.log_stats:
            for line in self.startup_log:
                logger.info(line)

    # ---------------------------------------------------------------- set-up
    def _load(self):
        """The model and its tokenizer: loaded by name or folder (``model/loader.py``), or given loaded."""
        c = self.config
        if isinstance(c.model, str):
            return load_model(c.model, dtype=c.dtype, device=c.device, quantization=c.load_quantization)
        if c.tokenizer is None:
            raise ConfigError("pass tokenizer= together with a loaded model", param="tokenizer")
        return c.model, c.tokenizer

    def _start_ranks(self):
        """A split model (``tensor_parallel_size`` × ``pipeline_parallel_size`` > 1, or ``"mp"``): start the
        other ranks, each with its slice of the weights and a KV pool of the same block count, and keep
        rank 0's shard as the model (``distributed/group.py``). Returns the group and the runner's config."""
        from ..distributed.executor import uses_process_group

        c = self.config
        if not uses_process_group(c.distributed_executor_backend, c.tensor_parallel_size, c.pipeline_parallel_size):
            return None, c
        if self.spec is not None and self.spec.draft_model is not None:
            raise SpeculativeConfigError(
                "a draft model runs in one process only: use method 'ngram' with tensor_parallel_size or "
                "pipeline_parallel_size > 1",
                param="model",
            )
        if c.num_kv_blocks is None and c.kv_cache_memory is None and self.model.device.type == "cuda":
            raise ConfigError(
                "a parallel engine on a GPU needs num_kv_blocks or kv_cache_memory (the pool is not profiled "
                "across ranks)",
                param="num_kv_blocks",
            )
        if c.kv_cache_dtype == "fp8":
            raise ConfigError(
                "kv_cache_dtype='fp8' calibrates its scales in one process: use 'q8_0', 'bfloat16' or 'float16' "
                "with tensor_parallel_size or pipeline_parallel_size > 1",
                param="kv_cache_dtype",
            )
        from ..distributed.group import ParallelGroup

        blocks = plan_kv_blocks(self.model, c, 0)
        group, self.model = ParallelGroup.launch(
            self.model, c.tensor_parallel_size, blocks, c.block_size, stages=c.pipeline_parallel_size,
            kv_cache_dtype=c.kv_cache_dtype,
        )  # fmt: skip
        group.shutdown_with(self)
        return group, c.replace(num_kv_blocks=blocks)

    def _start_books(self) -> None:
        """The block manager, the requests and the scheduler, empty."""
        r = self.resolved
        self.block_manager = BlockManager(r.num_kv_blocks, r.block_size, r.enable_prefix_caching)
        self._start_requests()
        self.scheduler = Scheduler(self.block_manager, r.scheduler, self.eos_token_ids)

    def _start_async_scheduling(self) -> AsyncScheduling | None:
        """The next step scheduled while this one runs (``async_scheduling.py``), where the setting and this
        engine allow, and on a CPU where it timed faster; ``self.async_scheduling_why`` says why it is on or
        off (the start-up log). A timing runs requests through this engine: its books start again after."""
        timings = []

        def time_decode_here(on: bool) -> float:
            timings.append(on)
            return time_decode(self, on)

        def timed():
            return self.runner.speedups.choose_async_scheduling(time_decode_here)

        self.overlap = None
        on, self.async_scheduling_why = async_choice(self.config, self.resolved, self.spec, self.parallel, timed)
        if timings:
            self._start_books()
        if not on:
            return None
        return AsyncScheduling(self.scheduler, self.runner, self._start_step, self._finish_step, self.clock)

    def _start_requests(self) -> None:
        """The request table, the inbox other threads add to, and the locks around them."""
        self.eos_token_ids = set(self.model_config.eos_token_ids)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self.runner.eos_token_ids = tuple(sorted(self.eos_token_ids))  # what min_tokens holds back
        self._grammar_backend = None
        self._tokenizer_lock = threading.Lock()  # HF fast tokenizers dislike concurrent use
        self.outputs = OutputProcessor(self.tokenizer, self._tokenizer_lock, self.model.is_random)
        self.max_waiting = self.resolved.max_waiting  # the queue's bound (the server sets one where none was asked)
        self.requests: dict[str, _Request] = {}
        self._owner: dict[int, tuple[_Request, _Completion]] = {}  # seq_id -> its request and answer
        self.step_records: deque[StepRecord] = deque(maxlen=self.config.max_step_records)
        self._inbox: list[tuple] = []  # ("add", request), ("abort", request_id), ("end", request, completion, why)
        self._ended: list[tuple[_Request, str]] = []  # ended outside a step: their outputs come with the next
        self._lock = threading.Lock()  # guards the inbox, the ended list and the request table
        self._step_lock = threading.Lock()  # held while a step (or an inbox drain) runs

    @property
    def model_name(self) -> str:
        return self.resolved.model_name

    @property
    def max_model_len(self) -> int:
        return self.resolved.max_model_len

    @property
    def num_kv_blocks(self) -> int:
        return self.resolved.num_kv_blocks

    @property
    def block_size(self) -> int:
        return self.resolved.block_size

    @property
    def spec_stats(self):
        """Speculative decoding's counters since start (``speculative.SpecDecodeStats``), or None."""
        return self.spec.stats if self.spec is not None else None

    @property
    def proposer(self):
        """The drafter (tests and notebooks may put their own in its place)."""
        return self.spec.proposer if self.spec is not None else None

    @proposer.setter
    def proposer(self, value) -> None:
        self.spec.proposer = value

    def shutdown(self) -> None:
        """End the tensor-parallel workers (if any); the engine cannot step afterwards. Idempotent."""
        if self.overlap is not None:
            self.overlap.shutdown()
        if self.parallel is not None:
            self.parallel.shutdown()

    # ---------------------------------------------------------------- requests in (any thread)
    def tokenize(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            with self._tokenizer_lock:
                return prompt, list(self.tokenizer.encode(prompt, add_special_tokens=False))
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        return None, list(prompt)

    def _checked_prompt(self, prompt, params: SamplingParams, index: int | None) -> tuple[str | None, list[int]]:
        """Tokenize and check one request's prompt, and the token ids its settings name; raise a typed error
        naming ``index``."""
        if not isinstance(prompt, (str, list, tuple, dict)):
            raise InvalidRequestError(
                f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}",
                param="prompt",
                index=index,
            )
        text, ids = self.tokenize(prompt)
        if not ids:
            raise InvalidRequestError("the prompt is empty", param="prompt", index=index)
        vocab = self.model_config.vocab_size
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise InvalidRequestError(
                    f"token id {t!r} is outside the vocabulary [0, {vocab})", param="prompt", index=index
                )
        for field_name, tokens in (("logit_bias", params.logit_bias or {}), ("stop_token_ids", params.stop_token_ids)):
            outside = [t for t in tokens if not 0 <= t < vocab]
            if outside:
                raise InvalidRequestError(
                    f"token id {outside[0]!r} is outside the vocabulary [0, {vocab})", param=field_name, index=index
                )
        if params.prompt_logprobs is not None and self.parallel is not None:
            raise InvalidRequestError(
                "prompt_logprobs needs the whole model in one process (tensor_parallel_size and "
                "pipeline_parallel_size 1)",
                param="prompt_logprobs",
                index=index,
            )
        if params.structured_outputs is not None:
            try:
                self.grammar_backend().compile(params.structured_outputs)
            except InvalidRequestError as exc:
                raise InvalidRequestError(str(exc), param=exc.param, index=index) from None
        return text, ids

    def grammar_backend(self):
        """The structured-output compiler for this engine's tokenizer, made on first use (``structured_output.py``)."""
        if self._grammar_backend is None:
            from .structured_output import GrammarBackend

            self._grammar_backend = GrammarBackend(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids)
        return self._grammar_backend

    def make_request(
        self, request_id: str, prompt, sampling_params: SamplingParams | None = None, arrival_time=None, index=None
    ) -> _Request:
        """The one check of a request (text, token ids, or ``{"prompt_token_ids": [...]}``), before anything
        is queued: a typed error naming the problem (and ``index``, the prompt's place in a list); else the
        request, one ``Sequence`` per answer, ready for ``add``."""
        params = sampling_params if sampling_params is not None else SamplingParams()
        answers = self._answer_params(params, index)
        text, ids = self._checked_prompt(prompt, params, index)
        arrival = self.clock() if arrival_time is None else arrival_time
        request_id = str(request_id)
        completions = [self._answer(request_id, text, ids, params, i, arrival, p) for i, p in enumerate(answers)]
        try:
            self.scheduler.check_fits(completions[0].seq)
        except InvalidRequestError as exc:
            raise type(exc)(str(exc), param=exc.param, index=index) from None
        metrics = RequestMetrics(
            arrival_time=arrival,
            num_prompt_tokens=len(ids),
            spec_decode=self.spec.new_request_stats() if self.spec is not None else None,
        )
        for completion in completions:  # the drafts' price reads the request's own acceptance
            completion.seq.spec_stats = metrics.spec_decode
        return _Request(request_id, text, ids, params, metrics, completions, pending=completions[1:])

    @staticmethod
    def _answer_params(params: SamplingParams, index: int | None) -> list[SamplingParams]:
        """The settings checked (a typed error naming ``index``), then each answer's own copy, checked as it
        is made: answer ``i`` of ``n`` samples on its own stream (seed, seed + 1, ...; None stays None), the
        first alone scores the prompt (when asked; the others share its cached blocks)."""
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(
                f"sampling_params must be a SamplingParams, got {type(params).__name__}",
                param="sampling_params",
                index=index,
            )
        try:
            params.validate()
            return [
                replace(
                    params,
                    n=1,
                    seed=None if params.seed is None else params.seed + i,
                    prompt_logprobs=params.prompt_logprobs if i == 0 else None,
                )
                for i in range(params.n)
            ]
        except InvalidRequestError as exc:
            raise InvalidRequestError(str(exc), param=exc.param, index=index) from None

    def _answer(
        self, request_id: str, text, ids: list[int], params: SamplingParams, i: int, arrival, child: SamplingParams
    ) -> _Completion:
        """Answer ``i`` of ``n``, with its own settings ``child`` (``_answer_params``)."""
        answer_id = request_id if params.n == 1 else f"{request_id}/{i}"
        seq = Sequence(answer_id, ids, child, prompt=text, arrival_time=arrival)
        if params.structured_outputs is not None:  # each answer walks the grammar on its own
            seq.grammar = self.grammar_backend().matcher(params.structured_outputs)
        if params.logprobs is None:
            return _Completion(i, seq)
        return _Completion(i, seq, logprobs=[], cumulative_logprob=0.0)

    def add_request(
        self, request_id: str, prompt, sampling_params: SamplingParams | None = None, arrival_time: float | None = None
    ) -> None:
        """Check and queue a request (``make_request``, then ``add``); safe from any thread."""
        self.add(self.make_request(request_id, prompt, sampling_params, arrival_time))

    def add(self, request: _Request) -> None:
        """Queue a request ``make_request`` made; safe from any thread. Raises ``QueueFullError`` when
        ``max_waiting`` requests already wait."""
        request_id = request.request_id
        with self._lock:
            if request_id in self.requests:
                raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
            if self.max_waiting is not None and self._num_queued() >= self.max_waiting + self._free_seats():
                raise QueueFullError(
                    f"the engine is full: {self.scheduler.config.max_num_seqs} requests running and "
                    f"{self.max_waiting} waiting (max_waiting); retry later"
                )
            self.requests[request_id] = request
            for c in request.completions:
                self._owner[c.seq.seq_id] = (request, c)
            self._inbox.append(("add", request))

    def _num_queued(self) -> int:
        """Requests not running yet: waiting in the scheduler, or still in the inbox (under ``_lock``)."""
        return len(self.scheduler.waiting) + sum(1 for kind, _ in self._inbox if kind == "add")

    def _free_seats(self) -> int:
        """Running slots the next step can fill: a burst that arrives between two steps takes them
        first, so ``max_num_seqs + max_waiting`` requests are admitted, as documented."""
        return max(0, self.scheduler.config.max_num_seqs - len(self.scheduler.running))

    def queued_request_ids(self) -> list[str]:
        """Requests none of whose answers has started (a shutdown aborts these at once)."""
        with self._lock:
            return [
                rid
                for rid, r in self.requests.items()
                if all(
                    c.seq.status == SequenceStatus.WAITING
                    and not c.seq.output_token_ids
                    and c.seq.num_computed_tokens == 0
                    for c in r.completions
                )
            ]

    def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks (now if no step is running, else at the next step)."""
        with self._lock:
            self._inbox.append(("abort", str(request_id)))
        if self._step_lock.acquire(blocking=False):
            try:
                self._drain_inbox()
            finally:
                self._step_lock.release()

    def has_unfinished_requests(self) -> bool:
        with self._lock:
            return (
                bool(self._inbox or self._ended)
                or self.scheduler.has_unfinished()
                or bool(self.pipeline is not None and self.pipeline.in_flight)
                or bool(self.overlap is not None and self.overlap.in_flight)
            )

    def get_num_unfinished_requests(self) -> int:
        with self._lock:
            return sum(1 for r in self.requests.values() if not r.finished)

    # ---------------------------------------------------------------- the step
    def step(self) -> list[RequestOutput]:
        """One step, then its outputs: the requests that changed (new tokens or finished).

        Under the step's lock (vLLM's engine core): the inbox, ``scheduler.schedule()``,
        ``runner.execute(batch)``, ``scheduler.update_from_output(batch, sampled)``. After it, the output
        processor makes text and outputs (``output_processor.py``). With pipeline overlap one call
        submits steps until P are in flight and collects the oldest.
        """
        with self._step_lock:
            updates = self._core_step()
        with self._lock:
            ended, self._ended = self._ended, []
        outputs, ends = self.outputs.process(updates, ended)
        self._after_outputs(outputs, ends)
        return outputs

    def _core_step(self) -> list[NewTokens]:
        """Take the inbox, schedule, execute, update: what each answer got from the step (nothing when
        nobody could run)."""
        self._drain_inbox()
        if self.pipeline is not None:
            done = self.pipeline.advance()
            return self._finish_step(*done) if done is not None else []
        if self.overlap is not None:
            if not any(seq.prompt_logprobs is not None for seq in self.scheduler.seqs):
                return self.overlap.step()
            if self.overlap.in_flight is not None:  # a request scores its prompt: its steps run one at a time
                return self.overlap.drain()
        batch = self.scheduler.schedule()
        if not batch.seqs:  # nobody could run
            return []
        started = self._start_step(batch)
        return self._finish_step(started, self.runner.execute(batch.seqs, batch.num_scheduled_tokens))

    def _drain_inbox(self) -> None:
        """What other threads asked since the last step: new requests, aborts, and the ends the output
        processor found (a stop string, a request's error)."""
        with self._lock:
            inbox, self._inbox = self._inbox, []
        for kind, *item in inbox:
            if kind == "add":
                self.scheduler.add(item[0].completions[0].seq)
            elif kind == "abort":
                request = self.requests.get(item[0])
                if request is not None and not request.finished:  # unknown or already done: nothing to stop
                    self._end_request(request, "abort")
            else:  # "end": the caller already saw the end; the scheduler lets the sequences go now
                request, completion, reason = item
                if completion is not None:
                    self.scheduler.finish_requests([completion.seq], reason)
                else:
                    self._end_request(request, reason, report=False)

    def _after_outputs(self, outputs: list[RequestOutput], ends: list) -> None:
        """Forget the finished requests; queue the ends the output processor found for the next step."""
        with self._lock:
            for output in outputs:
                if output.finished:
                    self._forget_locked(output.request_id)
            self._inbox.extend(("end", *end) for end in ends)

    def _forget_locked(self, request_id: str) -> None:
        request = self.requests.pop(request_id, None)
        for c in request.completions if request is not None else ():
            self._owner.pop(c.seq.seq_id, None)

    def _start_step(self, batch: ScheduledBatch) -> StartedStep:
        """Before a step runs: a draft model drafts, its trace opens, first-scheduled metrics."""
        if self.spec is not None:
            self.spec.fill(batch.seqs, self.clock)  # a draft model drafts now, into the slots just given
        record = batch.trace  # the scheduler's account of the step; the engine adds its times and outcome
        record.start_time = start = self.clock()
        for seq in batch.seqs:
            request, _ = self._owner[seq.seq_id]
            metrics = request.metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = start
                metrics.num_cached_tokens = seq.num_cached_tokens
            metrics.num_preemptions = sum(c.seq.num_preemptions for c in request.completions)
        drafts = {seq.seq_id: list(seq.spec_token_ids) for seq in batch.seqs if seq.spec_token_ids}
        return StartedStep(batch, record, drafts, start)

    def _finish_step(self, started: StartedStep, out: StepOutput) -> list[NewTokens]:
        """After a step ran: its failures end their requests, the scheduler takes its tokens, speculation
        learns what was kept, the trace closes, the next drafts. Returns each answer's new tokens."""
        batch, now = started.batch, self.clock()
        if started.drafts:
            self.spec_stats.verify_time += now - started.start_time
        self._take_prompt_logprobs(out)
        for seq_id, exc in out.failures.items():  # a row the sampler could not sample: its request ends
            if seq_id in self._owner:
                self._end_request(self._owner[seq_id][0], "error", exc, "in the sampler")
        starts = {seq.seq_id: seq.num_computed_tokens for seq in batch.seqs}
        update = self.scheduler.update_from_output(batch, out.tokens)
        finished = {seq.seq_id: seq for seq in update.finished}
        updates = []
        for seq, share, token, entry in zip(batch.seqs, started.record.scheduled, out.tokens, out.logprobs):
            tokens = update.new_tokens.get(seq.seq_id)
            if tokens is None and seq.seq_id not in finished:
                continue
            request, completion = self._owner[seq.seq_id]
            if seq.seq_id in started.drafts and tokens:
                kept_run = token if isinstance(token, list) else [token]
                share.num_accepted_tokens = self.spec.observe(
                    request.metrics, starts[seq.seq_id], started.drafts[seq.seq_id], kept_run
                )
            ended = (seq.finish_reason, seq.stop_reason) if seq.seq_id in finished else None
            updates.append(NewTokens(request, completion, tokens or [], entry, ended, now))
            if ended is not None:
                started.record.finished.append(seq.request_id)
            if request.pending and completion.index == 0:
                self._release_siblings(request)
        started.record.end_time, started.record.launch = now, out.launch
        self.step_records.append(started.record)
        if self.spec is not None:
            # with overlap only this step's group: another's step may be in the pipe with its drafts packed
            group = started.batch.group
            self.spec.propose(self.scheduler.running_of(group), self.scheduler.max_num_drafts, self.clock)
        if self.config.check_invariants:
            self.block_manager.check_invariants(self.scheduler.seqs)
        return updates

    def _take_prompt_logprobs(self, out: StepOutput) -> None:
        """The prompt tokens this step scored join their sequence's list (``prompt_logprobs.py``)."""
        for seq_id, entries in out.prompt_logprobs.items():
            owner = self._owner.get(seq_id)
            if owner is not None and owner[1].seq.prompt_logprobs is not None:
                owner[1].seq.prompt_logprobs.extend(entries)

    def _release_siblings(self, request: _Request) -> None:
        """n > 1: once the first answer has sampled, its prompt's full blocks are cached, so the other
        answers start now, at the front of the queue, and share them."""
        for sibling in reversed(request.pending):
            self.scheduler.add(sibling.seq, front=True)
        request.pending.clear()

    def _end_request(
        self, request: _Request, reason: str, error: BaseException | None = None, where: str = "", report=True
    ) -> None:
        """End every open answer of a request (``reason``: "abort" or "error") and free its blocks now; its
        output comes with the next step's (``report``). An error is kept typed (``output_processor.failed``)."""
        if error is not None and request.error is None:
            request.error = failed(request, error, where)
            logger.warning("request %s failed %s: %r", request.request_id, where, error)
        request.pending.clear()  # answers never handed to the scheduler end with the others, holding no block
        self.scheduler.finish_requests([c.seq for c in request.completions], reason)
        request.metrics.finished_time = self.clock()
        if report:
            with self._lock:
                self._ended.append((request, reason))

    # ---------------------------------------------------------------- looking inside
    @property
    def stats(self) -> dict:
        """Numbers for a /metrics page: queue lengths, blocks, prefix-cache hits, preemptions."""
        bm = self.block_manager
        return dict(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_kv_blocks=bm.num_blocks,
            num_used_blocks=bm.num_used_blocks,
            num_free_blocks=bm.num_free_blocks,
            kv_cache_usage=bm.num_used_blocks / bm.num_blocks,
            prefix_cache_hit_rate=bm.stats["hit_rate"],
            num_preemptions=self.scheduler.num_preemptions,
            num_steps=self.scheduler.num_steps,
            spec_decode=self.spec_stats.as_dict() if self.spec_stats is not None else None,
        )

    @torch.no_grad()
    def run_until_done(self) -> list[RequestOutput]:
        """Step until every request finished; the final output of each, in finishing order."""
        done = []
        while self.has_unfinished_requests():
            done.extend(o for o in self.step() if o.finished)
        return done

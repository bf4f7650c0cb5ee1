"""``LLMEngine``: requests in, one ``step()`` at a time, ``RequestOutput``s out.

One step = the scheduler picks who runs and how many tokens (``scheduler.py``), the block
manager gives their cache slots (``block_manager.py``), the model runner computes them and
samples (``model_runner.py``), and each new token is turned into text and checked for the end of
its request (``completions.py``): EOS (unless ``ignore_eos``), a stop token id, a stop string,
``max_tokens``, or the context limit. Finished and aborted requests give their blocks back at once.
The start-up log is written in ``startup_log.py``.

Requests may arrive while it runs. ``add_request`` and ``abort`` are safe from other threads
(the HTTP server calls them from its event loop while an engine thread drives ``step()``):
they only touch a small inbox under a lock, and ``step()`` applies the inbox first. An abort
that arrives while no step is running is applied immediately, so its blocks are free when
``abort`` returns.

Every time is ``time.monotonic()``: arrival, first scheduled, first token, each token, finish
(``RequestMetrics``), so ``lifeofprompt.serving.metrics`` can read TTFT and TPOT straight off them.

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
    LifeOfPromptError,
    QueueFullError,
    RequestFailedError,
    SpeculativeConfigError,
)
from ..model.loader import DEFAULT_MODEL, load_model
from .block_manager import BlockManager
from .completions import CompletionUpdates
from .config import EngineConfig
from .logs import log_to_stderr
from .model_runner import ModelRunner, plan_kv_blocks
from .outputs import RequestMetrics, RequestOutput
from .pipeline_overlap import PipelineOverlap
from .request_state import IncrementalDetokenizer, _Completion, _Request
from .sampling_params import SamplingParams
from .scheduler import ScheduledBatch, Scheduler
from .sequence import Sequence, SequenceStatus
from .spec_decode import SpecDecoder
from .startup_log import startup_lines
from .step_output import StepOutput
from .step_trace import StepRecord, record_step

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


class LLMEngine(CompletionUpdates):
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
        split = self.parallel is not None
        self.runner = ModelRunner(self.model, runner_config, draft_kv_bytes_per_block=draft_bytes, split=split)
        self.resolved = r = self.runner.resolved
        if self.parallel is not None:
            self.runner.speedups.share_with(self.parallel, self.model)
        if self.spec is not None:
            self.spec.attach(self.runner)
        self.block_manager = BlockManager(r.num_kv_blocks, r.block_size, r.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, r.scheduler)
        self.pipeline = None  # P > 1: up to P steps in flight, one per micro-batch group (pipeline_overlap.py)
        if r.scheduler.num_groups > 1:
            self.pipeline = PipelineOverlap(self.scheduler, self.runner, r.scheduler.num_groups, self._start_step)
        self._start_requests()
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
        from ..distributed.group import ParallelGroup

        blocks = plan_kv_blocks(self.model, c, 0)
        group, self.model = ParallelGroup.launch(
            self.model, c.tensor_parallel_size, blocks, c.block_size, stages=c.pipeline_parallel_size
        )
        group.shutdown_with(self)
        return group, c.replace(num_kv_blocks=blocks)

    def _start_requests(self) -> None:
        """The request table, the inbox other threads add to, and the locks around them."""
        self.eos_token_ids = set(self.model_config.eos_token_ids)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self.runner.eos_token_ids = tuple(sorted(self.eos_token_ids))  # what min_tokens holds back
        self._grammar_backend = None
        self.max_waiting = self.resolved.max_waiting  # the queue's bound (the server sets one where none was asked)
        self.requests: dict[str, _Request] = {}
        self._owner: dict[int, tuple[_Request, _Completion]] = {}  # seq_id -> its request and answer
        self.step_records: deque[StepRecord] = deque(maxlen=self.config.max_step_records)
        self._inbox: list[tuple[str, object]] = []
        self._pending_outputs: list[RequestOutput] = []
        self._lock = threading.Lock()  # guards the inbox and the request table
        self._step_lock = threading.Lock()  # held while a step (or an inbox drain) runs
        self._tokenizer_lock = threading.Lock()  # HF fast tokenizers dislike concurrent use

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

    def validate(self, prompt, params: SamplingParams, index: int | None = None) -> tuple[str | None, list[int]]:
        """Tokenize and check one request; raise a typed error naming ``index`` (when given)."""
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(
                f"sampling_params must be a SamplingParams, got {type(params).__name__}",
                param="sampling_params",
                index=index,
            )
        try:
            params.validate()
        except InvalidRequestError as exc:
            raise InvalidRequestError(str(exc), param=exc.param, index=index) from None
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
        probe = Sequence("probe", ids, params)
        try:
            self.scheduler.check_fits(probe)
        except InvalidRequestError as exc:
            raise type(exc)(str(exc), param=exc.param, index=index) from None
        return text, ids

    def grammar_backend(self):
        """The structured-output compiler for this engine's tokenizer, made on first use (``structured_output.py``)."""
        if self._grammar_backend is None:
            from .structured_output import GrammarBackend

            self._grammar_backend = GrammarBackend(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids)
        return self._grammar_backend

    def add_request(
        self, request_id: str, prompt, sampling_params: SamplingParams | None = None, arrival_time: float | None = None
    ) -> None:
        """Queue a request (text, token ids, or ``{"prompt_token_ids": [...]}``); safe from any thread."""
        params = sampling_params if sampling_params is not None else SamplingParams()
        text, ids = self.validate(prompt, params)
        arrival = self.clock() if arrival_time is None else arrival_time
        request_id = str(request_id)
        completions = []
        for i in range(params.n):
            # each answer samples on its own stream: seed, seed + 1, ... (None stays None); the first scores
            # the prompt (when asked), the others share its cached blocks
            child = replace(
                params,
                n=1,
                seed=None if params.seed is None else params.seed + i,
                prompt_logprobs=params.prompt_logprobs if i == 0 else None,
            )
            answer_id = request_id if params.n == 1 else f"{request_id}/{i}"
            seq = Sequence(answer_id, ids, child, prompt=text, arrival_time=arrival)
            if params.structured_outputs is not None:  # each answer walks the grammar on its own
                seq.grammar = self.grammar_backend().matcher(params.structured_outputs)
            completions.append(
                _Completion(
                    i,
                    seq,
                    IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens),
                    logprobs=[] if params.logprobs is not None else None,
                    cumulative_logprob=0.0 if params.logprobs is not None else None,
                )
            )
        metrics = RequestMetrics(
            arrival_time=arrival,
            num_prompt_tokens=len(ids),
            spec_decode=self.spec.new_request_stats() if self.spec is not None else None,
        )
        for completion in completions:  # the drafts' price reads the request's own acceptance
            completion.seq.spec_stats = metrics.spec_decode
        request = _Request(request_id, text, ids, params, metrics, completions, pending=completions[1:])
        with self._lock:
            if request_id in self.requests:
                raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
            if self.max_waiting is not None and self._num_queued() >= self.max_waiting + self._free_seats():
                raise QueueFullError(
                    f"the engine is full: {self.scheduler.config.max_num_seqs} requests running and "
                    f"{self.max_waiting} waiting (max_waiting); retry later"
                )
            self.requests[request_id] = request
            for c in completions:
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
                bool(self._inbox or self._pending_outputs)
                or self.scheduler.has_unfinished()
                or bool(self.pipeline is not None and self.pipeline.in_flight)
            )

    def get_num_unfinished_requests(self) -> int:
        with self._lock:
            return sum(1 for r in self.requests.values() if not r.finished)

    # ---------------------------------------------------------------- the step (one thread)
    def _drain_inbox(self) -> None:
        with self._lock:
            inbox, self._inbox = self._inbox, []
        for kind, item in inbox:
            if kind == "add":
                self.scheduler.add(item.completions[0].seq)
                continue
            request = self.requests.get(item)
            if request is not None and not request.finished:  # unknown or already done: nothing to stop
                self._end_request(request, "abort", self.clock())
                self._pending_outputs.append(self._output_of(request))

    def _forget(self, request: _Request) -> None:
        with self._lock:
            self.requests.pop(request.request_id, None)
            for c in request.completions:
                self._owner.pop(c.seq.seq_id, None)

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, and return the requests that changed (new tokens or finished).

        With pipeline overlap one call submits steps until P are in flight and collects the oldest.
        """
        with self._step_lock:
            self._drain_inbox()
            outputs, self._pending_outputs = self._pending_outputs, []
            if self.pipeline is not None:
                done = self.pipeline.advance()
                return outputs + (self._finish_step(*done) if done is not None else [])
            batch = self.scheduler.schedule()
            if batch.is_empty:
                return outputs
            started = self._start_step(batch)
            return outputs + self._finish_step(started, self.runner.execute(batch.seqs, batch.num_scheduled_tokens))

    def _start_step(self, batch: ScheduledBatch) -> StartedStep:
        """Before a step runs: a draft model drafts, its trace opens, first-scheduled metrics."""
        if self.spec is not None:
            self.spec.fill(batch.seqs, self.clock)  # a draft model drafts now, into the slots just given
        record = record_step(batch, self.scheduler)
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

    def _finish_step(self, started: StartedStep, out: StepOutput) -> list[RequestOutput]:
        """After a step ran: its tokens into their requests, its failures, its trace; then the next drafts."""
        now = self.clock()
        if started.drafts:
            self.spec_stats.verify_time += now - started.start_time
        self._take_prompt_logprobs(out)
        changed = self._take_tokens(started, out, now)
        self._finish_prompt_only(started, changed, now)
        for seq_id, exc in out.failures.items():
            if seq_id in self._owner:
                request = self._owner[seq_id][0]
                self._end_request(request, "error", now, exc, "in the sampler")
                changed[request.request_id] = request
        outputs = [self._output_of(request) for request in changed.values()]
        started.record.end_time, started.record.launch = now, out.launch
        self.step_records.append(started.record)
        if self.spec is not None:
            # with overlap only this step's group: another's step may be in the pipe with its drafts packed
            group = started.batch.group
            self.spec.propose(self.scheduler.running_of(group), self.scheduler.max_num_drafts, self.clock)
        if self.config.check_invariants:
            self.block_manager.check_invariants(self.scheduler.seqs)
        return outputs

    def _take_tokens(self, started: StartedStep, out: StepOutput, now: float) -> dict[str, _Request]:
        """Each sequence's new tokens: the scheduler's update (a verify's rejected drafts rolled back, full
        blocks cached), then text and stops in its request. Returns the requests that changed."""
        batch, drafts = started.batch, started.drafts
        starts = {seq.seq_id: seq.num_computed_tokens for seq in batch.seqs}
        shares = {seq.seq_id: share for seq, share in zip(batch.seqs, started.record.scheduled)}
        produced = {seq.seq_id: entry for seq, entry in zip(batch.seqs, zip(out.tokens, out.logprobs))}
        sampled = [None if seq.seq_id in out.failures else token for seq, token in zip(batch.seqs, out.tokens)]
        changed: dict[str, _Request] = {}
        for seq in self.scheduler.update(batch, sampled):
            request, completion = self._owner[seq.seq_id]
            if request.error is not None:
                continue
            token, logprobs = produced[seq.seq_id]
            tokens = token if isinstance(token, list) else [token]
            if seq.seq_id in drafts:
                kept = self.spec.observe(request.metrics, starts[seq.seq_id], drafts[seq.seq_id], tokens)
                shares[seq.seq_id].num_accepted_tokens = kept
            changed[request.request_id] = request
            try:
                self._on_tokens(request, completion, tokens, logprobs, now)
            except Exception as exc:  # this request's detokenizer or stop check: it alone ends
                self._end_request(request, "error", now, exc, "while turning its token into text")
                continue
            if completion.finished:
                started.record.finished.append(seq.request_id)
            self._release_siblings(request, completion)
        return changed

    def _take_prompt_logprobs(self, out: StepOutput) -> None:
        """The prompt tokens this step scored join their sequence's list (``prompt_logprobs.py``)."""
        for seq_id, entries in out.prompt_logprobs.items():
            owner = self._owner.get(seq_id)
            if owner is not None and owner[1].seq.prompt_logprobs is not None:
                owner[1].seq.prompt_logprobs.extend(entries)

    def _finish_prompt_only(self, started: StartedStep, changed: dict[str, _Request], now: float) -> None:
        """``max_tokens=0`` (a log-likelihood: the prompt's logprobs, nothing generated): a request ends with
        "length" once its whole prompt is computed."""
        for seq in started.batch.seqs:
            if (
                seq.sampling_params.max_tokens == 0
                and seq.status == SequenceStatus.RUNNING
                and seq.num_computed_tokens >= seq.num_prompt_tokens
                and seq.seq_id in self._owner
            ):
                request, completion = self._owner[seq.seq_id]
                self.scheduler.finish(seq, "length")
                if request.finished:
                    request.metrics.finished_time = now
                started.record.finished.append(seq.request_id)
                changed[request.request_id] = request
                self._release_siblings(request, completion)

    def _release_siblings(self, request: _Request, completion: _Completion) -> None:
        """n > 1: once the first answer has sampled, its prompt's full blocks are cached, so the other
        answers start now, at the front of the queue, and share them."""
        if request.pending and completion.index == 0:
            for sibling in reversed(request.pending):
                self.scheduler.add(sibling.seq, front=True)
            request.pending.clear()

    def _output_of(self, request: _Request) -> RequestOutput:
        """The snapshot a caller sees; a finished request is forgotten."""
        output = self._make_output(request)
        if request.finished:
            self._forget(request)
        return output

    def _end_request(
        self, request: _Request, reason: str, now: float, error: BaseException | None = None, where: str = ""
    ) -> None:
        """End every unfinished answer of a request (``reason``: "abort" or "error") and free its blocks now.
        An error is kept typed (its own input's fault: 4xx; anything else becomes a 500)."""
        if error is not None and request.error is None:
            request.error = (
                error
                if isinstance(error, LifeOfPromptError)
                else RequestFailedError(
                    f"request {request.request_id!r} failed {where}: {type(error).__name__}: {error}"
                )
            )
            logger.warning("request %s failed %s: %r", request.request_id, where, error)
        for c in request.completions:
            if c.finished:
                continue
            if any(c is p for p in request.pending):  # never handed to the scheduler: holds no block
                c.seq.status, c.seq.finish_reason = SequenceStatus.FINISHED, reason
            else:
                self.scheduler.finish(c.seq, reason)  # its blocks go back now
        request.pending.clear()
        request.metrics.finished_time = now

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

"""``LLMEngine``: requests in, one ``step()`` at a time, ``RequestOutput``s out.

One step = the scheduler picks who runs and how many tokens (``scheduler.py``), the block
manager gives their cache slots (``block_manager.py``), the model runner computes them and
samples (``model_runner.py``), and this file turns each new token into text and decides when a
request is done: EOS (unless ``ignore_eos``), a stop token id, a stop string, ``max_tokens``,
or the context limit. Finished and aborted requests give their blocks back at once.

Requests may arrive while it runs. ``add_request`` and ``abort`` are safe from other threads
(the HTTP server calls them from its event loop while an engine thread drives ``step()``):
they only touch a small inbox under a lock, and ``step()`` applies the inbox first. An abort
that arrives while no step is running is applied immediately, so its blocks are free when
``abort`` returns.

Every time is ``time.monotonic()``: arrival, first scheduled, first token, each token, finish
(``RequestMetrics``), so ``lifeofprompt.serving.metrics`` can read TTFT and TPOT straight off them.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace

import torch

from .block_manager import BlockManager
from ..errors import ConfigError, InvalidRequestError, QueueFullError
from .outputs import CompletionOutput, RequestMetrics, RequestOutput
from .sampling_params import SamplingParams
from .scheduler import Scheduler, StepRecord, format_steps
from .sequence import Sequence, SequenceStatus

logger = logging.getLogger("lifeofprompt.engine")
if not logger.handlers:                     # like vLLM: the start-up lines show without any logging set-up
    _handler = logging.StreamHandler(sys.stderr)
    _handler.setFormatter(logging.Formatter("INFO %(asctime)s engine: %(message)s", "%H:%M:%S"))
    logger.addHandler(_handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False

DEFAULT_CPU_KV_CACHE_MEMORY = 2 * 1024**3
DETOKENIZE_CONTEXT = 5        # prompt tokens kept as context so the first output token decodes with its space


# ----------------------------------------------------------------------------- text, a token at a time


class IncrementalDetokenizer:
    """Turns one new token id at a time into the text it adds (vLLM's prefix/read offsets).

    Decoding a growing list from scratch each step costs O(n²); decoding only the new token
    breaks words that span tokens and multi-byte characters. So we decode a short window twice,
    with and without the new tokens, and emit the difference — holding it back while it ends in
    an incomplete UTF-8 character ("\\ufffd").
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_token_ids[-DETOKENIZE_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        delta = new_text[len(prefix_text):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta


# ----------------------------------------------------------------------------- one request's state


@dataclass
class _Completion:
    """One of the ``n`` answers of a request: its sequence and the text made from it so far."""

    index: int
    seq: Sequence
    detokenizer: IncrementalDetokenizer
    text: str = ""                  # the output text (stop strings cut off)
    emitted_text_len: int = 0       # how much of ``text`` earlier outputs already carried
    logprobs: list | None = None
    cumulative_logprob: float | None = None
    new_token_ids: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.seq.status == SequenceStatus.FINISHED


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    completions: list[_Completion]
    pending: list[_Completion] = field(default_factory=list)   # n > 1: waiting for the first one's prompt

    @property
    def finished(self) -> bool:
        return not self.pending and all(c.finished for c in self.completions)


def _unpack_logprobs(entry):
    """The runner's per-token logprob entry: ``(logprob, {id: logprob})`` or None."""
    if entry is None:
        return None, None
    if isinstance(entry, tuple) and len(entry) == 2:
        return entry
    return None, entry


# ----------------------------------------------------------------------------- the engine


class LLMEngine:
    def __init__(self, model="smollm2-135m", *, tokenizer=None, dtype=None, device=None, block_size: int = 16,
                 num_kv_blocks: int | None = None, kv_cache_memory: int | None = None,
                 max_num_seqs: int = 256, max_num_batched_tokens: int = 2048, max_model_len: int | None = None,
                 enable_prefix_caching: bool = True, attention_backend: str | None = None,
                 enforce_eager: bool = False, gpu_memory_utilization: float = 0.9,
                 max_waiting: int | None = None, check_invariants: bool = False,
                 max_step_records: int = 10_000, log_stats: bool = True, clock=time.monotonic,
                 prepack_cpu_weights: bool = True, cpu_linear: str | None = None,
                 cpu_decode: bool | None = None, tensor_parallel_size: int = 1,
                 pipeline_parallel_size: int = 1):
        if isinstance(model, str):
            from ..model.loader import load_model
            self.model, self.tokenizer = load_model(model, dtype=dtype, device=device)
            self.model_name = model
        else:
            if tokenizer is None:
                raise ConfigError("pass tokenizer= together with a loaded model")
            self.model, self.tokenizer = model, tokenizer
            self.model_name = getattr(model, "name", None) or model.config.name
        if max_waiting is not None and max_waiting < 1:
            raise ConfigError(f"max_waiting must be >= 1 (or None for unbounded), got {max_waiting}")
        self.config = self.model.config
        self.clock = clock
        self.block_size = block_size
        self.max_waiting = max_waiting
        self.check_invariants = check_invariants
        context_len = min(max_model_len or self.config.max_position_embeddings, self.config.max_position_embeddings)
        if num_kv_blocks is None and (kv_cache_memory is not None or self.model.device.type != "cuda"):
            num_kv_blocks = self._blocks_for_memory(kv_cache_memory or DEFAULT_CPU_KV_CACHE_MEMORY)
        self.parallel = None     # T > 1: the worker processes (lifeofprompt.distributed); self.model is rank 0's shard
        if tensor_parallel_size != 1 or pipeline_parallel_size != 1:
            self._launch_tensor_parallel(tensor_parallel_size, pipeline_parallel_size, num_kv_blocks)
            cpu_decode, cpu_linear = False, cpu_linear or "linear"
        from .model_runner import ModelRunner
        self.runner = ModelRunner(self.model, num_kv_blocks, block_size, attention_backend or "auto",
                                  max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                  max_model_len=context_len, enforce_eager=enforce_eager or None,
                                  gpu_memory_utilization=gpu_memory_utilization,
                                  prepack_cpu_weights=prepack_cpu_weights, cpu_linear=cpu_linear,
                                  cpu_decode=cpu_decode)
        self.num_kv_blocks = self.runner.kv_cache.num_blocks
        self.block_manager = BlockManager(self.num_kv_blocks, block_size, enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs, max_num_batched_tokens, context_len)
        self.max_model_len = self.scheduler.max_model_len
        self.eos_token_ids = set(self.config.eos_token_ids)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self.requests: dict[str, _Request] = {}
        self._owner: dict[int, tuple[_Request, _Completion]] = {}   # seq_id -> its request and answer
        self.step_records: deque[StepRecord] = deque(maxlen=max_step_records)
        self._inbox: list[tuple[str, object]] = []
        self._pending_outputs: list[RequestOutput] = []
        self._lock = threading.Lock()            # guards the inbox and the request table
        self._step_lock = threading.Lock()       # held while a step (or an inbox drain) runs
        self._tokenizer_lock = threading.Lock()  # HF fast tokenizers dislike concurrent use
        self.startup_log = self._startup_lines(context_len)
        if log_stats:
            for line in self.startup_log:
                logger.info(line)

    # ---------------------------------------------------------------- set-up
    def _blocks_for_memory(self, kv_bytes: int) -> int:
        from .memory import num_blocks_for_bytes
        blocks = num_blocks_for_bytes(kv_bytes, self.config, self.model.dtype, self.block_size)
        if blocks < 1:
            from ..errors import OutOfMemoryError
            raise OutOfMemoryError(f"kv_cache_memory={kv_bytes} bytes holds not one block of {self.block_size} tokens")
        return blocks

    def _launch_tensor_parallel(self, size: int, stages: int, num_kv_blocks: int | None) -> None:
        """Split the model over ``size`` × ``stages`` ranks; this process is rank 0 and keeps the scheduler.

        The one C decode step (all layers in one call) has no place for the all-reduces, and
        ranks timing products against each other on shared cores would measure nothing, so a
        split model runs the plain products unless ``cpu_linear`` names a path.
        """
        from ..distributed.group import ParallelGroup
        if num_kv_blocks is None:
            raise ConfigError("a parallel engine on a GPU needs num_kv_blocks or kv_cache_memory "
                              "(the pool is not profiled across ranks)")
        self._full_weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.parallel, self.model = ParallelGroup.launch(self.model, size, num_kv_blocks, self.block_size,
                                                               stages=stages)
        self.parallel.shutdown_with(self)

    def shutdown(self) -> None:
        """End the tensor-parallel workers (if any); the engine cannot step afterwards. Idempotent."""
        if self.parallel is not None:
            self.parallel.shutdown()

    def _startup_lines(self, context_len: int) -> list[str]:
        from .memory import format_bytes
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        packed = getattr(self.runner, "prepacked_bytes", 0)
        kv = self.runner.kv_cache.nbytes
        tokens = self.num_kv_blocks * self.block_size
        lines = [
            f"model {getattr(self.model, 'source', self.model_name)}",
            f"{self.model.dtype} on {self.model.device}"
            + (f" ({self.model.dtype_reason})" if getattr(self.model, "dtype_reason", "") else "")
            + f"; weights take {format_bytes(weights)}"
            + (f" (+ {format_bytes(packed)} prepacked for oneDNN)" if packed else "")
            + ("; in 2 MiB pages" if getattr(self.runner, "huge_page_bytes", 0) else ""),
            f"KV cache: {format_bytes(kv)} = {self.num_kv_blocks} blocks × {self.block_size} tokens "
            f"= {tokens} tokens ({format_bytes(kv / max(tokens, 1))} per token)",
            f"maximum concurrency for {self.config.max_position_embeddings} tokens per request: "
            f"{tokens / self.config.max_position_embeddings:.2f}x",
            f"scheduler: up to {self.scheduler.max_num_seqs} sequences and {self.scheduler.max_num_batched_tokens} "
            f"tokens per step; requests up to {self.max_model_len} tokens; prefix caching "
            f"{'on' if self.block_manager.enable_prefix_caching else 'off'}",
        ]
        if self.runner.linear_choice is not None:
            lines += self.runner.linear_choice.describe()
        rows = getattr(self.runner, "cpu_decode_rows", 0)
        if rows:
            lines.append(f"decode steps of {'1' if rows == 1 else f'1-{rows}'} rows: all layers in one C call "
                         "(model/cpu_decode.c), where rowwise products were chosen")
        if getattr(self.runner, "decode_attention_reason", ""):
            how = "in C, from the pool" if self.runner.decode_attention_in_c else "gather + SDPA (torch)"
            lines.append(f"decode attention: {how} ({self.runner.decode_attention_reason})")
        if self.parallel is not None:
            lines += self.parallel.describe(self.model, self._full_weight_bytes)
        if getattr(self.model, "is_random", False):
            lines.append("NOTE: random weights - generated text is meaningless (speed and memory work only)")
        return lines

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
            raise InvalidRequestError(f"sampling_params must be a SamplingParams, got {type(params).__name__}",
                                      param="sampling_params", index=index)
        try:
            params.validate()
        except InvalidRequestError as exc:
            raise InvalidRequestError(str(exc), param=exc.param, index=index) from None
        if not isinstance(prompt, (str, list, tuple, dict)):
            raise InvalidRequestError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}",
                                      param="prompt", index=index)
        text, ids = self.tokenize(prompt)
        if not ids:
            raise InvalidRequestError("the prompt is empty", param="prompt", index=index)
        vocab = self.config.vocab_size
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise InvalidRequestError(f"token id {t!r} is outside the vocabulary [0, {vocab})", param="prompt", index=index)
        probe = Sequence("probe", ids, params)
        try:
            self.scheduler.check_fits(probe)
        except InvalidRequestError as exc:
            raise type(exc)(str(exc), param=exc.param, index=index) from None
        return text, ids

    def add_request(self, request_id: str, prompt, sampling_params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> None:
        """Queue a request (text, token ids, or ``{"prompt_token_ids": [...]}``); safe from any thread."""
        params = sampling_params if sampling_params is not None else SamplingParams()
        text, ids = self.validate(prompt, params)
        arrival = self.clock() if arrival_time is None else arrival_time
        request_id = str(request_id)
        completions = []
        for i in range(params.n):
            # each answer samples on its own stream: seed, seed + 1, ... (None stays None)
            child = replace(params, n=1, seed=None if params.seed is None else params.seed + i)
            seq_id = request_id if params.n == 1 else f"{request_id}/{i}"
            seq = Sequence(seq_id, ids, child, prompt=text, arrival_time=arrival)
            completions.append(_Completion(i, seq, IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens),
                                           logprobs=[] if params.logprobs is not None else None,
                                           cumulative_logprob=0.0 if params.logprobs is not None else None))
        request = _Request(request_id, text, ids, params, RequestMetrics(arrival_time=arrival, num_prompt_tokens=len(ids)),
                           completions, pending=completions[1:])
        with self._lock:
            if request_id in self.requests:
                raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
            if self.max_waiting is not None:
                queued = len(self.scheduler.waiting) + sum(1 for kind, _ in self._inbox if kind == "add")
                if queued >= self.max_waiting:
                    raise QueueFullError(f"the waiting queue is full ({self.max_waiting} requests): retry later")
            self.requests[request_id] = request
            for c in completions:
                self._owner[c.seq.seq_id] = (request, c)
            self._inbox.append(("add", request))

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
            return bool(self._inbox or self._pending_outputs) or self.scheduler.has_unfinished()

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
            if request is None or request.finished:
                continue                               # unknown or already done: nothing to stop
            for c in request.completions:
                if c.finished:
                    continue
                if any(c is p for p in request.pending):    # never handed to the scheduler: holds no block
                    c.seq.status, c.seq.finish_reason = SequenceStatus.FINISHED, "abort"
                else:
                    self.scheduler.finish(c.seq, "abort")   # its blocks go back now
            request.pending.clear()
            request.metrics.finished_time = self.clock()
            self._pending_outputs.append(self._make_output(request))
            self._forget(request)

    def _forget(self, request: _Request) -> None:
        with self._lock:
            self.requests.pop(request.request_id, None)
            for c in request.completions:
                self._owner.pop(c.seq.seq_id, None)

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, and return the requests that changed (new tokens or finished)."""
        with self._step_lock:
            self._drain_inbox()
            outputs, self._pending_outputs = self._pending_outputs, []
            record = self.scheduler.schedule()
            if record.is_empty:
                return outputs
            record.start_time = self.clock()
            for seq in record.seqs:
                request, _ = self._owner[seq.seq_id]
                metrics = request.metrics
                if metrics.first_scheduled_time is None:
                    metrics.first_scheduled_time = record.start_time
                    metrics.num_cached_tokens = seq.num_cached_tokens
                metrics.num_preemptions = sum(c.seq.num_preemptions for c in request.completions)
            sampled = self.runner.execute(record.seqs, record.num_scheduled_tokens)
            logprob_rows = getattr(self.runner, "last_logprobs", None) or [None] * len(record.seqs)
            now = record.end_time = self.clock()
            entries = {seq.seq_id: lp for seq, lp in zip(record.seqs, logprob_rows)}
            changed: dict[str, _Request] = {}
            for seq in self.scheduler.update(record, sampled):
                request, completion = self._owner[seq.seq_id]
                self._on_token(request, completion, seq.output_token_ids[-1], entries.get(seq.seq_id), now)
                if completion.finished:
                    record.finished.append(seq.request_id)
                if request.pending and completion.index == 0:
                    # n > 1: the prompt's full blocks are cached now, so the other answers share them
                    for sibling in reversed(request.pending):
                        self.scheduler.add(sibling.seq, front=True)
                    request.pending.clear()
                changed[request.request_id] = request
            for request in changed.values():
                outputs.append(self._make_output(request))
                if request.finished:
                    self._forget(request)
            self.step_records.append(record)
            if self.check_invariants:
                self.block_manager.check_invariants(self.scheduler.seqs)
            return outputs

    def _on_token(self, request: _Request, completion: _Completion, token: int, logprob_entry, now: float) -> None:
        seq, params, metrics = completion.seq, completion.seq.sampling_params, request.metrics
        metrics.token_times.append(now)
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        completion.new_token_ids.append(token)
        if completion.logprobs is not None:
            chosen, top = _unpack_logprobs(logprob_entry)
            completion.logprobs.append(dict(top or {}) | ({token: chosen} if chosen is not None else {}))
            if chosen is not None:
                completion.cumulative_logprob += chosen
        with self._tokenizer_lock:
            completion.detokenizer.add(token)
        reason, stop_reason = None, None
        if len(seq.output_token_ids) >= (params.max_tokens or self.max_model_len) or len(seq) >= self.max_model_len:
            reason = "length"
        elif not params.ignore_eos and token in self.eos_token_ids:
            reason, stop_reason = "stop", None
        elif token in params.stop_token_ids:
            reason, stop_reason = "stop", token
        text = completion.detokenizer.text
        for stop in params.stop:
            at = text.find(stop, max(0, len(completion.text) - len(stop) + 1))
            if at != -1:
                text, reason, stop_reason = text[:at], "stop", stop
                break
        completion.text = text
        if reason is not None:
            seq.stop_reason = stop_reason
            self.scheduler.finish(seq, reason)
            if request.finished:
                metrics.finished_time = now

    def _make_output(self, request: _Request) -> RequestOutput:
        """A snapshot: cumulative text and ids of every answer, plus what changed since the last snapshot."""
        completions = []
        for c in request.completions:
            seq = c.seq
            visible = len(c.text)
            if not c.finished and request.params.stop:   # hold back what could be the start of a stop string
                visible = max(c.emitted_text_len, len(c.text) - max(map(len, request.params.stop)) + 1)
            new_text = c.text[c.emitted_text_len:visible]
            c.emitted_text_len = visible
            new_ids, c.new_token_ids = c.new_token_ids, []
            completions.append(CompletionOutput(
                index=c.index, text=c.text[:visible], token_ids=list(seq.output_token_ids),
                finish_reason=seq.finish_reason if c.finished else None, stop_reason=seq.stop_reason,
                logprobs=list(c.logprobs) if c.logprobs is not None else None,
                cumulative_logprob=c.cumulative_logprob, new_token_ids=new_ids, new_text=new_text))
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, completions,
                             request.finished, request.metrics,
                             num_cached_tokens=request.completions[0].seq.num_cached_tokens,
                             random_weights=getattr(self.model, "is_random", False))

    # ---------------------------------------------------------------- looking inside
    @property
    def stats(self) -> dict:
        """Numbers for a /metrics page: queue lengths, blocks, prefix-cache hits, preemptions."""
        bm = self.block_manager
        return dict(num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
                    num_kv_blocks=bm.num_blocks, num_used_blocks=bm.num_used_blocks, num_free_blocks=bm.num_free_blocks,
                    kv_cache_usage=bm.num_used_blocks / bm.num_blocks, prefix_cache_hit_rate=bm.stats["hit_rate"],
                    num_preemptions=self.scheduler.num_preemptions, num_steps=self.scheduler.num_steps)

    def format_trace(self, records=None, fold_quiet: bool = False) -> str:
        """The step-by-step schedule: who ran, how many tokens, which blocks (``scheduler.format_steps``)."""
        return format_steps(self.step_records if records is None else records, fold_quiet)

    @torch.no_grad()
    def run_until_done(self) -> list[RequestOutput]:
        """Step until every request finished; the final output of each, in finishing order."""
        done = []
        while self.has_unfinished_requests():
            done.extend(o for o in self.step() if o.finished)
        return done

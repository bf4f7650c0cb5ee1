"""``Sequence``: one request's tokens and where the engine is with it.

The scheduler moves it WAITING → RUNNING → FINISHED (and RUNNING → WAITING when preempted);
the block manager fills its ``block_table``; the model runner reads ``token_ids``,
``num_computed_tokens`` and ``block_table`` to build a step.

With speculative decoding a decoding sequence may also carry ``spec_token_ids``: the drafter's
guesses of its next tokens, not yet part of ``token_ids``. A verify step computes
``[last token] + spec_token_ids``; the tokens the model agrees with then join ``output_token_ids``
and the rest are dropped (``scheduler.py``).

With async scheduling (``async_scheduling.py``) the next step is scheduled while this one runs, so a
sequence in the running step already counts that step's rows as computed and holds a *placeholder*
(``PLACEHOLDER``) at the end of ``output_token_ids`` for the token it has not sampled yet: the next
step is built around it, and the sampled token takes its place before that step starts.
"""

from __future__ import annotations

import enum
import itertools

from .sampler import make_generator
from .sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_counter = itertools.count()
PLACEHOLDER = -1  # a token the step in flight has not sampled yet (async scheduling); never a vocabulary id


class Sequence:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        prompt: str | None = None,
        arrival_time: float | None = None,
    ):
        self.request_id = request_id
        self.seq_id = next(_counter)
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)  # never changes after this
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.sampling_params = sampling_params
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.block_table: list[int] = []  # physical block ids, in order
        self.block_table_changed_from = 0  # the first entry rewritten or dropped since the runner read the table
        self.block_table_version = 0  # + 1 each time blocks are given back (a rollback, a preemption, the end)
        self.traced_block_table: tuple = (None, [])  # the step trace's copy and the version and length it copied
        self.arrival_time = arrival_time
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache at first admission
        self.num_preemptions = 0  # times evicted (blocks freed) and recomputed
        self.spec_token_ids: list[int] = []  # draft tokens to verify next (speculative decoding)
        self.spec_probs = None  # the drafter's q for each draft token [k, V] (None: one-hot, n-gram)
        self.spec_stats = None  # its request's speculation counters (SpecDecodeStats): its own acceptance
        self.group: int | None = None  # its micro-batch group with pipeline overlap (the scheduler's), else None
        self.grammar = None  # its structured output's matcher (structured_output.GrammarState), if it has one
        self.generator = None  # its own random stream, made on its first draw (``random_stream``)
        self.num_placeholders = 0  # tokens in flight at the end of output_token_ids (async scheduling: 0 or 1)
        # prompt_logprobs asked: entry i scores prompt token i + 1 (token 0 has nothing before it), filled as
        # prefill chunks run (``prompt_logprobs.py``); rows already scored are not scored again after a preemption
        self.prompt_logprobs: list[dict[int, float]] | None = None if sampling_params.prompt_logprobs is None else []

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def __len__(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def tokens_in(self, start: int, stop: int) -> list[int]:
        """Tokens ``start:stop`` of the prompt, then the output, then the drafts, copying only those: a
        step reads its few rows of a long sequence without copying the whole (``token_ids`` would)."""
        found = []
        for part in (self.prompt_token_ids, self.output_token_ids, self.spec_token_ids):
            if start < len(part) and stop > 0:
                found += part[max(start, 0) : stop]
            start, stop = start - len(part), stop - len(part)
        return found

    @property
    def last_token(self) -> int:
        """The newest token: a decode step's input."""
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    def expect_token(self) -> None:
        """The step just started will sample this sequence's next token: hold its place."""
        self.output_token_ids.append(PLACEHOLDER)
        self.num_placeholders += 1

    def drop_placeholders(self) -> None:
        """Forget the tokens in flight (they were sampled, or the sequence left the step's future)."""
        if self.num_placeholders:
            del self.output_token_ids[-self.num_placeholders :]
            self.num_placeholders = 0

    @property
    def sampled_token_ids(self) -> list[int]:
        """The output tokens actually sampled: ``output_token_ids`` without the placeholders (copied only
        when there are some: what penalties and ``min_tokens`` read while a step is in flight)."""
        if not self.num_placeholders:
            return self.output_token_ids
        return self.output_token_ids[: -self.num_placeholders]

    def set_spec(self, token_ids: list[int], probs=None) -> None:
        """Replace the drafts (and their q rows); ``[]`` clears them."""
        self.spec_token_ids = list(token_ids)
        self.spec_probs = probs[: len(token_ids)] if probs is not None and token_ids else None

    def random_stream(self, device):
        """This answer's own ``torch.Generator``, made from its seed on first use (None without a seed):
        its draws then depend only on its seed and how many it has drawn, not on who shares the batch."""
        if self.generator is None and self.sampling_params.seed is not None:
            self.generator = make_generator(self.sampling_params.seed, device)
        return self.generator

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, {self.status.value}, {len(self)} tokens, "
            f"{self.num_computed_tokens} computed, blocks {self.block_table})"
        )

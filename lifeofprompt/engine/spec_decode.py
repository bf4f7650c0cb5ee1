"""``SpecDecoder``: the engine's speculative side, in one place: its drafter, its counters, its memory share.

``LLMEngine`` owns one when ``speculative_config`` is given and calls it at three points of a step:

* ``propose`` at the end of a step: drafts (n-gram) or draft slots (a draft model) for every running
  request that is decoding, at most what its ``max_tokens`` and context still allow; on the CPU,
  prompt lookup's drafts are then cut to those whose expected tokens pay for their rows
  (``drafts_worth_their_rows``);
* ``fill`` after scheduling: a draft model drafts into the slots the scheduler just gave;
* ``observe`` after the verify: the counts (engine-wide and per request) and the step's record.

The verify itself is the step's sampling (``step_output.sample_step``) and the rollback the scheduler's.
"""

from __future__ import annotations

from .outputs import SpecStep
from .speculative import NgramProposer, SpecDecodeStats, SpeculativeConfig


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, model, tokenizer, block_size: int, kv_cache_dtype: str = "auto"):
        self.config = config
        self.block_size, self.kv_cache_dtype = block_size, kv_cache_dtype
        self.stats = SpecDecodeStats(config.k)
        self.draft_model = None
        self.proposer = None
        # Rows a step may hold with its drafts (0: no cap). On the CPU, the C step's measured row
        # limit: past it a step leaves the one-call path for the eager forward, and a verify then
        # costs more than its accepted drafts save (at batch 8 on the AMD EPYC this was written on,
        # prompt lookup ran 0.79-0.91x plain decoding). Set by ``attach``.
        self.row_budget = 0
        # Seconds of a whole step by its rows, where the runner measured them (the CPU's C step):
        # the price of a draft's row, against the tokens it is expected to bring. Set by ``attach``.
        self.step_seconds: dict[int, float] | None = None
        if config.method == "draft_model":
            from .draft_model import load_draft

            self.draft_model = load_draft(config, model, tokenizer)
        else:
            self.proposer = NgramProposer(config)

    @classmethod
    def start(cls, engine_config, model, tokenizer) -> SpecDecoder | None:
        """The engine's drafter for ``speculative_config`` (a draft model loads here), or None without one."""
        config = SpeculativeConfig.from_user(engine_config.speculative_config)
        if config is None:
            return None
        return cls(config, model, tokenizer, engine_config.block_size, engine_config.kv_cache_dtype)

    def draft_bytes_per_block(self) -> int:
        """KV bytes the draft adds to every block (its pool shares the target's block tables)."""
        if self.draft_model is None:
            return 0
        from .memory import kv_bytes_per_block

        model = self.draft_model
        return kv_bytes_per_block(model.config, model.dtype, self.block_size, self.kv_cache_dtype)

    def attach(self, runner) -> None:
        """Cap the drafts at the runner's one-call step (``row_budget``); give a draft model its pool (as many
        blocks as the target's) and its speed-ups, and hook its mirror into the runner. A draft must reach every
        position the engine may: its rotary table ends at its own context."""
        speedups, resolved = runner.speedups, runner.resolved
        self.row_budget = speedups.c_step_rows
        if self.draft_model is None:
            self.step_seconds = speedups.step_seconds or None
            return
        from ..errors import SpeculativeConfigError
        from .draft_model import DraftModelProposer

        if self.draft_model.config.max_position_embeddings < resolved.max_model_len:
            raise SpeculativeConfigError(
                f"the draft's context is {self.draft_model.config.max_position_embeddings} tokens, the engine's "
                f"{resolved.max_model_len}: give max_model_len <= the draft's",
                param="model",
            )
        self.proposer = DraftModelProposer(
            self.config, self.draft_model, resolved, speedups.for_draft(self.draft_model)
        )
        runner.draft = self.proposer

    def new_request_stats(self) -> SpecDecodeStats:
        return SpecDecodeStats(self.config.k)

    # ---------------------------------------------------------------- the step
    def propose(self, running, max_num_drafts, clock) -> None:
        """Drafts for the next step, for each running request that is decoding (its prompt done)."""
        start = clock()
        decoding = [seq for seq in running if seq.num_computed_tokens == len(seq) - 1]
        spare_rows = self.row_budget - len(decoding) if self.row_budget else None  # rows left for drafts
        for seq in decoding:
            limit = max_num_drafts(seq) if may_speculate(seq.sampling_params) else 0
            if spare_rows is not None:
                limit = min(limit, spare_rows)
            if limit <= 0:
                seq.set_spec([])
            elif hasattr(self.proposer, "placeholders"):  # a draft model drafts after scheduling
                seq.set_spec(self.proposer.placeholders(seq, limit))
            else:
                draft = self.proposer.propose(seq.token_ids, limit)
                if seq.grammar is not None and draft:  # drafts the grammar refuses could never be kept
                    draft = draft[: seq.grammar.valid_prefix(draft)]
                seq.set_spec(draft)
            if spare_rows is not None:
                spare_rows -= len(seq.spec_token_ids)
        if self.step_seconds:
            drafts_worth_their_rows(decoding, self.step_seconds)
        self.stats.draft_time += clock() - start

    def fill(self, seqs, clock) -> None:
        """A draft model's k' passes for the scheduled verifies (nothing to do for prompt lookup)."""
        verifying = [seq for seq in seqs if seq.spec_token_ids]
        if verifying and hasattr(self.proposer, "fill"):
            start = clock()
            self.proposer.fill(verifying)
            self.stats.draft_time += clock() - start

    def observe(self, metrics, position: int, draft: list[int], tokens: list[int]) -> int:
        """Count one verify (engine-wide and in the request's metrics) and keep its record; return drafts kept."""
        accepted = len(tokens) - 1
        self.stats.observe(len(draft), accepted)
        metrics.spec_decode.observe(len(draft), accepted)
        metrics.spec_steps.append(SpecStep(position, draft, accepted, list(tokens)))
        return accepted

    # ---------------------------------------------------------------- looking inside
    def startup_lines(self, target_kv_bytes: int, num_blocks: int) -> list[str]:
        from ..units import format_bytes

        lines = [self.config.describe() + "; verify steps run eagerly (no CUDA graph)"]
        if self.row_budget:
            lines.append(
                f"drafts are cut so a step holds at most {self.row_budget} rows, the one-call C step's "
                "measured limit: beyond it a verify would leave that path and cost more than it saves"
            )
        if self.step_seconds:
            lines.append(
                "drafts kept only where their expected tokens (each request's own acceptance so far) pay "
                "for their rows, priced by the C step's measured time per row count"
            )
        if self.draft_model is not None:
            draft_kv = self.proposer.kv_cache.nbytes
            name = getattr(self.draft_model, "source", self.draft_model.config.name)
            lines.append(
                f"draft model {name}: {self.draft_model.config.num_layers} layers; its KV cache "
                f"{format_bytes(draft_kv)} on the same {num_blocks} block tables (memory split by bytes per "
                f"block: {format_bytes(target_kv_bytes)} target, {format_bytes(draft_kv)} draft); "
                "every step runs eagerly"
            )
        return lines


def step_time(rows: int, step_seconds: dict[int, float]) -> float:
    """A step's seconds at ``rows``, read off the measured counts: flat below the first, linear between
    two, and on the last two's slope above the last (in proportion to the rows with one count)."""
    counts = sorted(step_seconds)
    if rows <= counts[0]:
        return step_seconds[counts[0]]
    if len(counts) == 1:
        return step_seconds[counts[0]] * rows / counts[0]
    high = next((n for n in counts if n > rows), counts[-1])
    low = counts[counts.index(high) - 1]
    slope = (step_seconds[high] - step_seconds[low]) / (high - low)
    return step_seconds[low] + slope * (rows - low)


def acceptance_estimate(seq) -> float:
    """A request's per-token acceptance α so far (accepted over reached draft positions, its
    ``SpecDecodeStats``), with one accepted and one rejected trial added: a new request starts at 1/2
    and moves with its own verifies."""
    stats = seq.spec_stats
    accepted, reached = (stats.num_accepted_tokens, sum(stats.num_reached_per_pos)) if stats is not None else (0, 0)
    return (accepted + 1) / (reached + 2)


def drafts_worth_their_rows(decoding, step_seconds: dict[int, float]) -> int:
    """Cut the drafts of this step's decoding sequences to the number that maximises expected tokens per second.

    A draft token at position i of a request that accepts with rate α brings α^(i+1) tokens on
    average (``lessons/speculation.py``) and costs one more row of the step. While the step is
    memory-bound a row is nearly free; once it is compute-bound (a batch of 8, say) each row costs
    its share, and a draft that is rarely accepted slows the batch (on open text at batch 8
    prompt lookup ran 0.89x plain decoding before this cut). So the candidates are ranked by
    expected gain, and the first N are kept for the N with the most ``(rows + gain) / step_time``;
    N = 0, plain decoding, is among the choices. Returns the drafts kept.
    """
    rows = len(decoding)
    candidates = sorted(
        (
            (acceptance_estimate(seq) ** (i + 1), index, i)
            for index, seq in enumerate(decoding)
            for i in range(len(seq.spec_token_ids))
        ),
        key=lambda c: (-c[0], c[2]),
    )
    if not candidates:
        return 0
    best_n, best_rate, gain = 0, rows / step_time(rows, step_seconds), 0.0
    for n, (expected, _, _) in enumerate(candidates, start=1):
        gain += expected
        rate = (rows + gain) / step_time(rows + n, step_seconds)
        if rate > best_rate:
            best_n, best_rate = n, rate
    keep = [0] * rows
    for _, index, i in candidates[:best_n]:
        keep[index] = max(keep[index], i + 1)
    for seq, n in zip(decoding, keep):
        if n < len(seq.spec_token_ids):
            seq.set_spec(seq.spec_token_ids[:n], seq.spec_probs)
    return best_n


def may_speculate(params) -> bool:
    """Whether a request's verify can be judged by the rejection rule.

    Penalties, min_tokens and logit_bias change the target's distribution token by token, depending
    on the tokens before; the verify applies none of them, so such a request decodes one token per
    step (correct, just not sped up). A grammar does speculate: each verify row is masked with the
    grammar's state after the drafts before it (``rejection_sampler.verify_with_grammar``).
    """
    return not params.needs_history

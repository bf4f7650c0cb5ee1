"""The paged KV cache at work (chapter 07): a traced generation loop, fragmentation arithmetic, prefix sharing.

``trace_paged_generation`` runs the real model through ``ModelRunner`` over blocks handed out by
``BlockManager`` and records the pool after every step: which sequence owns each block, how many
of its slots are filled, which blocks are cached or shared. It is a deliberately small loop
(every request admitted when it arrives, no preemption, no token budget): the scheduler of
chapter 08 does that job properly; this loop exists to *watch* blocks move.

``fragmentation_table`` compares a contiguous reservation of ``max_len`` slots per request (the
cache of chapter 04) with paging, for a list of real request lengths: slots wasted, and how many
requests fit in the same pool, across block sizes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..engine.block_manager import BlockManager
from ..engine.sampling_params import SamplingParams
from ..engine.sequence import Sequence
from ..errors import OutOfMemoryError


@dataclass
class PoolSnapshot:
    """The pool after one step (or at one event)."""

    step: int
    events: list[str]
    block_tables: dict[str, list[int]]  # live sequences' tables, by name
    num_tokens: dict[str, int]  # tokens each live sequence has in the cache
    owners: list[list[str]]  # per physical block: names of the sequences holding it
    filled: list[int]  # per block: slots holding a computed token
    cached: list[bool]  # per block: registered in the prefix cache (findable)
    num_free_blocks: int
    block_size: int

    @property
    def num_blocks(self) -> int:
        return len(self.owners)

    def table_lines(self, width: int | None = None) -> list[str]:
        """One line per live sequence: its name, tokens cached and block table; names padded to ``width``
        (default: the longest here; pass the longest of several snapshots to align them all)."""
        width = width or max((len(n) for n in self.block_tables), default=0)
        return [
            f"{name:<{width}}  {self.num_tokens[name]:>3} tokens  blocks {table}"
            for name, table in self.block_tables.items()
        ]


def snapshot(bm: BlockManager, seqs: dict[str, Sequence], step: int, events: list[str]) -> PoolSnapshot:
    """Read the pool's state out of the block manager and the live sequences."""
    owners: list[list[str]] = [[] for _ in range(bm.num_blocks)]
    filled = [0] * bm.num_blocks
    for name, seq in seqs.items():
        for i, block_id in enumerate(seq.block_table):
            owners[block_id].append(name)
            in_block = min(bm.block_size, max(0, seq.num_computed_tokens - i * bm.block_size))
            filled[block_id] = max(filled[block_id], in_block)
    cached = [b.hash is not None for b in bm.blocks]
    for block in bm.blocks:  # a free cached block still holds its tokens
        if block.hash is not None and block.ref_count == 0:
            filled[block.block_id] = bm.block_size
    return PoolSnapshot(
        step,
        list(events),
        {n: list(s.block_table) for n, s in seqs.items()},
        {n: s.num_computed_tokens for n, s in seqs.items()},
        owners,
        filled,
        cached,
        bm.num_free_blocks,
        bm.block_size,
    )


@dataclass
class PagedTrace:
    outputs: dict[str, list[int]]  # new token ids per request (greedy, EOS ignored)
    snapshots: list[PoolSnapshot]
    stats: dict  # the block manager's counters at the end
    computed_tokens: dict[str, int] = field(default_factory=dict)  # tokens each request ran through the model
    prompt_tokens: dict[str, int] = field(default_factory=dict)


def trace_paged_generation(
    model,
    prompts: dict[str, list[int]],
    max_tokens: int | dict[str, int],
    *,
    num_blocks: int = 24,
    block_size: int = 16,
    arrivals: dict[str, int] | None = None,
    chunk_size: int | None = None,
    enable_prefix_caching: bool = True,
    block_manager: BlockManager | None = None,
    runner=None,
) -> PagedTrace:
    """Greedy generation of ``prompts`` over a paged pool, with a snapshot of the pool after every step.

    ``prompts`` maps a display name to token ids; ``max_tokens`` (one number or per name) is how
    many new tokens each makes. A request joins at its ``arrivals`` step (default 0), claims any
    cached prefix, and from then on runs every step: its prompt in ``chunk_size`` pieces (default:
    whole), then one decode token a step. It leaves, and its blocks go back, the step it has its
    last token. Raises ``OutOfMemoryError`` if the pool runs dry (no preemption here).
    """
    from ..engine.model_runner import ModelRunner

    limits = max_tokens if isinstance(max_tokens, dict) else {name: max_tokens for name in prompts}
    arrivals = arrivals or {}
    bm = block_manager or BlockManager(num_blocks, block_size, enable_prefix_caching)
    runner = runner or ModelRunner.for_model(
        model, num_kv_blocks=bm.num_blocks, block_size=bm.block_size, attention_backend="torch"
    )
    greedy = SamplingParams(temperature=0, ignore_eos=True, max_tokens=max(limits.values()))
    waiting = {name: Sequence(name, ids, greedy) for name, ids in prompts.items()}
    live: dict[str, Sequence] = {}
    trace = PagedTrace(
        {name: [] for name in prompts},
        [snapshot(bm, live, 0, ["empty pool"])],
        {},
        {name: 0 for name in prompts},
        {name: len(ids) for name, ids in prompts.items()},
    )
    step = 0
    while waiting or live:
        events = []
        for name in [n for n in waiting if arrivals.get(n, 0) <= step]:
            seq = live[name] = waiting.pop(name)
            seq.num_computed_tokens = bm.claim_cached_prefix(seq)
            if seq.num_computed_tokens:
                events.append(f"{name} finds {seq.num_computed_tokens} tokens cached in blocks {seq.block_table}")
        batch, counts = [], []
        for name, seq in live.items():
            remaining = len(seq) - seq.num_computed_tokens
            n = min(remaining, chunk_size or remaining)
            before = len(seq.block_table)
            if not bm.allocate_slots(seq, n):
                raise OutOfMemoryError(f"the pool of {bm.num_blocks} blocks ran out at step {step} ({name} needs more)")
            if len(seq.block_table) > before:
                events.append(
                    f"{name} takes block{'s' if len(seq.block_table) - before > 1 else ''} "
                    f"{seq.block_table[before:]} for "
                    f"{'its prompt' if seq.num_computed_tokens < seq.num_prompt_tokens else 'token ' + str(len(seq))}"
                )
            batch.append(seq)
            counts.append(n)
        if batch:
            sampled = runner.execute(batch, counts).tokens
            for seq, n, token in zip(batch, counts, sampled):
                seq.num_computed_tokens += n
                trace.computed_tokens[seq.request_id] += n
                bm.cache_full_blocks(seq)
                if token is not None:
                    seq.output_token_ids.append(token)
        step += 1
        trace.snapshots.append(snapshot(bm, live, step, events))
        done = [name for name, seq in live.items() if len(seq.output_token_ids) >= limits[name]]
        if done:
            freed = []
            for name in done:
                seq = live.pop(name)
                freed.append(f"{name} finishes: blocks {seq.block_table} back to the free queue")
                trace.outputs[name] = list(seq.output_token_ids)
                bm.free(seq)
            trace.snapshots.append(snapshot(bm, live, step, freed))
    trace.stats = bm.stats
    return trace


# ----------------------------------------------------------------------------- fragmentation


def slots_wasted_contiguous(lengths: list[int], max_len: int) -> int:
    """A contiguous cache reserves ``max_len`` slots per request, whatever it ends up using."""
    return sum(max_len - n for n in lengths)


def slots_wasted_paged(lengths: list[int], block_size: int) -> int:
    """Paging wastes only the empty tail of each request's last block (< ``block_size`` per request)."""
    return sum(math.ceil(n / block_size) * block_size - n for n in lengths)


def requests_that_fit(lengths: list[int], pool_tokens: int, block_size: int | None, max_len: int | None = None) -> int:
    """How many of ``lengths`` (taken in order) are in the cache at once in a pool of ``pool_tokens`` slots.

    ``block_size=None`` is the contiguous cache: every request takes ``max_len`` slots.
    """
    used, count = 0, 0
    for n in lengths:
        need = max_len if block_size is None else math.ceil(n / block_size) * block_size
        if used + need > pool_tokens:
            break
        used += need
        count += 1
    return count


def fragmentation_table(
    lengths: list[int],
    max_len: int,
    pool_tokens: int,
    block_sizes=(1, 4, 8, 16, 32, 64, 128, 256),
    bytes_per_token: int | None = None,
) -> list[dict]:
    """Contiguous reservation against paging at several block sizes, for the requests ``lengths``.

    Each row: the layout, slots reserved and wasted for *all* requests (more than the pool
    holds, for the reservation), the wasted share, how many requests fit at once in
    ``pool_tokens`` slots, and the slots of the pool left empty once those requests are in
    (``pool_wasted``). ``wasted_bytes`` and ``pool_wasted_bytes`` come with ``bytes_per_token``.
    """
    if any(n > max_len for n in lengths):
        raise ValueError(f"a request is longer than max_len={max_len}")
    used = sum(lengths)
    rows = []
    layouts = [("contiguous", None)] + [(f"paged, block {b}", b) for b in block_sizes]
    for name, block_size in layouts:
        wasted = (
            slots_wasted_contiguous(lengths, max_len) if block_size is None else slots_wasted_paged(lengths, block_size)
        )
        fit = requests_that_fit(lengths, pool_tokens, block_size, max_len)
        held = lengths[:fit]
        pool_wasted = (
            slots_wasted_contiguous(held, max_len) if block_size is None else slots_wasted_paged(held, block_size)
        )
        row = dict(
            layout=name,
            block_size=block_size,
            reserved=used + wasted,
            wasted=wasted,
            wasted_share=wasted / (used + wasted),
            fit=fit,
            pool_wasted=pool_wasted,
        )
        if bytes_per_token is not None:
            row["wasted_bytes"] = wasted * bytes_per_token
            row["pool_wasted_bytes"] = pool_wasted * bytes_per_token
        rows.append(row)
    return rows


def format_fragmentation_table(rows: list[dict]) -> str:
    """The table as fixed-width text (exact integers and one-decimal percentages: stable for nbval).

    Two header lines say what each column counts: the first group all requests, the second the
    pool holding the requests that fit.
    """
    money = bool(rows) and "wasted_bytes" in rows[0]
    at_once, held = "all requests, as if held at once", "held in the pool"
    group = f"{'':<20}{at_once:^{44 if money else 36}}{held:^{22 if money else 14}}"
    head = f"{'layout':<20}{'reserved':>10}{'wasted':>9}{'waste %':>9}"
    head += f"{'MiB':>8}" if money else ""
    head += f"{'fit':>6}{'wasted':>8}" + (f"{'MiB':>8}" if money else "")
    lines = [group, head]
    for r in rows:
        line = f"{r['layout']:<20}{r['reserved']:>10}{r['wasted']:>9}{100 * r['wasted_share']:>8.1f}%"
        line += f"{r['wasted_bytes'] / 2**20:>8.1f}" if money else ""
        line += f"{r['fit']:>6}{r['pool_wasted']:>8}"
        line += f"{r['pool_wasted_bytes'] / 2**20:>8.1f}" if money else ""
        lines.append(line)
    return "\n".join(lines)


def request_lengths(num_requests: int, max_len: int, seed: int = 0, mean: int | None = None) -> list[int]:
    """A deterministic spread of final request lengths (prompt + output) up to ``max_len``.

    Real traffic is mostly short with a long tail: lengths are drawn from a geometric-like
    distribution with the given mean (default ``max_len // 4``), clipped to [1, max_len].
    """
    import random

    rng = random.Random(seed)
    mean = mean or max(1, max_len // 4)
    return [min(max_len, max(1, int(rng.expovariate(1 / mean)) + 1)) for _ in range(num_requests)]

"""``BlockManager``: hands out the blocks of the paged KV pool, and finds prompts it has seen before.

The pool is ``num_blocks`` blocks of ``block_size`` token slots (the ``PagedKVCache`` of
``model/attention.py`` holds the numbers; this file holds only the bookkeeping). Each sequence owns a
*block table*, the ordered physical block ids its tokens live in; token ``j`` of a sequence sits
in block ``block_table[j // block_size]`` at offset ``j % block_size``.

Allocation is incremental: ``allocate_slots(seq, n)`` grows a table by exactly the blocks its
next ``n`` tokens need (a whole prompt, a prefill chunk, or one decode token that starts a new
block) and changes nothing when the pool cannot give them. ``free(seq)`` gives every block back
the moment a sequence finishes, aborts or is preempted.

Prefix caching. A *full* block whose keys and values are computed is registered under a hash
chained over (parent block's hash, its token ids), so a block's hash names the whole prefix up
to its end. A new sequence walks its prompt block by block (``claim_cached_prefix``); every hit
is checked token by token, then shared: its reference count goes up and the sequence skips
computing those tokens. Shared blocks are never written: only full, computed blocks are
registered, and a sequence only ever writes into blocks it owns alone (a hit always ends on a
block boundary, so its new tokens start in a fresh block).

A freed block whose reference count falls to 0 joins the free queue but keeps its hash, so the
next request with the same prefix still finds it. The free queue is ordered by eviction
preference: blocks holding nothing reusable first, then cached blocks least recently freed first;
a cached block leaves the hash table only when the pool hands it to someone else.

At least one token must always be computed (there are no logits to sample otherwise): a prompt
that is entirely cached reuses all its full blocks but the last one, which is recomputed. vLLM
makes the same choice (it caps a hit at ``num_tokens - 1`` tokens, rounded down to whole blocks);
recomputing only the very last token would mean writing into a shared block.
"""

from __future__ import annotations

import hashlib
import math
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

from .config import EngineConfig


def hash_block(parent_hash: int | None, token_ids) -> int:
    """A 64-bit content hash of one full block, chained to the hash of the block before it."""
    data = (parent_hash if parent_hash is not None else 0).to_bytes(8, "little", signed=False)
    data += array("q", token_ids).tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None  # set while the block is registered in the prefix cache
    parent_hash: int | None = None  # checked on a hit, with the tokens
    token_ids: tuple[int, ...] = ()  # the tokens its K/V were computed for (cached blocks only)


@dataclass
class _SeqState:
    num_tokens: int = 0  # token slots its block table was sized for
    block_hashes: list[int] = field(default_factory=list)  # hashes of its leading full, computed blocks
    claim: tuple[int, int] = (0, 0)  # (hits, misses) its admission counted, undone if admission fails


class BlockManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = EngineConfig.enable_prefix_caching
    ):
        if num_blocks < 1 or block_size < 1:
            from ..errors import ConfigError

            raise ConfigError(
                f"num_blocks and block_size must be >= 1, got {num_blocks} and {block_size}", param="num_kv_blocks"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))  # head = next out
        self.hash_to_block: dict[int, int] = {}
        self._seqs: dict[int, _SeqState] = {}
        self.hits = 0  # full prompt blocks found in the cache at admission
        self.misses = 0  # full prompt blocks looked up and not found (they will be computed)
        self.saved_tokens = 0  # tokens whose K/V were reused instead of computed

    # ---------------------------------------------------------------- counts
    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody owns (some still hold a findable cached prefix; they go last)."""
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.hash_to_block)

    def blocks_needed(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    @property
    def stats(self) -> dict:
        lookups = self.hits + self.misses
        return dict(
            free=self.num_free_blocks,
            used=self.num_used_blocks,
            cached=self.num_cached_blocks,
            hits=self.hits,
            misses=self.misses,
            hit_rate=self.hits / lookups if lookups else 0.0,
            saved_tokens=self.saved_tokens,
        )

    def _state(self, seq) -> _SeqState:
        state = self._seqs.get(seq.seq_id)
        if state is None:
            state = self._seqs[seq.seq_id] = _SeqState(num_tokens=len(seq.block_table) * self.block_size)
        return state

    # ---------------------------------------------------------------- admission: the prefix cache
    def claim_cached_prefix(self, seq, lookup: bool = True) -> int:
        """Share the longest run of cached full blocks that starts ``seq``; return the tokens they cover.

        Call once, when the sequence is admitted (or re-admitted after preemption) with an empty
        block table; the caller sets ``seq.num_computed_tokens`` to the result. The result is a
        whole number of blocks and always leaves at least one token to compute. ``lookup=False``
        (a request that scores its prompt: every prompt row must be computed) claims nothing, but
        its blocks are still registered for others as they fill.
        """
        assert not seq.block_table and seq.num_computed_tokens == 0, "claim_cached_prefix wants a fresh sequence"
        state = self._seqs[seq.seq_id] = _SeqState()
        if not self.enable_prefix_caching or not lookup:
            return 0
        tokens = seq.prompt_token_ids if not seq.output_token_ids else seq.token_ids  # a fresh one: no copy
        eligible = (len(tokens) - 1) // self.block_size  # full blocks that still leave a token to compute
        parent = None
        for i in range(eligible):
            chunk = tuple(tokens[i * self.block_size : (i + 1) * self.block_size])
            h = hash_block(parent, chunk)
            block_id = self.hash_to_block.get(h)
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.token_ids != chunk or block.parent_hash != parent:
                break  # a hash collision: not our prefix
            if block.ref_count == 0:
                del self.free_queue[block_id]  # revived before the pool reused it
            block.ref_count += 1
            seq.block_table.append(block_id)
            state.block_hashes.append(h)
            parent = h
        found = len(seq.block_table)
        state.claim = (found, eligible - found)
        self.hits += found
        self.misses += eligible - found
        state.num_tokens = found * self.block_size
        self.saved_tokens += state.num_tokens
        return state.num_tokens

    def cancel_claim(self, seq) -> None:
        """Undo ``claim_cached_prefix`` when admission fails: blocks back, and its hits and misses uncounted."""
        state = self._seqs.get(seq.seq_id)
        if state is not None:
            hits, misses = state.claim
            self.hits -= hits
            self.misses -= misses
            self.saved_tokens -= hits * self.block_size
        self.free(seq)

    # ---------------------------------------------------------------- growing a block table
    def num_new_blocks(self, seq, num_new_tokens: int) -> int:
        """Blocks to add so the table holds ``num_computed_tokens + num_new_tokens`` tokens."""
        needed = self.blocks_needed(seq.num_computed_tokens + num_new_tokens)
        return max(0, needed - len(seq.block_table))

    def can_allocate(self, seq, num_new_tokens: int) -> bool:
        return self.num_new_blocks(seq, num_new_tokens) <= self.num_free_blocks

    def allocate_slots(self, seq, num_new_tokens: int) -> bool:
        """Grow ``seq.block_table`` for its next ``num_new_tokens`` tokens; False (no change) if the pool is short."""
        count = self.num_new_blocks(seq, num_new_tokens)
        if count > self.num_free_blocks:
            return False
        state = self._state(seq)
        for _ in range(count):
            seq.block_table.append(self._take_free_block())
        state.num_tokens = max(state.num_tokens, seq.num_computed_tokens + num_new_tokens)
        return True

    def _take_free_block(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:  # evict: its prefix is forgotten now
            if self.hash_to_block.get(block.hash) == block_id:
                del self.hash_to_block[block.hash]
            block.hash, block.parent_hash, block.token_ids = None, None, ()
        block.ref_count = 1
        return block_id

    # ---------------------------------------------------------------- after a step
    def cache_full_blocks(self, seq) -> None:
        """Register the blocks of ``seq`` that are full and computed (up to ``num_computed_tokens``).

        Never the partial last block. If another sequence registered the same prefix first (two
        requests with the same prompt admitted in one step), this copy stays private and uncached.
        """
        if not self.enable_prefix_caching:
            return
        state = self._state(seq)
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        if num_full <= len(state.block_hashes):
            return  # the usual decode step: no block filled up
        for i in range(len(state.block_hashes), num_full):
            parent = state.block_hashes[-1] if state.block_hashes else None
            chunk = tuple(seq.tokens_in(i * self.block_size, (i + 1) * self.block_size))
            h = hash_block(parent, chunk)
            state.block_hashes.append(h)
            block = self.blocks[seq.block_table[i]]
            if block.hash is None and h not in self.hash_to_block:
                block.hash, block.parent_hash, block.token_ids = h, parent, chunk
                self.hash_to_block[h] = block.block_id

    def trim(self, seq, num_tokens: int) -> int:
        """Shrink ``seq``'s table to the blocks its first ``num_tokens`` tokens need; return how many went back.

        Speculative decoding's rollback: a verify step got slots for every draft token, and the
        blocks that only rejected drafts reached return to the pool. They were written but never
        registered (``cache_full_blocks`` only sees verified tokens), so they go back as empty
        blocks, first in line to be reused.
        """
        state = self._state(seq)
        keep = self.blocks_needed(num_tokens)
        released = seq.block_table[keep:]
        for block_id in reversed(released):
            block = self.blocks[block_id]
            assert block.ref_count == 1 and block.hash is None, f"block {block_id} holds drafts but is shared or cached"
            block.ref_count = 0
            self.free_queue[block_id] = None
            self.free_queue.move_to_end(block_id, last=False)
        del seq.block_table[keep:]
        seq.block_table_changed_from = min(seq.block_table_changed_from, keep)
        seq.block_table_version += 1
        state.num_tokens = min(state.num_tokens, num_tokens)
        return len(released)

    # ---------------------------------------------------------------- finish, abort, preempt
    def free(self, seq) -> None:
        """Every block of ``seq`` back (reference count - 1); its table is emptied.

        Blocks reaching 0 go to the free queue: empty ones at the head (reused first), cached ones
        at the tail in reverse table order, so a prompt's last blocks are forgotten before its first.
        """
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed more often than it was taken"
            if block.ref_count == 0:
                self.free_queue[block_id] = None
                if block.hash is None:
                    self.free_queue.move_to_end(block_id, last=False)
        seq.block_table.clear()
        seq.block_table_changed_from = 0
        seq.block_table_version += 1
        self._seqs.pop(seq.seq_id, None)

    # ---------------------------------------------------------------- checks
    def check_invariants(self, seqs=()) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent; ``seqs`` = every sequence holding blocks."""
        used = [b for b in self.blocks if b.ref_count > 0]
        assert len(used) + len(self.free_queue) == self.num_blocks, "free + used != total"
        for block_id in self.free_queue:
            assert self.blocks[block_id].ref_count == 0, f"block {block_id} is free but referenced"
        for h, block_id in self.hash_to_block.items():
            block = self.blocks[block_id]
            assert block.hash == h and len(block.token_ids) == self.block_size, (
                f"cache entry of block {block_id} is stale"
            )
            assert hash_block(block.parent_hash, block.token_ids) == h, (
                f"block {block_id} hash does not match its tokens"
            )
        for block in self.blocks:
            assert block.hash is None or self.hash_to_block.get(block.hash) == block.block_id, (
                f"block {block.block_id} has a hash the cache does not know"
            )
        if not seqs:
            return
        owners: dict[int, list] = {}
        for seq in seqs:
            assert len(set(seq.block_table)) == len(seq.block_table), f"{seq.request_id} holds a block twice"
            state = self._seqs.get(seq.seq_id)
            if state is not None and seq.block_table:
                assert len(seq.block_table) == self.blocks_needed(state.num_tokens), (
                    f"{seq.request_id}: {len(seq.block_table)} blocks for {state.num_tokens} tokens"
                )
            assert len(seq.block_table) * self.block_size >= seq.num_computed_tokens, (
                f"{seq.request_id}: computed tokens outside its blocks"
            )
            for i, block_id in enumerate(seq.block_table):
                owners.setdefault(block_id, []).append((seq, i))
                block = self.blocks[block_id]
                if block.hash is not None:  # a cached block holds computed tokens of this sequence, never drafts
                    assert (i + 1) * self.block_size <= seq.num_computed_tokens <= len(seq), (
                        f"{seq.request_id}: cached block {block_id} holds tokens not (yet) computed"
                    )
                    assert tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size]) == block.token_ids, (
                        f"{seq.request_id}: cached block {block_id} holds other tokens than its own"
                    )
        for block_id, holders in owners.items():
            block = self.blocks[block_id]
            assert block.ref_count == len(holders), (
                f"block {block_id}: ref_count {block.ref_count}, {len(holders)} owners"
            )
            if len(holders) > 1:
                assert block.hash is not None, f"block {block_id} is shared but not a cached (read-only) block"
                for seq, i in holders:
                    assert (i + 1) * self.block_size <= seq.num_computed_tokens or (
                        seq.num_computed_tokens == 0 and not seq.block_table
                    ), f"{seq.request_id} shares block {block_id} but would still write into it"
                    assert tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size]) == block.token_ids, (
                        f"{seq.request_id} shares block {block_id} holding other tokens"
                    )
        assert sum(b.ref_count for b in self.blocks) == sum(len(h) for h in owners.values()), (
            "some blocks are referenced by sequences not given"
        )

    def __repr__(self) -> str:
        return (
            f"BlockManager({self.num_blocks} blocks × {self.block_size} tokens: {self.num_used_blocks} used, "
            f"{self.num_free_blocks} free, {self.num_cached_blocks} cached)"
        )

"""The block allocator and its prefix cache: pinned edge cases, then random operation sequences."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from hypothesis_counts import examples

from lifeofprompt.engine import block_manager as bm_module
from lifeofprompt.engine.block_manager import BlockManager
from lifeofprompt.engine.sampling_params import SamplingParams
from lifeofprompt.engine.sequence import Sequence

GREEDY = SamplingParams(temperature=0)


def make_seq(name, tokens):
    return Sequence(name, list(tokens), GREEDY)


def run_prompt(bm, seq):
    """Admit, allocate and 'compute' the whole prompt in one step, as a scheduler would."""
    seq.num_computed_tokens = bm.claim_cached_prefix(seq)
    assert bm.allocate_slots(seq, len(seq) - seq.num_computed_tokens)
    seq.num_computed_tokens = len(seq)
    bm.cache_full_blocks(seq)


def decode(bm, seq, token):
    """One decode step: the sampled token joins the sequence, gets a slot, then is computed."""
    seq.output_token_ids.append(token)
    assert bm.allocate_slots(seq, 1)
    seq.num_computed_tokens += 1
    bm.cache_full_blocks(seq)


# ---------------------------------------------------------------------- allocation
def test_allocation_grows_one_block_every_block_size_tokens():
    bm = BlockManager(num_blocks=10, block_size=16)
    seq = make_seq("hi", [6004, 957, 1462, 314])
    run_prompt(bm, seq)
    assert seq.block_table == [0] and bm.num_used_blocks == 1
    for t in range(12):  # tokens 5..16 fill the first block
        decode(bm, seq, t)
    assert len(seq) == 16 and seq.block_table == [0]
    decode(bm, seq, 99)  # the 17th token needs a second block
    assert seq.block_table == [0, 1] and bm.num_free_blocks == 8
    bm.check_invariants([seq])
    bm.free(seq)
    assert seq.block_table == [] and bm.num_free_blocks == 10 and bm.num_used_blocks == 0
    bm.check_invariants([])


def test_allocation_failure_changes_nothing():
    bm = BlockManager(num_blocks=3, block_size=4)
    a, b = make_seq("a", range(8)), make_seq("b", range(100, 108))
    run_prompt(bm, a)
    assert bm.claim_cached_prefix(b) == 0
    before = (list(b.block_table), bm.num_free_blocks, list(bm.free_queue), bm.stats)
    assert not bm.can_allocate(b, 8)
    assert bm.allocate_slots(b, 8) is False
    assert (list(b.block_table), bm.num_free_blocks, list(bm.free_queue), bm.stats) == before
    assert bm.can_allocate(b, 4) and bm.allocate_slots(b, 4) and b.block_table == [2]
    bm.check_invariants([a, b])


def test_chunked_prefill_allocates_per_chunk_and_zero_token_calls_are_free():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq("long", range(10))
    assert bm.claim_cached_prefix(seq) == 0
    assert bm.allocate_slots(seq, 3) and seq.block_table == [0]
    seq.num_computed_tokens = 3
    assert bm.allocate_slots(seq, 0) and seq.block_table == [0]
    assert bm.allocate_slots(seq, 6) and seq.block_table == [0, 1, 2]  # tokens 3..8 → blocks 0..2
    seq.num_computed_tokens = 9
    bm.check_invariants([seq])


def test_free_queue_hands_out_uncached_blocks_before_cached_ones_and_lru_cached_first():
    bm = BlockManager(num_blocks=6, block_size=2)
    old, new = make_seq("old", [1, 2, 3, 4, 5]), make_seq("new", [7, 8, 9, 10, 11])
    run_prompt(bm, old)  # blocks 0, 1 cached; 2 partial
    run_prompt(bm, new)  # blocks 3, 4 cached; 5 partial
    bm.free(old)
    bm.free(new)
    # partial (uncached) blocks first, then old's blocks (freed earlier), tail blocks before heads
    assert list(bm.free_queue) == [5, 2, 1, 0, 4, 3]
    taker = make_seq("taker", range(50, 56))
    run_prompt(bm, taker)
    assert taker.block_table == [5, 2, 1]  # block 1 evicted: old's second block is forgotten
    assert bm.num_cached_blocks == 3 + 3  # 0, 3, 4 survive; taker's three full blocks join
    again = make_seq("old again", [1, 2, 3, 4, 5])
    assert bm.claim_cached_prefix(again) == 2  # only the first block of "old" survives
    assert again.block_table == [0]


# ---------------------------------------------------------------------- prefix caching
def test_shared_prefix_blocks_are_shared_and_counted():
    bm = BlockManager(num_blocks=16, block_size=4)
    system = list(range(1000, 1010))  # 10 tokens: two full blocks + 2
    a = make_seq("a", system + [1, 2, 3])
    b = make_seq("b", system + [4, 5])
    run_prompt(bm, a)
    assert bm.stats["misses"] == 3 and bm.stats["hits"] == 0
    assert bm.claim_cached_prefix(b) == 8
    assert b.block_table == a.block_table[:2]
    assert [bm.blocks[i].ref_count for i in a.block_table] == [2, 2, 1, 1]
    b.num_computed_tokens = 8
    assert bm.allocate_slots(b, 4) and b.block_table[2] not in a.block_table
    b.num_computed_tokens = 12
    bm.cache_full_blocks(b)
    bm.check_invariants([a, b])
    assert bm.stats == dict(free=11, used=5, cached=4, hits=2, misses=3, hit_rate=0.4, saved_tokens=8)
    bm.free(a)  # shared blocks stay with b
    assert [bm.blocks[i].ref_count for i in b.block_table] == [1, 1, 1]
    bm.check_invariants([b])


def test_exact_block_multiple_prompt_fully_cached_still_computes_the_last_block():
    bm = BlockManager(num_blocks=8, block_size=16)
    prompt = list(range(32))
    first = make_seq("first", prompt)
    run_prompt(bm, first)
    assert bm.num_cached_blocks == 2
    second = make_seq("second", prompt)
    assert bm.claim_cached_prefix(second) == 16  # not 32: one block recomputed so there are logits
    second.num_computed_tokens = 16
    assert second.block_table == [first.block_table[0]]
    assert bm.allocate_slots(second, 16)
    assert second.block_table[1] != first.block_table[1]  # writes into its own block, never a shared one
    second.num_computed_tokens = 32
    bm.cache_full_blocks(second)  # same hash as first's block 1: stays private
    assert bm.num_cached_blocks == 2
    bm.check_invariants([first, second])
    one_block = make_seq("one block", prompt[:16])
    assert bm.claim_cached_prefix(one_block) == 0  # a single full block is never skipped
    assert bm.stats["hits"] == 1


def test_two_sequences_with_the_same_prefix_admitted_in_the_same_step():
    bm = BlockManager(num_blocks=16, block_size=4)
    prompt = list(range(20, 30))
    a, b = make_seq("a", prompt), make_seq("b", prompt)
    # same step: both are admitted before either has computed anything, so neither finds a hit
    assert bm.claim_cached_prefix(a) == 0 and bm.claim_cached_prefix(b) == 0
    assert bm.allocate_slots(a, 10) and bm.allocate_slots(b, 10)
    assert set(a.block_table).isdisjoint(b.block_table)
    a.num_computed_tokens = b.num_computed_tokens = 10
    bm.cache_full_blocks(a)
    bm.cache_full_blocks(b)
    assert bm.num_cached_blocks == 2  # registered once, by the first
    assert bm.stats["hits"] == 0
    bm.check_invariants([a, b])
    # once computed, the next one shares them
    c = make_seq("c", prompt)
    assert bm.claim_cached_prefix(c) == 8 and c.block_table == a.block_table[:2]
    assert bm.stats["hits"] == 2


def test_preempted_sequence_finds_its_own_blocks_when_it_comes_back():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq("victim", range(10))
    run_prompt(bm, seq)
    for t in [50, 51, 52]:  # 13 tokens, 13 computed after these decodes
        decode(bm, seq, t)
    seq.output_token_ids.append(53)  # sampled, not yet computed
    table = list(seq.block_table)
    assert len(table) == 4
    bm.free(seq)  # preemption by recompute
    seq.num_computed_tokens = 0
    assert bm.num_free_blocks == 8 and bm.num_cached_blocks == 3
    assert bm.claim_cached_prefix(seq) == 12  # 14 tokens: three full blocks are back
    assert seq.block_table == table[:3]
    seq.num_computed_tokens = 12
    assert bm.allocate_slots(seq, 2)
    bm.check_invariants([seq])


def test_hash_collision_is_caught_by_the_token_check(monkeypatch):
    monkeypatch.setattr(bm_module, "hash_block", lambda parent, tokens: 42)
    bm = BlockManager(num_blocks=8, block_size=4)
    run_prompt(bm, make_seq("a", [1, 2, 3, 4, 5]))
    other = make_seq("b", [9, 9, 9, 9, 5])
    assert bm.claim_cached_prefix(other) == 0 and other.block_table == []
    assert bm.stats["misses"] == 2


def test_prefix_caching_off_never_shares():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a, b = make_seq("a", range(9)), make_seq("b", range(9))
    run_prompt(bm, a)
    run_prompt(bm, b)
    assert set(a.block_table).isdisjoint(b.block_table) and bm.num_cached_blocks == 0
    assert bm.stats["hits"] == bm.stats["misses"] == 0


def test_check_invariants_catches_broken_bookkeeping():
    bm = BlockManager(num_blocks=4, block_size=4)
    seq = make_seq("a", range(5))
    run_prompt(bm, seq)
    bm.check_invariants([seq])
    bm.blocks[seq.block_table[0]].ref_count += 1
    with pytest.raises(AssertionError, match="ref_count"):
        bm.check_invariants([seq])
    bm.blocks[seq.block_table[0]].ref_count -= 1
    intruder = make_seq("intruder", range(5))
    intruder.block_table = [seq.block_table[1]]  # a private, partial block owned twice
    bm.blocks[seq.block_table[1]].ref_count += 1
    with pytest.raises(AssertionError, match="shared but not a cached"):
        bm.check_invariants([seq, intruder])


# ---------------------------------------------------------------------- random operation sequences
BASES = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 9, 9, 9], [7, 7, 7, 7, 7, 7, 7, 7]]


class BlockManagerMachine(RuleBasedStateMachine):
    """A toy scheduler drives the manager; a fake pool records what each slot holds.

    Slot contents are the token prefix whose K/V they would hold, so a prefix-cache hit that
    returned the wrong block, or a write into a shared block, shows up as a wrong slot.
    """

    @initialize(num_blocks=st.integers(1, 12), block_size=st.sampled_from([1, 2, 3, 4]), caching=st.booleans())
    def setup(self, num_blocks, block_size, caching):
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching=caching)
        self.pool: dict[int, tuple] = {}
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.scheduled: dict[int, int] = {}  # seq_id -> tokens allocated for the next step
        self.count = 0

    @rule(base=st.integers(0, len(BASES) - 1), cut=st.integers(1, 9), extra=st.lists(st.integers(0, 3), max_size=5))
    def arrive(self, base, cut, extra):
        self.count += 1
        self.waiting.append(make_seq(f"r{self.count}", BASES[base][:cut] + extra))

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def admit(self, data):
        seq = self.waiting.pop(data.draw(st.integers(0, len(self.waiting) - 1)))
        seq.num_computed_tokens = self.bm.claim_cached_prefix(seq)
        assert seq.num_computed_tokens < len(seq) and seq.num_computed_tokens % self.bm.block_size == 0
        self.running.append(seq)
        self.scheduled[seq.seq_id] = 0

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def allocate(self, data):
        seq = data.draw(st.sampled_from(self.running))
        remaining = len(seq) - seq.num_computed_tokens
        n = data.draw(st.integers(0, remaining))
        table, free = list(seq.block_table), self.bm.num_free_blocks
        if self.bm.allocate_slots(seq, n):
            self.scheduled[seq.seq_id] = max(self.scheduled[seq.seq_id], n)
        else:
            assert (seq.block_table, self.bm.num_free_blocks) == (table, free)

    @precondition(lambda self: any(self.scheduled.get(s.seq_id) for s in self.running))
    @rule(data=st.data(), new_token=st.integers(0, 3))
    def step(self, data, new_token):
        seq = data.draw(st.sampled_from([s for s in self.running if self.scheduled[s.seq_id]]))
        n = self.scheduled[seq.seq_id]
        bs = self.bm.block_size
        for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
            block_id = seq.block_table[pos // bs]
            assert self.bm.blocks[block_id].ref_count == 1, "writing into a shared block"
            self.pool[block_id * bs + pos % bs] = tuple(seq.token_ids[: pos + 1])
        seq.num_computed_tokens += n
        self.scheduled[seq.seq_id] = 0
        if seq.num_computed_tokens == len(seq):
            seq.output_token_ids.append(new_token)  # sampled: known, not yet computed
        if data.draw(st.booleans()):  # the scheduler caches after a step (usually)
            self.bm.cache_full_blocks(seq)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def cache(self, data):
        self.bm.cache_full_blocks(data.draw(st.sampled_from(self.running)))

    @precondition(lambda self: self.running)
    @rule(data=st.data(), preempt=st.booleans())
    def free(self, data, preempt):
        seq = data.draw(st.sampled_from(self.running))
        self.running.remove(seq)
        self.scheduled.pop(seq.seq_id)
        self.bm.free(seq)
        assert seq.block_table == []
        if preempt:
            seq.num_computed_tokens = 0
            self.waiting.append(seq)

    @invariant()
    def bookkeeping_holds(self):
        bm = self.bm
        bm.check_invariants(self.running)
        assert bm.num_free_blocks + bm.num_used_blocks == bm.num_blocks
        owners = [b for s in self.running for b in s.block_table]
        assert bm.num_used_blocks == len(set(owners))
        for seq in self.running:
            stored = seq.num_computed_tokens + self.scheduled[seq.seq_id]
            assert len(seq.block_table) == -(-stored // bm.block_size)
            for pos in range(seq.num_computed_tokens):  # every computed token reads back its own prefix
                slot = seq.block_table[pos // bm.block_size] * bm.block_size + pos % bm.block_size
                assert self.pool[slot] == tuple(seq.token_ids[: pos + 1])


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(
    max_examples=examples(150),
    stateful_step_count=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)


def test_cancel_claim_gives_blocks_and_counts_back():
    """A failed admission leaves the pool and the hit/miss counters as they were before the claim."""
    from lifeofprompt.engine.block_manager import BlockManager
    from lifeofprompt.engine.sampling_params import SamplingParams
    from lifeofprompt.engine.sequence import Sequence

    bm = BlockManager(num_blocks=4, block_size=4)
    first = Sequence("a", list(range(9)), SamplingParams())
    bm.claim_cached_prefix(first)
    assert bm.allocate_slots(first, 9)
    first.num_computed_tokens = 9
    bm.cache_full_blocks(first)
    bm.free(first)
    before = (bm.hits, bm.misses, bm.saved_tokens, bm.num_free_blocks)
    again = Sequence("b", list(range(9)), SamplingParams())
    assert bm.claim_cached_prefix(again) == 8
    assert (bm.hits, bm.saved_tokens) == (before[0] + 2, before[2] + 8)
    bm.cancel_claim(again)
    assert (bm.hits, bm.misses, bm.saved_tokens, bm.num_free_blocks) == before
    assert again.block_table == []
    bm.check_invariants()

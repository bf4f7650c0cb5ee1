"""A step's host work does not grow with the context: no step copies a sequence's token list.

A decode step needs each sequence's newest token and its block table, not its history; a step that
copies ``prompt + output`` (``Sequence.token_ids``) or the output list costs time in proportion to the
context, every step, for every sequence. The sequences' lists are replaced by lists that count what
is read from them, and the engine runs on: every read of many items at once is a copy.
"""

from __future__ import annotations

import pytest

from lifeofprompt.engine.llm_engine import LLMEngine
from lifeofprompt.engine.sampling_params import SamplingParams
from lifeofprompt.engine.sequence import Sequence

BLOCK_SIZE = 16
WIDE_READ = BLOCK_SIZE  # a read of more than a block at once is a copy (registering a full block reads one)


class WatchedList(list):
    """A list that records every read of more than ``WIDE_READ`` items: iteration, a wide slice, a concatenation."""

    wide_reads: list[str] = []

    def _note(self, what: str, count: int) -> None:
        if count > WIDE_READ:
            WatchedList.wide_reads.append(f"{what} of {count} items")

    def __iter__(self):
        self._note("iteration", len(self))
        return super().__iter__()

    def __getitem__(self, index):
        if isinstance(index, slice):
            self._note("slice", len(range(*index.indices(len(self)))))
        return super().__getitem__(index)

    def __add__(self, other):
        self._note("concatenation", len(self) + len(other))
        return list(super().__add__(other))

    def __radd__(self, other):  # list + watched: called before list's own + (a subclass's reflected method)
        self._note("concatenation", len(other) + len(self))
        return list(other) + list(super().__iter__())

    def copy(self):
        self._note("copy", len(self))
        return super().copy()


def watch(seq: Sequence) -> None:
    seq.prompt_token_ids, seq.output_token_ids = WatchedList(seq.prompt_token_ids), WatchedList(seq.output_token_ids)


def test_watched_list_sees_every_kind_of_copy():
    """The watcher catches what a step could do to a list: so a clean run below means something."""
    seq = Sequence("s", list(range(40)), SamplingParams())
    seq.output_token_ids = list(range(40, 60))
    watch(seq)
    WatchedList.wide_reads.clear()
    copies = (seq.token_ids, list(seq.output_token_ids), seq.prompt_token_ids[:30], seq.output_token_ids.copy())
    assert all(copies) and [0] + seq.output_token_ids
    assert WatchedList.wide_reads == [
        "concatenation of 60 items", "iteration of 20 items", "slice of 30 items", "copy of 20 items",
        "concatenation of 21 items",
    ]  # fmt: skip
    WatchedList.wide_reads.clear()
    assert seq.tokens_in(38, 42) == [38, 39, 40, 41] and seq.last_token == 59 and not WatchedList.wide_reads


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_decode_steps_copy_no_sequence(tiny_model, prefix_caching):
    model, tokenizer = tiny_model
    engine = LLMEngine(
        model, tokenizer=tokenizer, num_kv_blocks=64, block_size=BLOCK_SIZE, log_stats=False,
        enable_prefix_caching=prefix_caching, cpu_tuning="linear",
    )  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True, logprobs=2)
    for i in range(3):
        engine.add_request(str(i), list(range(1 + i, 150 + i)), params)
    engine.step()  # the prompts (a prefill reads its rows: that is not a copy of the history)
    for seq in engine.scheduler.running:
        watch(seq)
    WatchedList.wide_reads.clear()
    outputs = engine.run_until_done()
    assert [len(o.outputs[0].token_ids) for o in outputs] == [60, 60, 60]
    assert WatchedList.wide_reads == [], WatchedList.wide_reads[:5]


def test_padded_decode_steps_copy_no_sequence_or_table(tiny_model):
    """The CUDA graphs' decode path (run eagerly here, ``capture=False``) fills its fixed buffers from each
    sequence's last token and the runner's kept table rows: neither the tokens nor a block table is copied."""
    model, tokenizer = tiny_model
    engine = LLMEngine(
        model, tokenizer=tokenizer, num_kv_blocks=64, block_size=BLOCK_SIZE, log_stats=False, cpu_tuning="linear"
    )
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for i in range(3):
        engine.add_request(str(i), list(range(1 + i, 200 + i)), params)
    engine.step()  # the prompts, eagerly
    engine.runner.start_decode_graphs(capture=False)
    for seq in engine.scheduler.running:
        watch(seq)
        seq.block_table = WatchedList(seq.block_table)  # 13 blocks: its row is written again once, narrowly
    WatchedList.wide_reads.clear()
    outputs = engine.run_until_done()
    assert [len(o.outputs[0].token_ids) for o in outputs] == [40, 40, 40]
    assert {r.launch.mode for r in list(engine.step_records)[1:]} == {"padded eager decode"}
    assert WatchedList.wide_reads == [], WatchedList.wide_reads[:5]


def test_an_output_is_a_snapshot_that_copies_nothing(tiny_model):
    """A step's ``RequestOutput`` shows the tokens so far and keeps showing them after later steps."""
    model, tokenizer = tiny_model
    engine = LLMEngine(model, tokenizer=tokenizer, num_kv_blocks=32, log_stats=False, cpu_tuning="linear")
    engine.add_request("a", [5, 6, 7], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=1))
    snapshots = []
    while engine.has_unfinished_requests():
        snapshots += [o.outputs[0] for o in engine.step()]
    final = snapshots[-1]
    assert [len(s.token_ids) for s in snapshots] == [1, 2, 3, 4, 5]
    assert all(s.token_ids == list(final.token_ids)[: len(s.token_ids)] for s in snapshots)
    assert all(len(s.logprobs) == len(s.token_ids) for s in snapshots)
    running = snapshots[-2].token_ids  # a view while the request ran; the last output holds a plain list
    assert type(running).__name__ == "Prefix" and type(final.token_ids) is list and type(final.logprobs) is list
    assert running[-2:] == final.token_ids[2:4] and running[-1] == final.token_ids[3] and running + [9] == [*running, 9]


def test_block_tables_follow_appends_rollbacks_and_more_sequences_than_rows():
    """The kept buffer gives each step the tables as they are: after appends, after a trim followed by an
    append to the same length (a verify's rollback), after a preemption, and with more sequences than rows."""
    from lifeofprompt.engine.block_manager import BlockManager
    from lifeofprompt.engine.block_tables import BlockTables

    manager, tables = BlockManager(64, 4), BlockTables(2, 4)
    seqs = [Sequence(str(i), list(range(5 + i)), SamplingParams()) for i in range(3)]
    for seq in seqs:
        assert manager.allocate_slots(seq, len(seq))

    def expected(step):
        width = max(len(s.block_table) for s in step)
        return [s.block_table + [-1] * (width - len(s.block_table)) for s in step]

    assert tables.for_step(seqs).tolist() == expected(seqs)  # 3 sequences, 2 rows: the buffer grows
    seqs[0].num_computed_tokens = len(seqs[0])
    assert manager.allocate_slots(seqs[0], 17)  # three more blocks: past the 4 columns planned
    assert tables.for_step(seqs[:2]).tolist() == expected(seqs[:2])
    before = list(seqs[0].block_table)
    manager.trim(seqs[0], 5)  # a rollback: its last blocks back to the pool, where seqs[2] takes them
    seqs[2].num_computed_tokens = len(seqs[2])
    assert manager.allocate_slots(seqs[2], 12)
    assert manager.allocate_slots(seqs[0], 17)  # the same length again, over other blocks
    assert len(seqs[0].block_table) == len(before) and seqs[0].block_table != before
    manager.free(seqs[1])  # preempted: its row must not keep the old blocks
    assert manager.allocate_slots(seqs[2], 8) and manager.allocate_slots(seqs[1], 6)
    assert tables.for_step(seqs).tolist() == expected(seqs)

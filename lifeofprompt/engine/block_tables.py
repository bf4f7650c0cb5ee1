"""``BlockTables``: the step's block tables, kept in one host buffer and updated only where they changed.

A decode step's table row for a sequence is last step's, or one block longer. Built again from
Python lists every step, the ``[batch, width]`` table costs time in proportion to the context (a
4,096-token sequence holds 256 blocks of 16). Here each sequence keeps a row of one buffer, and a
step writes only the entries written since: its new blocks, or, where the block manager gave blocks
back (a verify's rollback, a preemption, the end), everything from the first entry it touched
(``Sequence.block_table_changed_from``). The step's table is then one gather of its rows.
"""

from __future__ import annotations

import torch


class BlockTables:
    def __init__(self, max_rows: int, max_blocks: int):
        """``max_rows``: sequences kept at once (at least a step's); ``max_blocks``: the longest table."""
        self.buffer = torch.full((max_rows, max_blocks), -1, dtype=torch.int32)
        self.rows: dict[int, list] = {}  # seq_id -> [row, the table list it mirrors, entries written]
        self.free_rows = list(range(max_rows - 1, -1, -1))

    def for_step(self, seqs) -> torch.Tensor:
        """The ``[len(seqs), longest table]`` block table of a step, -1 past each sequence's blocks."""
        if sum(seq.seq_id not in self.rows for seq in seqs) > len(self.free_rows):
            self.release_all_but(seqs)
        rows = [self.sync(seq) for seq in seqs]
        width = max(len(seq.block_table) for seq in seqs)
        return self.buffer[rows, :width]

    def sync(self, seq) -> int:
        """Write what changed in ``seq``'s table since its row was last written; return the row."""
        entry = self.rows.get(seq.seq_id)
        if entry is None:
            entry = self.rows[seq.seq_id] = [self.free_rows.pop(), seq.block_table, 0]
        row, table, written = entry
        start = 0 if table is not seq.block_table else min(written, seq.block_table_changed_from)
        length = len(seq.block_table)
        if length > self.buffer.shape[1]:  # longer than the longest request was planned for (a driver's own)
            self.buffer = torch.cat([self.buffer, torch.full_like(self.buffer, -1)[:, :length]], dim=1)
        if start < length:
            self.buffer[row, start:length] = torch.tensor(seq.block_table[start:length], dtype=torch.int32)
        if length < written:
            self.buffer[row, length:written] = -1
        entry[1], entry[2] = seq.block_table, length
        seq.block_table_changed_from = length
        return row

    def release_all_but(self, seqs) -> None:
        """Give back every row but the step's (finished, waiting or preempted sequences write theirs again
        when they next run); grow the buffer if the step alone needs more rows than it has."""
        keep = {seq.seq_id for seq in seqs}
        for seq_id in [s for s in self.rows if s not in keep]:
            row, _, written = self.rows.pop(seq_id)
            self.buffer[row, :written] = -1
            self.free_rows.append(row)
        if len(keep) > len(self.buffer):
            grown = torch.full((len(keep), self.buffer.shape[1]), -1, dtype=torch.int32)
            grown[: len(self.buffer)] = self.buffer
            self.free_rows += range(len(self.buffer), len(keep))
            self.buffer = grown

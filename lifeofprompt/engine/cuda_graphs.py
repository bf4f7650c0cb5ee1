"""``DecodeGraphs``: the model runner's CUDA graphs of decode steps, filled from its sequences.

The fixed-address buffers and the capture are the model layer's (``model/graph_capture.py``);
what this adds is the engine's side: every step copies its sequences into the buffers
(``fill_static_decode``), and a step with B sequences replays the smallest captured graph with
at least B rows, the extra rows being padding. ``ModelRunner`` inherits this; the same padded
computation can run eagerly (``run_static_decode``), which is how the CPU tests check the padding.
"""

from __future__ import annotations

import torch

from ..model.graph_capture import GraphCapture
from .sequence import Sequence


class DecodeGraphs(GraphCapture):
    def fill_static_decode(self, seqs: list[Sequence], size: int) -> None:
        """Copy a decode step of ``len(seqs)`` sequences into the static buffers, padding rows up to ``size``.

        Padding rows: token 0 at position 0, slot -1 (stored nowhere), length 1 over block 0.
        """
        pad = size - len(seqs)
        width = self.max_blocks_per_seq
        last = [len(seq) - 1 for seq in seqs]
        ids = torch.tensor([seq.token_ids[-1] for seq in seqs] + [0] * pad, dtype=torch.long)
        positions = torch.tensor(last + [0] * pad, dtype=torch.long)
        slots = torch.tensor(
            [
                seq.block_table[p // self.block_size] * self.block_size + p % self.block_size
                for seq, p in zip(seqs, last)
            ]
            + [-1] * pad,
            dtype=torch.long,
        )
        seq_lens = torch.tensor([p + 1 for p in last] + [1] * pad, dtype=torch.int32)
        tables = torch.tensor(
            [(seq.block_table + [0] * width)[:width] for seq in seqs] + [[0] * width] * pad, dtype=torch.int32
        )
        for static, host in (
            (self.static_input_ids, ids),
            (self.static_positions, positions),
            (self.static_slot_mapping, slots),
            (self.static_seq_lens, seq_lens),
            (self.static_block_tables, tables),
        ):
            static[:size].copy_(host, non_blocking=True)

    @torch.no_grad()
    def run_static_decode(self, seqs: list[Sequence], size: int) -> torch.Tensor:
        """The graph's computation run eagerly: the padded static-buffer decode (tests it on any device)."""
        self.fill_static_decode(seqs, size)
        return self.run_model(
            self.static_input_ids[:size], self.static_positions[:size], self.static_decode_metadata(size)
        )[: len(seqs)]

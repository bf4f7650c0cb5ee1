"""``DecodeGraphs``: the runner's CUDA graphs of decode steps, filled from its sequences.

A graph bakes in tensor addresses and Python ints, so a decode step's inputs live in fixed buffers
sized for the largest batch (``model/graph_capture.py`` holds them and captures). A graph is
captured once per batch size of a ladder (1, 2, 4, 8, 16, 32, 48, ... up to ``max_num_seqs``); a
step with B sequences replays the smallest graph with at least B rows, the extra rows being padding
(slot -1: nothing is stored; length 1: attention reads one harmless slot). With ``capture=False``
the same padded steps run eagerly from the buffers, which is how the CPU tests check the padding.
With tensor parallelism every rank holds graphs of its own (``distributed/rank_graphs.py``), filled
from the buffers here.
"""

from __future__ import annotations

import torch

from ..errors import ConfigError
from ..model.graph_capture import GraphCapture
from .sequence import Sequence


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """The ladder of decode batch sizes that get a CUDA graph: 1, 2, 4, 8, then every 16, up to ``max_num_seqs``."""
    if max_num_seqs < 1:
        raise ConfigError(f"max_num_seqs must be >= 1, got {max_num_seqs}", param="max_num_seqs")
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 16))
    return sorted(set(sizes + [max_num_seqs]))


def padded_batch_size(batch: int, sizes: list[int]) -> int | None:
    """The smallest ladder size that holds ``batch`` rows (None: larger than every graph)."""
    return next((size for size in sizes if size >= batch), None)


class DecodeGraphs(GraphCapture):
    def __init__(self, runner, capture: bool = True):
        r = runner.resolved
        self.runner, self.device, self.kv_cache, self.backend = (
            runner,
            runner.device,
            runner.kv_cache,
            r.attention_backend,
        )
        self.block_size, self.max_num_seqs, self.max_model_len = r.block_size, r.max_num_seqs, r.max_model_len
        self.max_blocks_per_seq = r.max_blocks_per_seq
        self.graph_sizes = graph_batch_sizes(r.max_num_seqs)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.on_every_rank = False  # a tensor-parallel shard: each rank replays its own (rank_graphs.py)
        self._alloc_static_buffers()
        if capture:
            self.capture_graphs()

    def run_model(self, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        """What a graph holds: the runner's forward of the buffers' rows."""
        return self.runner.run_model(input_ids, positions, meta)

    def fill(self, seqs: list[Sequence], size: int) -> None:
        """Copy a decode step of ``len(seqs)`` sequences into the static buffers, padding rows up to ``size``.

        A row's inputs come from its last token and its block table, which the runner keeps between
        steps (``block_tables.py``): the step copies tables as wide as its longest one, and never builds
        a table from a list. Entries past a sequence's own blocks are never read (its length bounds
        them); they hold block 0 rather than -1, so every entry a graph sees names a real block.
        Padding rows: token 0 at position 0, slot -1 (stored nowhere), length 1 over block 0.
        """
        n, block_size = len(seqs), self.block_size
        positions = torch.tensor([len(seq) - 1 for seq in seqs], dtype=torch.long)
        tables = self.runner.block_tables.for_step(seqs).clamp(min=0)
        slots = tables[torch.arange(n), positions // block_size].long() * block_size + positions % block_size
        self.static_input_ids[:n].copy_(torch.tensor([seq.last_token for seq in seqs]), non_blocking=True)
        self.static_positions[:n].copy_(positions, non_blocking=True)
        self.static_slot_mapping[:n].copy_(slots, non_blocking=True)
        self.static_seq_lens[:n].copy_(positions + 1, non_blocking=True)
        self.static_block_tables[:n, : tables.shape[1]].copy_(tables, non_blocking=True)
        if size > n:
            self.static_input_ids[n:size] = 0
            self.static_positions[n:size] = 0
            self.static_slot_mapping[n:size] = -1
            self.static_seq_lens[n:size] = 1
            self.static_block_tables[n:size, 0] = 0

    def run(self, size: int) -> torch.Tensor:
        """The filled step of ``size`` rows: its graph's replay, or the same computation eagerly."""
        if size in self.graphs:
            graph, logits = self.graphs[size]
            graph.replay()
            return logits
        ids, positions = self.static_input_ids[:size], self.static_positions[:size]
        return self.run_model(ids, positions, self.static_decode_metadata(size))

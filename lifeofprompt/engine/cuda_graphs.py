"""``DecodeGraphs``: the model runner's CUDA graphs of decode steps, and the static buffers they read.

A graph bakes in tensor addresses and Python ints, so a decode step's inputs live in fixed
buffers sized for the largest batch, which every step fills (``fill_static_decode``); a step
with B sequences replays the smallest captured graph with at least B rows, the extra rows
being padding. ``ModelRunner`` inherits this; the same padded computation can run eagerly
(``run_static_decode``), which is how the CPU tests check the padding.
"""

from __future__ import annotations

import time

import torch

from ..model.attention import PagedCacheMetadata
from .sequence import Sequence


class DecodeGraphs:
    def _alloc_static_buffers(self) -> None:
        """Fixed-address inputs of the decode graphs, sized for the largest batch."""
        n, device = self.max_num_seqs, self.device
        self.static_input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.static_positions = torch.zeros(n, dtype=torch.long, device=device)
        self.static_slot_mapping = torch.full((n,), -1, dtype=torch.long, device=device)
        self.static_seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.static_block_tables = torch.zeros(n, self.max_blocks_per_seq, dtype=torch.int32, device=device)
        self.static_query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)

    def static_decode_metadata(self, size: int) -> PagedCacheMetadata:
        """Metadata over the first ``size`` rows of the static buffers (what a graph of that size reads)."""
        return PagedCacheMetadata(
            query_start_loc=self.static_query_start_loc[:size + 1], seq_lens=self.static_seq_lens[:size],
            max_query_len=1, max_seq_len=self.max_model_len, logits_indices=None, cache=self.kv_cache,
            block_tables=self.static_block_tables[:size], slot_mapping=self.static_slot_mapping[:size],
            backend=self.backend)

    def fill_static_decode(self, seqs: list[Sequence], size: int) -> None:
        """Copy a decode step of ``len(seqs)`` sequences into the static buffers, padding rows up to ``size``.

        Padding rows: token 0 at position 0, slot -1 (stored nowhere), length 1 over block 0.
        """
        pad = size - len(seqs)
        width = self.max_blocks_per_seq
        last = [len(seq) - 1 for seq in seqs]
        ids = torch.tensor([seq.token_ids[-1] for seq in seqs] + [0] * pad, dtype=torch.long)
        positions = torch.tensor(last + [0] * pad, dtype=torch.long)
        slots = torch.tensor([seq.block_table[p // self.block_size] * self.block_size + p % self.block_size
                              for seq, p in zip(seqs, last)] + [-1] * pad, dtype=torch.long)
        seq_lens = torch.tensor([p + 1 for p in last] + [1] * pad, dtype=torch.int32)
        tables = torch.tensor([(seq.block_table + [0] * width)[:width] for seq in seqs] + [[0] * width] * pad,
                              dtype=torch.int32)
        for static, host in ((self.static_input_ids, ids), (self.static_positions, positions),
                             (self.static_slot_mapping, slots), (self.static_seq_lens, seq_lens),
                             (self.static_block_tables, tables)):
            static[:size].copy_(host, non_blocking=True)

    @torch.no_grad()
    def run_static_decode(self, seqs: list[Sequence], size: int) -> torch.Tensor:
        """The graph's computation run eagerly: the padded static-buffer decode (tests it on any device)."""
        self.fill_static_decode(seqs, size)
        return self.run_model(self.static_input_ids[:size], self.static_positions[:size],
                              self.static_decode_metadata(size))[:len(seqs)]

    @torch.no_grad()
    def capture_graphs(self) -> None:
        """Capture one decode graph per ladder size, largest first so smaller ones reuse its memory pool."""
        start = time.perf_counter()
        pool = None
        self.graphs = {}
        for size in reversed(self.graph_sizes):
            meta = self.static_decode_metadata(size)
            ids, positions = self.static_input_ids[:size], self.static_positions[:size]
            self.run_model(ids, positions, meta)                   # warm-up: autotune, allocate
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self.run_model(ids, positions, meta)
            if pool is None:
                pool = graph.pool()
            self.graphs[size] = (graph, logits)
        torch.cuda.synchronize()
        self.graph_capture_seconds = time.perf_counter() - start

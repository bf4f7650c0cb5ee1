"""``GraphCapture``: a decode forward's fixed-address inputs and the CUDA graphs captured over them.

A graph bakes in tensor addresses and Python ints, so a decode step's inputs live in fixed
buffers sized for the largest batch, and a step with B rows replays the smallest captured graph
with at least B rows, the extra rows being padding. What fills the buffers lives above this
layer: the engine's ``DecodeGraphs`` (``engine/cuda_graphs.py``) copies in its sequences, and a
tensor-parallel rank (``distributed/rank_graphs.py``) copies in what rank 0 broadcast.
A subclass gives ``run_model(input_ids, positions, meta)``: what a graph holds.
"""

from __future__ import annotations

import time

import torch

from .attention import PagedCacheMetadata


class GraphCapture:
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
        fields = dict(
            query_start_loc=self.static_query_start_loc[: size + 1],
            seq_lens=self.static_seq_lens[:size],
            max_query_len=1,
            max_seq_len=self.max_model_len,
        )
        tables, slots = self.static_block_tables[:size], self.static_slot_mapping[:size]
        return PagedCacheMetadata.over_cache(fields, self.kv_cache, tables, slots, self.backend)

    @torch.no_grad()
    def capture_graphs(self) -> None:
        """Capture one decode graph per ladder size, largest first so smaller ones reuse its memory pool."""
        start = time.perf_counter()
        pool = None
        self.graphs = {}
        for size in reversed(self.graph_sizes):
            meta = self.static_decode_metadata(size)
            ids, positions = self.static_input_ids[:size], self.static_positions[:size]
            self.run_model(ids, positions, meta)  # warm-up: autotune, allocate
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self.run_model(ids, positions, meta)
            if pool is None:
                pool = graph.pool()
            self.graphs[size] = (graph, logits)
        torch.cuda.synchronize()
        self.graph_capture_seconds = time.perf_counter() - start

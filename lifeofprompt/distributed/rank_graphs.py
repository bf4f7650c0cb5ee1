"""CUDA graphs with tensor parallelism: every rank captures and replays its own.

A single-process engine captures its decode step once per batch size and replays it
(``model/graph_capture.py``, filled by ``engine/cuda_graphs.py``). With T ranks the step also
holds all-reduces, and each rank's graph must replay in step with the others'. What cannot go
inside a graph is the step's inputs travelling from rank 0: a graph replays the values its buffers
hold, so a broadcast captured in it would resend the capture's own header forever.
So the step splits in three, on every rank:

1. outside any graph, rank 0 broadcasts the padded decode step (ids, positions, slots,
   lengths, block tables: ``step.send_replay``), and each rank copies it into its static buffers;
2. each rank replays its graph of that size: the embedding, every layer with its two
   all-reduces, and the LM head's slice of the vocabulary;
3. outside the graph again, the logits slices are gathered to rank 0, which samples.

The graphs are captured together: rank 0 sends ``CAPTURE`` with the sizes, and every rank
warms up and captures the same sizes in the same order, so each warm-up's collectives meet.
An all-reduce replayed inside a graph is not counted by ``collectives.py`` (it never returns to
Python); the broadcast and the gather around it are.

On the CPU (no graphs) the same protocol runs with ``capture=False``: each rank runs the padded
step eagerly from its static buffers, which is how the tests check it without a GPU.
"""

from __future__ import annotations

import torch

from ..model.graph_capture import GraphCapture
from . import step


class RankDecodeGraphs(GraphCapture):
    """One rank's static decode buffers and its graphs of them (``GraphCapture``'s buffers and capture,
    around this shard's ``local_logits`` instead of a whole forward)."""

    def __init__(
        self,
        model,
        cache,
        sizes: list[int],
        max_num_seqs: int,
        max_blocks: int,
        max_model_len: int,
        backend: str,
        capture: bool,
    ):
        self.model, self.kv_cache, self.device = model, cache, model.device
        self.graph_sizes, self.max_num_seqs, self.max_blocks_per_seq = list(sizes), max_num_seqs, max_blocks
        self.max_model_len, self.backend = max_model_len, backend
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._alloc_static_buffers()
        if capture:
            self.capture_graphs()

    def run_model(self, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        """What a graph holds (``GraphCapture.capture_graphs``): the shard's ``[rows, vocab / T]`` logits."""
        return self.model.local_logits(input_ids, positions, meta)

    def load(self, size: int, payload: torch.Tensor) -> None:
        """Copy one step's padded inputs (``payload``) into the first ``size`` rows of the static buffers."""
        ids, positions, slots, lens, tables = payload.split([size] * 4 + [size * self.max_blocks_per_seq])
        self.static_input_ids[:size].copy_(ids)
        self.static_positions[:size].copy_(positions)
        self.static_slot_mapping[:size].copy_(slots)
        self.static_seq_lens[:size].copy_(lens)
        self.static_block_tables[:size].copy_(tables.view(size, self.max_blocks_per_seq))

    def run(self, size: int, payload: torch.Tensor) -> torch.Tensor | None:
        """One decode step of ``size`` padded rows on this rank; the gathered logits on rank 0, None elsewhere."""
        self.load(size, payload)
        if size in self.graphs:
            graph, local = self.graphs[size]
            graph.replay()
        else:
            local = self.run_model(
                self.static_input_ids[:size], self.static_positions[:size], self.static_decode_metadata(size)
            )
        return self.model.gather_logits(local)


def replay_payload(buffers, size: int) -> torch.Tensor:
    """Rank 0: the first ``size`` rows of the runner's filled static buffers (``DecodeGraphs.fill``), as int64."""
    parts = [
        buffers.static_input_ids[:size],
        buffers.static_positions[:size],
        buffers.static_slot_mapping[:size],
        buffers.static_seq_lens[:size],
        buffers.static_block_tables[:size].reshape(-1),
    ]
    payload = torch.cat([p.to(torch.long) for p in parts])
    assert payload.numel() == step.replay_payload_size(size, buffers.max_blocks_per_seq)
    return payload

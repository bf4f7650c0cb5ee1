"""One step's inputs, from the driver (rank 0) to every rank, as two broadcasts of tensors.

The driver keeps the only scheduler and block manager; the other ranks know nothing about
sequences. What a rank needs to run its shard of one forward is exactly what the model
runner already built for the driver's own shard: token ids, positions, where each sequence's
rows start, its length, the rows that want logits, and, for the paged cache, the block tables
and the slot of every new row. So the driver packs those tensors into one int64 payload and
broadcasts a fixed-size header (the command and the sizes) followed by the payload: two
collectives a step, whatever the batch. Every rank then holds the same block table. (With
several pipeline stages the same header and payload go down the stages instead: ``pipeline.py``.)

After the forward, each rank's logits cover its slice of the vocabulary; they are gathered
to rank 0 (through the last pipeline stage), which samples (the other ranks never see a sampled token: the next step's
broadcast carries it as an input id).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..model.attention import NoCacheMetadata, PagedCacheMetadata
from ..model.attention_backends import BACKENDS as BACKENDS_BY_NAME
from . import collectives

STEP, STOP, REPORT, PLANS, CAPTURE, REPLAY = 1, 2, 3, 4, 5, 6  # commands in header[0]
NO_CACHE, PAGED = 0, 1  # metadata kinds in header[1]
BACKENDS = tuple(BACKENDS_BY_NAME)  # the attention backend travels as its index among the backends' names
HEADER = 9


def pack(input_ids: torch.Tensor, positions: torch.Tensor, meta) -> tuple[torch.Tensor, torch.Tensor]:
    """``(header, payload)`` of one forward: every per-step tensor end to end, as int64."""
    paged = isinstance(meta, PagedCacheMetadata)
    if not paged and not isinstance(meta, NoCacheMetadata):
        raise TypeError(f"a tensor-parallel forward sends paged or no-cache metadata, not {type(meta).__name__}")
    logits = meta.logits_indices
    parts = [input_ids, positions, meta.query_start_loc, meta.seq_lens]
    if logits is not None:
        parts.append(logits)
    width = 0
    if paged:
        width = meta.block_tables.shape[1]
        parts += [meta.slot_mapping, meta.block_tables.reshape(-1)]
    device = input_ids.device
    header = torch.tensor(
        [
            STEP,
            PAGED if paged else NO_CACHE,
            input_ids.shape[0],
            meta.num_seqs,
            width,
            -1 if logits is None else logits.shape[0],
            meta.max_query_len,
            meta.max_seq_len,
            BACKENDS.index(meta.backend.name if paged else "torch"),
        ],
        dtype=torch.long,
        device=device,
    )
    payload = torch.cat([p.reshape(-1).to(device=device, dtype=torch.long) for p in parts])
    return header, payload


def payload_size(header: list[int]) -> int:
    _, kind, tokens, seqs, width, logits = header[:6]
    size = 2 * tokens + (seqs + 1) + seqs + max(logits, 0)
    return size + (tokens + seqs * width if kind == PAGED else 0)


def unpack(header: list[int], payload: torch.Tensor, cache=None):
    """The inverse of ``pack``: ``(input_ids, positions, meta)`` over this rank's ``cache``."""
    _, kind, tokens, seqs, width, logits, max_query_len, max_seq_len, backend = header
    sizes = [tokens, tokens, seqs + 1, seqs, max(logits, 0)] + ([tokens, seqs * width] if kind == PAGED else [])
    ids, positions, starts, lens, rows, *paged = payload.split(sizes)
    fields = dict(
        query_start_loc=starts.int(),
        seq_lens=lens.int(),
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
        logits_indices=rows if logits >= 0 else None,
    )
    if kind == PAGED:
        slots, tables = paged
        tables = tables.view(seqs, width).int()
        meta = PagedCacheMetadata.over_cache(fields, cache, tables, slots, BACKENDS[backend])
    else:
        meta = NoCacheMetadata(**fields)
    return ids, positions, meta


def send_command(command: int, device) -> None:
    """Rank 0: a header with no payload (stop, report)."""
    header = torch.zeros(HEADER, dtype=torch.long, device=device)
    header[0] = command
    collectives.broadcast(header, src=0)


def broadcast_step(input_ids, positions, meta) -> None:
    """Rank 0: send one forward's inputs to every other rank."""
    header, payload = pack(input_ids, positions, meta)
    collectives.broadcast(header, src=0)
    collectives.broadcast(payload, src=0)


def receive(device) -> tuple[list[int], torch.Tensor | None]:
    """Ranks > 0: wait for the next header (and its payload, for a step)."""
    header = torch.empty(HEADER, dtype=torch.long, device=device)
    collectives.broadcast(header, src=0)
    values = header.tolist()
    if values[0] != STEP:
        return values, None
    payload = torch.empty(payload_size(values), dtype=torch.long, device=device)
    collectives.broadcast(payload, src=0)
    return values, payload


def gather_logits(local: torch.Tensor, vocab_size: int, size: int, group=None, dst: int = 0) -> torch.Tensor | None:
    """The ``size`` ranks' ``[rows, vocab / T]`` logits to rank ``dst`` as ``[rows, vocab]`` (unpadded); else None."""
    local = local.contiguous()
    if size == 1:
        return local[:, :vocab_size]
    if dist.get_rank() == dst:
        parts = [torch.empty_like(local) for _ in range(size)]
        collectives.gather(local, parts, dst=dst, group=group)
        return torch.cat(parts, dim=-1)[:, :vocab_size]
    collectives.gather(local, None, dst=dst, group=group)
    return None


# ----------------------------------------------------------------------------- decode graphs, one per rank
#
# A CUDA graph replays the kernels it captured with the values its buffers hold at replay, so
# the step's inputs cannot travel inside it: a captured broadcast would resend the capture's own
# header. Instead each rank captures its own graphs of the padded decode step, from the
# embedding to its slice of the logits, all-reduces included (``rank_graphs.py``); per step rank 0
# broadcasts the padded inputs (outside any graph), every rank copies them into its static
# buffers and replays, and the logits are gathered after the replay.


def send_capture(
    sizes: list[int],
    max_num_seqs: int,
    max_blocks: int,
    max_model_len: int,
    backend: str,
    capture: bool,
    device,
) -> None:
    """Rank 0: every rank sets up its static decode buffers and its graphs of ``sizes`` rows
    (or, with ``capture=False``, runs the same padded steps eagerly: how the CPU tests check it)."""
    header = torch.tensor(
        [
            CAPTURE,
            len(sizes),
            max_num_seqs,
            max_blocks,
            max_model_len,
            BACKENDS.index(backend),
            int(bool(capture)),
            0,
            0,
        ],
        dtype=torch.long,
        device=device,
    )
    collectives.broadcast(header, src=0)
    collectives.broadcast(torch.tensor(sizes, dtype=torch.long, device=device), src=0)


def receive_capture(header: list[int], device) -> dict:
    """Ranks > 0: the rest of ``send_capture`` (its sizes), as keyword arguments for ``RankDecodeGraphs``."""
    _, count, max_num_seqs, max_blocks, max_model_len, backend, capture = header[:7]
    sizes = torch.empty(count, dtype=torch.long, device=device)
    collectives.broadcast(sizes, src=0)
    return dict(
        sizes=sizes.tolist(),
        max_num_seqs=max_num_seqs,
        max_blocks=max_blocks,
        max_model_len=max_model_len,
        backend=BACKENDS[backend],
        capture=bool(capture),
    )


def replay_payload_size(size: int, max_blocks: int) -> int:
    """int64 values of one replay: ids, positions, slots and lengths of ``size`` rows, then their block tables."""
    return 4 * size + size * max_blocks


def send_replay(size: int, payload: torch.Tensor) -> None:
    """Rank 0: one padded decode step of ``size`` rows for every rank's graph (``rank_graphs.replay_payload``)."""
    header = torch.zeros(HEADER, dtype=torch.long, device=payload.device)
    header[0], header[1] = REPLAY, size
    collectives.broadcast(header, src=0)
    collectives.broadcast(payload, src=0)


def receive_replay(header: list[int], max_blocks: int, device) -> tuple[int, torch.Tensor]:
    """Ranks > 0: the rest of ``send_replay``: ``(size, payload)``."""
    size = header[1]
    payload = torch.empty(replay_payload_size(size, max_blocks), dtype=torch.long, device=device)
    collectives.broadcast(payload, src=0)
    return size, payload

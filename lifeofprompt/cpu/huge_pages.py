"""Weights in 2 MiB memory pages: the same bytes, read about a quarter faster by one CPU core.

A decode step streams every weight from memory once. With ordinary 4 KiB pages, 538 MB of
fp32 weights span 130,000 pages, and the core keeps missing its address-translation cache
(TLB) as it walks them; with 2 MiB pages there are 260. On the AMD EPYC this project is
developed on, one thread multiplying a row by all of SmolLM2's matrices read 23.9 GB/s from
4 KiB pages and 30.3 GB/s from 2 MiB pages, which is what a plain ``sum()`` reaches
(``benchmarks/NOTES.md``).

Linux gives an anonymous mapping 2 MiB pages ("transparent huge pages") when the mapping asks
for them with ``madvise(MADV_HUGEPAGE)`` and the system setting is ``madvise`` or ``always``.
torch's own allocator asks only when ``THP_MEM_ALLOC_ENABLE=1`` is set before its first
allocation, which a library cannot arrange. So the CPU model runner copies the weights once
into one mapping of its own (``move_weights_to_huge_pages``); every tensor keeps its shape,
dtype and values, and only its address changes. Where the system has no such pages (another
OS, the setting ``never``) the mapping is ordinary memory and nothing is lost but the copy.
"""

from __future__ import annotations

import mmap
from pathlib import Path

import torch
from torch import nn

HUGE_PAGE = 2 << 20
ALIGN = 64  # each tensor starts on a cache line
SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_pages_setting() -> str:
    """The system's transparent-huge-page mode (``always``, ``madvise``, ``never``), or ``unavailable``."""
    try:
        text = SETTING.read_text()
    except OSError:
        return "unavailable"
    chosen = [word.strip("[]") for word in text.split() if word.startswith("[")]
    return chosen[0] if chosen else "unavailable"


def huge_pages_available() -> bool:
    """Whether a mapping that asks for 2 MiB pages can get them here."""
    return hasattr(mmap, "MADV_HUGEPAGE") and huge_pages_setting() in ("always", "madvise")


def huge_page_buffer(nbytes: int) -> torch.Tensor:
    """``nbytes`` of zeroed memory as a uint8 tensor, starting on a 2 MiB boundary, in 2 MiB pages where possible.

    The tensor holds the mapping alive (``torch.frombuffer`` keeps a reference to it); the
    memory is returned to the system when the last tensor viewing it is gone.
    """
    size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE + HUGE_PAGE  # room to start on a page boundary
    mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge_pages_available():
        mapping.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start : start + nbytes]


def move_weights_to_huge_pages(model: nn.Module) -> int:
    """Copy every CPU parameter of ``model``, and the planes of its block matrices, into one huge-page buffer,
    in place; returns the bytes moved.

    Tied parameters (one ``Parameter`` in two modules) are moved once and stay tied. Returns 0,
    changing nothing, where the system has no huge pages, the weights are not on the CPU, or
    they were moved already (several runners over one model).
    """
    from ..model.block_formats import weight_tensors

    params = [p for p in weight_tensors(model) if p.device.type == "cpu"]
    if (
        not params
        or not huge_pages_available()
        or all(_inside(p, getattr(model, "_huge_page_buffer", None)) for p in params)
    ):
        return 0
    offsets, total = [], 0
    for p in params:
        offsets.append(total)
        total += -(-p.numel() * p.element_size() // ALIGN) * ALIGN
    buffer = huge_page_buffer(total)
    with torch.no_grad():
        for p, offset in zip(params, offsets):
            view = buffer[offset : offset + p.numel() * p.element_size()].view(p.dtype).view(p.shape)
            view.copy_(p.data)
            p.data = view
    model._huge_page_buffer = buffer  # a second runner over the same model finds it moved already
    return total


def _inside(tensor: torch.Tensor, buffer: torch.Tensor | None) -> bool:
    if buffer is None:
        return False
    start = buffer.data_ptr()
    return start <= tensor.data_ptr() < start + buffer.numel()

"""Attention backends by name, each chosen once at start-up: how a step stores its keys and values in the
paged pool and how its queries read them back.

* ``torch``: the reference (``paged_attention.py``), on any device;
* ``triton``: the Triton kernels (``kernels/``), on a GPU or in Triton's interpreter;
* ``cpu-hybrid``: the torch path, with the decode rows attending in C straight from the pool
  (``cpu/c_step.py: decode_attention``), where the CPU's start-up timed that faster.

``PagedCacheMetadata`` carries the chosen backend object, and every layer calls its ``attend``: no
layer reads a name or a flag.
"""

from __future__ import annotations

from ..errors import ConfigError
from .paged_attention import paged_attention, write_rows


class TorchAttention:
    """The torch reference: what every layer of a step shares is worked out once (``meta.writes``, the plan)."""

    name = "torch"

    def decode_kernel(self):
        """A kernel that takes the decode rows by itself (None: the reference's gather and SDPA)."""
        return None

    def attend(self, meta, layer_idx: int, q, k, v):
        k_pool, v_pool = meta.cache.k(layer_idx), meta.cache.v(layer_idx)
        write_rows(k, v, k_pool, v_pool, *meta.writes)
        plan = meta.torch_plan(block_tables=meta.block_tables, block_size=meta.cache.block_size)
        return paged_attention(
            q, k_pool, v_pool, meta.block_tables, meta.seq_lens, meta.query_start_loc, meta.max_query_len,
            meta.max_seq_len, meta.scale_for(q), plan=plan, decode_kernel=self.decode_kernel(),
        )  # fmt: skip


class CpuHybridAttention(TorchAttention):
    """The torch path with the decode rows in C, read from the pool through the block tables."""

    name = "cpu-hybrid"

    def decode_kernel(self):
        from ..cpu.c_step import decode_attention

        return decode_attention


class TritonAttention:
    """The Triton kernels: ``store_kv`` writes the new rows by slot, ``paged_attention`` reads them."""

    name = "triton"

    def attend(self, meta, layer_idx: int, q, k, v):
        from ..kernels import paged_attention as triton_attention
        from ..kernels import store_kv

        k_pool, v_pool = meta.cache.k(layer_idx), meta.cache.v(layer_idx)
        store_kv(k, v, k_pool, v_pool, meta.slot_mapping)
        return triton_attention(
            q, k_pool, v_pool, meta.block_tables, meta.seq_lens, meta.query_start_loc, meta.max_query_len,
            meta.max_seq_len, meta.scale_for(q),
        )  # fmt: skip


BACKENDS = {backend.name: backend() for backend in (TorchAttention, TritonAttention, CpuHybridAttention)}


def resolve_backend(asked: str, device) -> str:
    """The backend a setting names: ``"auto"`` is Triton on CUDA and torch elsewhere; a name is taken as asked."""
    if asked == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if asked not in ("torch", "triton"):
        raise ConfigError(
            f"unknown attention backend {asked!r}: use 'auto', 'torch' or 'triton'", param="attention_backend"
        )
    return asked


def attention_backend(name: str):
    """The backend of this name (one shared object each: they hold no state)."""
    if name not in BACKENDS:
        raise ConfigError(
            f"unknown attention backend {name!r}: use 'torch' (any device), 'triton' (GPU, or CPU under "
            "TRITON_INTERPRET=1) or 'cpu-hybrid' (the CPU's torch path with decode rows in C)",
            param="attention_backend",
        )
    return BACKENDS[name]

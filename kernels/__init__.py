"""Triton kernels for the paged KV cache, installed as ``lifeofprompt.kernels``.

Filled in by the kernels stage: ``store_kv`` and ``paged_attention`` with the signatures of
``lifeofprompt.paged_attention``. Triton is imported lazily, so the CPU path never needs it.
"""

"""Triton kernels for the paged KV cache, installed as ``lifeofprompt.kernels``.

``store_kv`` and ``paged_attention`` have exactly the signatures of the torch reference in
``lifeofprompt.model.paged_attention``; ``lifeofprompt.model.attention_backends.TritonAttention``
imports them from here, and ``lifeofprompt.model.layers`` its fused element-wise kernels. Outside
``model/`` only chapter 11's ``lessons/`` import this subpackage (``tests/test_layout.py`` checks it),
so the engine's CPU torch path never needs Triton.

Without CUDA they run in Triton's interpreter: ``triton_mode`` decides which before any kernel
module is imported. Run from a checkout, this folder also answers to the bare name ``kernels``,
which belongs to Hugging Face's package; ``name_clash`` hands that name over.
"""

if __name__ == "kernels":  # imported by the bare name from a checkout: not us (see name_clash.py)
    from .name_clash import load_hugging_face_kernels

    load_hugging_face_kernels()
else:
    # First, before any kernel module imports triton: it fixes the interpreter mode.
    from .triton_mode import INTERPRETED

    # isort: split
    from .paged_attention import paged_attention
    from .store_kv import store_kv

    __all__ = ["store_kv", "paged_attention", "INTERPRETED"]

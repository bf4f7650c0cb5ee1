"""A float copy of the layer matrices for big steps: prompt chunks and large batches (``big_step_weights``).

A decode step multiplies each weight by one row, so what it costs is reading the weight: the GGUF's
blocks, a sixth of fp32's bytes, win there. A prompt chunk of a few hundred rows multiplies each
weight by every row: reading is paid once and multiplying hundreds of times, and a CPU multiplies
floats many times faster than our kernels unpack blocks. Intel's AMX tiles take a 16 x 32 tile of
bf16 numbers a step, and oneDNN (torch's CPU matrix product for bf16) uses them; on a CPU without
them, fp32 BLAS may still beat unpacking. So, where it times faster and memory allows, each layer
matrix also keeps its dequantized weights in bf16 (or fp32), and steps of at least ``from_rows`` rows
read that copy while smaller steps keep the blocks. The LM head keeps its blocks: a step asks it for
the logits of a few rows only.

The copy holds the blocks' own values (bf16 rounds each to 8 bits of mantissa), and the rows are
rounded to bf16 going in; both stay within the project's accuracy rule
(``tests/test_big_step_weights.py``). It costs memory: 2 bytes a weight in bf16 (203 MiB for
SmolLM2-135M's layers), 4 in fp32, said in the start-up log.
"""

from __future__ import annotations

import torch

FORMS = {"bfloat16": torch.bfloat16, "float32": torch.float32}  # the copies a big step may read
ASKED_FROM_ROWS = 64  # asked for by name (not timed): steps of this many rows or more read the copy
MEMORY_SHARE = 0.25  # "auto" makes a copy only if it takes at most this share of the memory available


def copy_layers(model) -> list:
    """The block matrices that get a copy: every layer's four (``QuantizedLinear``s, known by their ``blocks``
    and ``big_step_copy``), not the LM head."""
    return [m for name, m in model.named_modules() if hasattr(m, "big_step_copy") and name != "lm_head"]


def make_copies(model, form: str, from_rows: int) -> int:
    """Give every layer matrix its weights in ``form`` ("bfloat16" or "float32"), read by steps of at least
    ``from_rows`` rows (``QuantizedLinear.forward``); returns the copies' bytes."""
    dtype = FORMS[form]
    for module in copy_layers(model):
        if module.big_step_copy is None or module.big_step_copy.dtype != dtype:
            module.big_step_copy = module.blocks.dequantize(dtype).contiguous()
        module.big_step_rows = from_rows
    return copies_bytes(model)


def drop_copies(model) -> None:
    """Every step back on the blocks, the copies freed."""
    for module in copy_layers(model):
        module.big_step_copy = None


def copies_bytes(model) -> int:
    copies = [m.big_step_copy for m in copy_layers(model) if m.big_step_copy is not None]
    return sum(t.numel() * t.element_size() for t in copies)


def copy_bytes(model, form: str) -> int:
    """What ``make_copies(model, form, ...)`` would take, before it is made."""
    size = FORMS[form].itemsize
    return sum(m.in_features * m.out_features * size for m in copy_layers(model))


def describe(model) -> str:
    """``"bfloat16 from 32 rows"``, or ``"none"``: the copies as a timing's cache key sees them."""
    layers = [m for m in copy_layers(model) if m.big_step_copy is not None]
    if not layers:
        return "none"
    return f"{str(layers[0].big_step_copy.dtype).removeprefix('torch.')} from {layers[0].big_step_rows} rows"


def available_memory() -> int | None:
    """The bytes this machine could still give (``MemAvailable`` of ``/proc/meminfo``), or None where unknown."""
    try:
        with open("/proc/meminfo") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def forms_that_fit(model, available: int | None) -> list[str]:
    """The forms whose copy takes at most ``MEMORY_SHARE`` of ``available`` bytes (all of them where unknown)."""
    if available is None:
        return list(FORMS)
    return [form for form in FORMS if copy_bytes(model, form) <= MEMORY_SHARE * available]

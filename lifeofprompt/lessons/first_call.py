"""Why one story prompt's first token took 845 ms on the H200 and the others 16 ms: a Triton compile.

Triton compiles a kernel the first time it is launched with a new *specialization* of its
arguments. Besides the ``tl.constexpr`` arguments, an integer argument equal to 1 becomes a
constant of its own compiled kernel, and one divisible by 16 is marked as aligned. The paged
attention kernel takes the block table's row stride (``stride_table_seq``): the width of the
step's block table, the most blocks any of its sequences holds. So a prefill whose sequences
all fit one block (width 1) runs a different compiled kernel from one with width 2.

The GPU run warmed up with the three story prompts *together* (the longest holds two 16-token
blocks: width 2), then timed each prompt *alone*. The first alone prompt was the first launch
with width 1, and paid the compile; the third, also width 1, found it compiled.
``compile_events`` replays that sequence on paper. A warm-up that runs each prompt alone as well as
together leaves no compile for a timed prompt.
"""

from __future__ import annotations

import math


def int_specialization(value: int) -> str:
    """Triton's key for an integer argument: ``"1"`` (a constant of its own kernel), ``"D"``
    (divisible by 16) or ``""``; Triton's own rule when Triton is installed."""
    try:
        from triton.backends.compiler import BaseBackend
        from triton.runtime.jit import native_specialize_impl
    except ImportError:  # the documented rule (triton/runtime/jit.py, specialize_impl)
        return "1" if value == 1 else "D" if value % 16 == 0 else ""
    kind, key = native_specialize_impl(BaseBackend, value, False, True, True)
    return "1" if kind == "constexpr" else key


def block_table_width(prompt_lens: list[int], block_size: int = 16) -> int:
    """The prefill step's block-table width: the most blocks any of its sequences holds."""
    return max(math.ceil(n / block_size) for n in prompt_lens)


def compile_events(steps: list[tuple[str, list[int]]], block_size: int = 16) -> list[dict]:
    """For each prefill step (a label and its prompts' lengths): the block-table width, Triton's
    key for it, and whether that key is new, i.e. whether this launch compiles."""
    seen, rows = set(), []
    for label, lens in steps:
        width = block_table_width(lens, block_size)
        key = int_specialization(width)
        rows.append(dict(step=label, prompt_lens=lens, width=width, key=key, compiles=key not in seen))
        seen.add(key)
    return rows

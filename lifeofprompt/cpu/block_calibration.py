"""Whether the embedded model's GGUF blocks decode faster here than its fp32 copy, and whether their products
are faster with integer activations (each timed once per machine).

The blocks read about a sixth of fp32's bytes, but each weight must be unpacked before it is
multiplied: where the CPU reads memory fast and computes slowly the fp32 step can still win. So
``quantization="auto"`` does not assume; it times the whole batch-1 decode step of both (the C step
of every layer and the LM head, over a short paged context), the fp32 one in its faster layout: the
runs (fp32 packed, fp32 row-major, the blocks, and the blocks with integer products where this CPU
has them) taking turns step by step so that load from elsewhere cannot favour one, and keeps the
answer with the other cached timings (``linear_calibration.cached_answer``).
``integer_products_faster`` times the blocks' two kinds of product alone, for a model loaded with blocks.
"""

from __future__ import annotations

import statistics
import time

import torch

TIMING_CONTEXT = 64  # tokens already in the sequence the timed step decodes after
TIMING_BLOCK = 16  # tokens per block of the timing's small pool
ROUNDS = 15  # timed steps per model (after two warm-ups); the median is kept
CALIBRATION_VERSION = 2  # 2: the blocks timed with integer products too
INTEGER_TURNS = 3  # runs of each kind of block product, in turns (integer_products_faster)


def one_row_step(model, context: int = TIMING_CONTEXT, block_size: int = TIMING_BLOCK):
    """``(input_ids, positions, meta)`` of one sequence decoding its token at position ``context``."""
    from ..model.attention import PagedKVCache, synthetic_step

    cache = PagedKVCache.for_model(model.config, context // block_size + 1, block_size, model.dtype, "cpu")
    return synthetic_step(model, cache, [context + 1], decode=True)


@torch.no_grad()
def interleaved_step_seconds(runs: list[tuple]) -> list[float]:
    """The median time of a batch-1 decode step, logits included, of each ``(model, way)`` in ``runs`` (way: a
    C step layout, or ``c_step.TORCH`` for the torch layers), with
    the weights in 2 MiB pages where the system has them, as the engine places them (``huge_pages.py``).

    The runs take turns round by round, so a burst of load from something else on a shared machine slows
    all of them alike instead of deciding the comparison on its own."""
    from .c_step import CStep, running
    from .huge_pages import move_weights_to_huge_pages

    for model, _ in runs:
        move_weights_to_huge_pages(model)
    inputs = [one_row_step(model) for model, _ in runs]
    times = [[] for _ in runs]
    for i in range(ROUNDS + 2):
        for (model, way), step_inputs, kept in zip(runs, inputs, times):
            start = time.perf_counter()
            with running(model, CStep.only(way)):
                model(*step_inputs)
            if i >= 2:
                kept.append(time.perf_counter() - start)
    return [statistics.median(kept) for kept in times]


def step_seconds(model, way: str) -> float:
    """The median time of one model's batch-1 decode step the ``way`` way (a C layout, or "torch")."""
    return interleaved_step_seconds([(model, way)])[0]


def fastest_float_step(model, others: tuple = ()) -> tuple[float, list[float]]:
    """The fp32 model's batch-1 step in the faster of the C step's layouts (packed copies made first), and the
    steps of ``others`` (``(model, way)`` pairs) timed in turn with it."""
    from . import c_step

    layouts = [(model, layout) for layout in c_step.C_LAYOUTS]
    c_step.pack_all(model)
    try:
        seconds = interleaved_step_seconds(layouts + list(others))
    finally:
        c_step.drop_packed(model)
    return min(seconds[:2]), seconds[2:]


def blocks_decode_faster(load) -> tuple[bool, str]:
    """``(faster, why)``: the embedded model's batch-1 step with its GGUF blocks against its fp32 copy.

    ``load(quantization)`` loads the embedded model with its blocks (``"gguf"``) or in fp32 (None); the
    loader passes it in, so this module does not import the loader that calls it. The blocks are timed
    with both kinds of product where this CPU has integer ones, and the faster stands for them."""
    from .c_step import PACKED, SOURCE, step_kernel
    from .interleaved_blocks import integer_on_offer, interleave_model
    from .linear_calibration import cached_verdict, machine_key
    from .native_build import source_digest

    if step_kernel() is None:
        return False, "no C compiler here, so no block kernels: fp32"

    key = dict(machine_key(), version=CALIBRATION_VERSION, what="smollm2 GGUF blocks vs fp32, batch-1 step")
    key["source"] = source_digest(SOURCE)  # the C step and the block kernels it includes: changed, timed again

    def measure():
        others = [(load("gguf"), PACKED)]
        if integer_on_offer(others[0][0]):
            integer = load("gguf")
            interleave_model(integer)
            others.append((integer, PACKED))
        floats, blocks = fastest_float_step(load(None), others=others)
        best = min(blocks)
        kinds = " and ".join(f"{s * 1e3:.1f} ms" for s in blocks)
        products = " (float, then integer products)" if len(blocks) > 1 else ""
        why = f"a batch-1 step took {kinds} with the GGUF's blocks{products}, {floats * 1e3:.1f} ms in fp32"
        return best < floats, why, dict(seconds=dict(blocks=blocks, float32=floats))

    return cached_verdict(key, measure)


def integer_products_faster(model, way: str) -> tuple[bool, str, dict]:
    """``(faster, why, record)``: a block model's batch-1 step (the C step ``way``, or ``c_step.TORCH``) with
    integer products against float ones, the re-laid copies made first (and freed after: the caller keeps
    or drops them by the answer, cached or not).

    The two take turns in runs of ``ROUNDS`` steps (``INTEGER_TURNS`` each), not step by step: switching
    rebuilds the C step's table of weight pointers (about 2 ms), which each run's two warm-up steps absorb."""
    from .interleaved_blocks import block_layers, drop_interleaved, interleave_model

    interleave_model(model)
    copies = {module: module.interleaved for module in block_layers(model)}
    seconds = {"integer": [], "float": []}
    for _ in range(INTEGER_TURNS):
        for kind in seconds:
            for module, copy in copies.items():
                module.interleaved = copy if kind == "integer" else None
            seconds[kind].append(step_seconds(model, way))
    drop_interleaved(model)
    integer, floats = (statistics.median(seconds[kind]) for kind in ("integer", "float"))
    why = f"a batch-1 step took {integer * 1e3:.2f} ms with integer products, {floats * 1e3:.2f} ms with float ones"
    return integer < floats, why, dict(seconds=seconds)

"""Whether the embedded model's GGUF blocks decode faster here than its fp32 copy, and whether their products
are faster with integer activations (each timed once per machine).

The blocks read about a sixth of fp32's bytes, but each weight must be unpacked before it is
multiplied: where the CPU reads memory fast and computes slowly the fp32 step can still win. So
``quantization="auto"`` does not assume; it times the whole batch-1 decode step of both (the C step
of every layer and the LM head, over a short paged context), the fp32 one in its faster layout: the
runs (fp32 packed, fp32 row-major, the blocks, and the blocks with integer products where this CPU
has them) taking turns step by step so that load from elsewhere cannot favour one, and keeps the
answer with the other cached timings (``linear_calibration.cached_answer``).
``integer_products_faster`` times the blocks' two kinds of product alone, for a model loaded with blocks;
``big_step_choice`` times prompt chunks of several sizes from the blocks and from float copies of them.
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
BIG_STEP_ROWS = (16, 32, 64, 128, 256)  # prompt chunks timed from the blocks and from each copy (big_step_choice)
BIG_STEP_ROUNDS = 3  # timed rounds of every chunk each way (after one warm-up round); the median is kept


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


@torch.no_grad()
def big_step_choice(model, forms: list[str], cache) -> tuple[dict, str, dict]:
    """``(answer, why, record)``: which copy of the layer matrices, if any, big steps should read
    (``cpu/big_step_weights.py``), and from how many rows. One prompt chunk of each of ``BIG_STEP_ROWS``
    tokens, through the torch layers (where every step too big for the C step runs) over ``cache``, from the
    blocks and from each of ``forms``, chunk by chunk in turns. The copy fastest at the biggest chunk wins if
    it beats the blocks there; it is read from the smallest chunk from which it beats them at every size.
    ``answer``: ``{"form": None or a form, "from_rows": rows}``. The copies are freed after."""
    from ..model.attention import synthetic_step
    from .big_step_weights import copy_layers, drop_copies, make_copies
    from .c_step import running

    modules = copy_layers(model)
    copies = {}
    for form in forms:
        make_copies(model, form, from_rows=1)
        copies[form] = [m.big_step_copy for m in modules]
        drop_copies(model)
    steps = {rows: synthetic_step(model, cache, [rows]) for rows in BIG_STEP_ROWS}
    seconds = {way: {rows: [] for rows in BIG_STEP_ROWS} for way in ["blocks", *forms]}
    with running(model, None):
        for round_ in range(BIG_STEP_ROUNDS + 1):
            for rows, step in steps.items():
                for way, kept in seconds.items():
                    for i, module in enumerate(modules):
                        module.big_step_copy = copies[way][i] if way in copies else None
                    start = time.perf_counter()
                    model(*step)
                    if round_:
                        kept[rows].append(time.perf_counter() - start)
    drop_copies(model)
    medians = {way: {rows: statistics.median(s) for rows, s in by_rows.items()} for way, by_rows in seconds.items()}
    return big_step_verdict(medians), big_step_why(medians), dict(seconds=seconds)


def big_step_verdict(medians: dict) -> dict:
    """The answer of ``big_step_choice`` from its median seconds, ``{way: {rows: seconds}}`` ("blocks" a way)."""
    blocks, biggest = medians["blocks"], max(BIG_STEP_ROWS)
    forms = [way for way in medians if way != "blocks"]
    best = min(forms, key=lambda form: medians[form][biggest], default=None)
    if best is None or medians[best][biggest] >= blocks[biggest]:
        return {"form": None, "from_rows": None}
    from_rows = biggest
    for rows in sorted(BIG_STEP_ROWS, reverse=True):
        if medians[best][rows] >= blocks[rows]:
            break
        from_rows = rows
    return {"form": best, "from_rows": from_rows}


def big_step_why(medians: dict) -> str:
    """``"a 256-row step took 190.2 ms from the blocks, 71.3 from a bfloat16 copy, ..."``."""
    biggest = max(BIG_STEP_ROWS)
    ways = ", ".join(f"{medians[way][biggest] * 1e3:.1f} from a {way} copy" for way in medians if way != "blocks")
    return f"a {biggest}-row step took {medians['blocks'][biggest] * 1e3:.1f} ms from the blocks, {ways}"

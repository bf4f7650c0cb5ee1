"""A whole decode step in one C call (``c_step.c``): the CPU's fused decode path.

The torch forward (``llama.py``) is the reference and runs every step that is not this one.
At batch 1 it spends about 0.3 ms a layer outside the matrix products, in dozens of tiny eager
ops; that is a quarter of SmolLM2's step (``benchmarks/NOTES.md``). ``decode_hidden_states``
does the same layers for a batch of one-token decode rows in C, reading each weight row once,
front to back, as the ``rowwise`` product path does. The engine uses it for steps of up to as
many rows as it measured the whole C step faster than the torch forward on this machine
(``measured_rows``, cached); with the products pinned (tests), where ``rowwise`` is every layer
matrix's plan (``usable_rows``), so no timing moves a token.

It serves Llama models with fp32 activations on the CPU, the engine's paged KV pool and steps of
a few rows: one-token decodes, the k + 1 rows of a speculative verify, a short prefill chunk,
mixed as the scheduler sends them. Larger steps go the torch way. Each layer matrix is read in its
own format (``block_kernels.h``'s ``WeightMatrix``): fp32, from a packed copy or row-major, or GGUF
blocks (``QuantizedLinear``: Q8_0 or Q4_1, unpacked in registers, no float copy made). Its
numbers equal the torch forward's up to fp32 summation order (tests/test_cpu_decode.py).
"""

from __future__ import annotations

import ctypes
import functools
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from .native_build import c_function

SOURCE = Path(__file__).with_name("c_step.c")


class Dims(ctypes.Structure):
    """The ``Dims`` struct of ``c_step.c``: the model's shape and the step's pool."""

    _fields_ = [
        (name, ctypes.c_long)
        for name in (
            "hidden",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate",
            "num_layers",
            "num_blocks",
            "block_size",
            "max_blocks",
        )
    ] + [("eps", ctypes.c_float), ("scale", ctypes.c_float), ("kv_format", ctypes.c_long)]


KV_FORMATS = {"auto": 0, "q8_0": 1}  # c_step.c's KV_F32, KV_Q8_0: the pools the C paths read


class Matrix(ctypes.Structure):
    """``WeightMatrix`` of ``block_kernels.h``: one layer matrix, its format and the planes it is read from."""

    _fields_ = [
        ("format", ctypes.c_int64),
        ("data", ctypes.c_void_p),
        ("scales", ctypes.c_void_p),
        ("mins", ctypes.c_void_p),
    ]


MATRICES = ("qkv", "o", "gate_up", "down")  # a layer's four matrices, in the order of ``Layer``


class Layer(ctypes.Structure):
    """``Layer`` of ``c_step.c``: one layer's two norms and four matrices."""

    _fields_ = [("in_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p)] + [(name, Matrix) for name in MATRICES]


# ``block_kernels.h``'s formats: fp32 row-major, fp32 packed (panels, ``row_kernels.h``), GGUF blocks.
FORMAT_CODES = {"fp32": 0, "fp32-packed": 1, "q8_0": 2, "q4_1": 3, "q8_0-x16": 4, "q4_1-x16": 5}
BLOCK_FORMATS = ("q8_0", "q4_1")
BLOCK = 32  # weights per block (block_formats.BLOCK)
DIGIT_FLOATS_PER_BLOCK = 19  # integer_kernels.h's digits of a block of x: 2 x 32 bytes and 3 numbers of 4 bytes


@functools.cache
def step_kernel():
    """The compiled ``decode_step`` function, or None where it cannot be built here."""
    return c_function(
        SOURCE,
        "decode_step",
        [ctypes.POINTER(Dims)]
        + [ctypes.c_void_p] * 3
        + [ctypes.c_long]
        + [ctypes.c_void_p] * 13
        + [ctypes.c_long, ctypes.c_int],
    )


@functools.cache
def packed_layout() -> tuple[int, int] | None:
    """``(weight rows per panel, floats per vector)`` of the packed weights this build reads (``row_kernels.h``)."""
    rows, lanes = (c_function(SOURCE, name, [], ctypes.c_long) for name in ("packed_rows", "packed_lanes"))
    return (rows(), lanes()) if rows is not None and lanes is not None else None


def supports(model) -> bool:
    """Whether ``model`` can run this path: fp32 activations on the CPU, every layer matrix fp32 or
    Q8_0/Q4_1 blocks, every tensor contiguous, and the kernel built."""
    if model.device.type != "cpu" or model.dtype != torch.float32:
        return False
    if any(not t.is_contiguous() for t in (*model.parameters(), *model.buffers())):
        return False
    if any(matrix_format(module) is None for layer in layer_matrices(model) for module in layer.values()):
        return False
    return step_kernel() is not None and packed_layout() is not None


def layer_matrices(model) -> list[dict[str, nn.Module]]:
    """Per layer, its four matrices' modules by name (``MATRICES``), read from the modules' own tables: every
    step asks (``step_tensors``), and attribute access through ``nn.Module`` is slow."""
    matrices = []
    for layer in model.layers:
        attn, mlp = layer._modules["self_attn"]._modules, layer._modules["mlp"]._modules
        matrices.append(
            {"qkv": attn["qkv_proj"], "o": attn["o_proj"], "gate_up": mlp["gate_up_proj"], "down": mlp["down_proj"]}
        )
    return matrices


def is_blocks(module: nn.Module) -> bool:
    """Whether a layer matrix is kept as GGUF blocks (``QuantizedLinear``), not as an fp32 weight."""
    return getattr(module, "quants", None) is not None


def matrix_format(module: nn.Module) -> str | None:
    """``"q8_0"``/``"q4_1"`` for blocks, ``"fp32"`` for an fp32 weight; None for what the step cannot read."""
    if is_blocks(module):
        return module.format if module.format in BLOCK_FORMATS else None
    weight = getattr(module, "weight", None)
    return "fp32" if weight is not None and weight.dtype == torch.float32 else None


def matrix_formats(model) -> dict[str, str]:
    """Each matrix name's format across the layers (``"q4_1"``, or e.g. ``"fp32,q8_0"`` where layers differ)."""
    layers = layer_matrices(model)
    return {name: ",".join(sorted({str(matrix_format(layer[name])) for layer in layers})) for name in MATRICES}


def packable(model) -> dict[str, bool]:
    """Which layer matrices the packed layout can hold: fp32 ones (blocks are read as they are)
    whose every row range the C step takes (a head of qkv, a panel of the others, the up half at
    row I) starts at a whole panel. The layout puts no condition on the columns."""
    panel_rows, _ = packed_layout()
    config = model.config
    hidden, inter, head_dim = config.hidden_size, config.intermediate_size, config.head_dim
    shapes_fit = {
        "qkv": head_dim % panel_rows == 0,
        "o": hidden % panel_rows == 0,
        "gate_up": inter % panel_rows == 0,
        "down": hidden % panel_rows == 0,
    }
    layers = layer_matrices(model)
    return {name: fits and not any(is_blocks(layer[name]) for layer in layers) for name, fits in shapes_fit.items()}


# A row count takes the C step when, for every layer shape, the rowwise product measured within
# this fraction of the fastest path: two paths that close are within timing noise of each other
# (one calibration picked `transposed` for one shape at two rows by 2%), and the C step also
# saves the eager ops between the products, worth more than that at these sizes.
ROWWISE_SLACK = 0.15


def rowwise_close_enough(plan, timings: dict | None, rows: int) -> bool:
    """Whether ``rowwise`` is this shape's choice at ``rows``, or measured within ``ROWWISE_SLACK`` of it."""
    if plan.path_for(rows) == "rowwise":
        return True
    measured = {int(r): t for r, t in (timings or {}).items() if int(r) <= rows}
    if not measured:
        return False
    times = measured[max(measured)]  # the row count the plan took its choice from
    return "rowwise" in times and times["rowwise"] <= (1 + ROWWISE_SLACK) * min(times.values())


def usable_rows(plans: dict | None, shapes, timings: dict | None = None) -> int:
    """Up to how many rows a step runs as one C call: while ``rowwise`` is every layer shape's choice (or close).

    ``plans`` are the calibrated (or pinned) ``RowPlan`` per weight shape; ``shapes`` the
    layers' weight shapes (the LM head, which the caller runs, is not among them); ``timings``
    the calibration's measurements (``LinearChoice.timings``: ``"OxI" -> {rows: {path: s}}``).
    """
    if not plans:
        return 0
    timings = timings or {}
    rows = 0
    while rows < 16 and all(
        rowwise_close_enough(plans[s], timings.get(f"{s[0]}x{s[1]}"), rows + 1) for s in shapes if s in plans
    ):
        rows += 1
    return rows


# Row counts whose whole step the runner times both ways at start-up, in order; the C step takes
# every step up to the largest count where it won and all smaller counts won too.
STEP_ROW_COUNTS = (1, 2, 4, 8, 16, 32, 64)
# Once per machine (the answer is cached). 3 s ran out after 8 rows on a slow CPU (a 2-core AVX2 EPYC
# at 1 thread, whose 8-row round takes 0.4-0.45 s), where the C step was still 1.4-1.7x faster than
# torch at 16-32 rows; a batched workload's decode steps have as many rows as requests running, so
# those steps went through torch. The same VM runs a third slower at some hours than at others; 10 s
# reaches 32 rows at its slower pace. A faster CPU finishes the counts sooner.
STEP_BUDGET_S = 10.0
# A measurement the budget stopped before this many rows is used but not cached: on an idle machine
# the budget reaches far past it, so stopping this early says more about the load of the moment
# than about the machine (and would cap speculative verifies, which need k + 1 rows, for good).
MIN_CACHED_ROWS = 8
# A C layout this much slower than the other at one count is not timed at larger ones: the gap
# between the layouts grows with the rows (each row-major weight row is reloaded per tile of x).
LAYOUT_SLACK = 0.25
# Counts whose steps take longer than this (forecast from the count before) get one round fewer:
# a long step varies less, relative to its length, than a short one.
LONG_STEP_S = 0.05
# ... and counts whose steps take under this, two rounds more: the shortest steps vary the most,
# and the one-row step is batch-1 decoding, the step a lone request runs all the time.
SHORT_STEP_S = 0.03


# The C step reads the layer matrices in one of two layouts (``PACKED``: its packed copies, panels of
# ``row_kernels.h``; ``ROW_MAJOR``: the weights as they are). Which is faster depends on the row count
# and the machine, so the engine times both (``measured_rows``) against the torch layers (``TORCH``).
PACKED, ROW_MAJOR, TORCH = "packed", "row-major", "torch"
C_LAYOUTS = (PACKED, ROW_MAJOR)


class CStep:
    """The model's layers in one C call, for steps of up to ``max_rows`` rows; the model holds it as
    ``model.cpu_step`` (None: every step runs the torch layers), and its ``hidden_states`` asks it first.

    ``layouts`` maps a measured row count to the layout measured faster there; a step takes that of the
    largest measured count at or below its rows (``unmeasured`` below every measured count)."""

    def __init__(self, max_rows: int, layouts: dict | None = None, unmeasured: str = PACKED):
        self.max_rows, self.unmeasured = max_rows, unmeasured
        self.layouts = {int(n): layout for n, layout in (layouts or {}).items()}

    @classmethod
    def only(cls, layout: str, max_rows: int = 1 << 30) -> CStep | None:
        """Every step one way (``TORCH``: None, no C step), as the start-up's timings run them."""
        return None if layout == TORCH else cls(max_rows, unmeasured=layout)

    def takes(self, rows: int) -> bool:
        return 0 < rows <= self.max_rows

    def layout_for(self, rows: int) -> str:
        measured = [n for n in self.layouts if n <= rows]
        return self.layouts[max(measured)] if measured else self.unmeasured

    def hidden_states(self, model, input_ids: torch.Tensor, positions: torch.Tensor, meta, layout: str) -> torch.Tensor:
        """The step in one C call, in ``layout`` (``layout_for`` the step's rows, which the model notes)."""
        return decode_hidden_states(model, input_ids, positions, meta, layout == PACKED)

    def __repr__(self) -> str:
        return f"CStep(max_rows={self.max_rows}, layouts={self.layouts}, unmeasured={self.unmeasured!r})"


@contextmanager
def running(model, step: CStep | None):
    """Run ``model`` with ``step`` as its C step for a while (timings, tests), then put its own back."""
    own = model.cpu_step
    model.cpu_step = step
    try:
        yield model
    finally:
        model.cpu_step = own


def measured_rows(
    measure, row_counts=STEP_ROW_COUNTS, rounds: int = 3, budget_s: float = STEP_BUDGET_S, c_paths=C_LAYOUTS
) -> tuple[dict, str]:
    """Up to how many rows the C step is faster than the torch forward, timing whole steps, and which
    of its layouts (``c_paths``) is faster at each count.

    A product measured alone does not decide it: at 8 rows oneDNN multiplies faster than the
    rowwise loop, yet the C step also skips the ~40 eager ops a layer around the products, and
    on the AMD EPYC this was written on that won whole steps of up to 4-8 rows. So each row
    count runs ``measure(rows, way) -> seconds`` (one forward; ``way`` is one of ``c_paths``
    or ``TORCH``) alternately, fastest of ``rounds`` (``RowTiming``). Counts go up
    ``row_counts`` until the C step loses; the gap between the last win and that loss is then
    halved until it closes (a verify of k = 4 drafts is 5 rows: it should not go eager because 4
    won and 8 lost). Timing stops before a count whose forecast would overrun ``budget_s``.

    Returns ``({"rows": limit, "layouts": {count: fastest c_path}, "seconds": {count: the C step's
    time in it}, "stopped_before": the count the budget stopped at, or None}, why)``; ``why`` says
    every count measured.
    """
    timing = RowTiming(measure, rounds, budget_s, list(c_paths))
    rows, lost = 0, None
    for count in row_counts:
        won = timing.c_wins(count)
        if won is None:
            break
        if not won:
            lost = count
            break
        rows = count
    while lost is not None and lost - rows > 1:  # the crossover lies between rows and lost
        middle = (rows + lost) // 2
        won = timing.c_wins(middle)
        if won is None:
            break
        rows, lost = (middle, lost) if won else (rows, middle)
    return timing.answer(rows)


class RowTiming:
    """The counts ``measured_rows`` timed so far, and how the next one is timed.

    The first count warms every path up first (first-call set-up). A layout more than
    ``LAYOUT_SLACK`` slower than the other is dropped for larger counts; a count whose steps are
    forecast to take over ``LONG_STEP_S`` is timed one round fewer, and the first count and steps
    under ``SHORT_STEP_S`` two rounds more.
    """

    def __init__(self, measure, rounds: int, budget_s: float, layouts: list):
        self.measure, self.rounds, self.budget_s, self.layouts_left = measure, rounds, budget_s, layouts
        self.deadline = time.perf_counter() + budget_s
        self.results: dict[int, dict] = {}
        self.notes: list[str] = []
        self.stopped: int | None = None

    def forecast(self, count: int) -> float:
        """Seconds of one round at ``count`` rows (every path still timed): each path's line through the
        two largest counts measured, never below the largest; from one count, halfway between flat and
        proportional. A step of a few rows costs about what one row does (all read the same weights), so
        scaling by the rows alone forecast a 2-row step at twice a 1-row one, and on a slow CPU that
        stopped the timing at 1 row."""
        if not self.results:
            return 0.0
        measured = sorted(self.results)
        last = measured[-1]
        total = 0.0
        for path in (*self.layouts_left, TORCH):
            latest = self.results[last][path]
            if len(measured) > 1 and path in self.results[measured[-2]]:
                before = measured[-2]
                slope = (latest - self.results[before][path]) / (last - before)
                total += max(latest, latest + slope * (count - last))
            else:
                total += latest * max(1.0, (1 + count / last) / 2)
        return total

    def c_wins(self, count: int) -> bool | None:
        """Time ``count`` rows every way still in play; whether the C step won (None: out of budget)."""
        one_round = self.forecast(count)
        per_step = one_round / (len(self.layouts_left) + 1)
        rounds = self.rounds + 2 if per_step < SHORT_STEP_S else self.rounds
        if per_step >= SHORT_STEP_S and self.rounds > 1 and per_step > LONG_STEP_S:
            rounds = self.rounds - 1
        if time.perf_counter() + rounds * one_round > self.deadline:
            self.notes.append(f"stopped before {count} rows: the {self.budget_s:.0f} s budget would be spent")
            self.stopped = count
            return None
        paths = (*self.layouts_left, TORCH)
        best = {path: float("inf") for path in paths}
        if not self.results:
            for path in paths:  # warm-up: first-call set-up of each path
                self.measure(count, path)
        for _ in range(rounds):
            for path in paths:
                best[path] = min(best[path], self.measure(count, path))
        self.results[count] = best
        fastest = min(best[p] for p in self.layouts_left)
        self.layouts_left[:] = [p for p in self.layouts_left if best[p] <= (1 + LAYOUT_SLACK) * fastest]
        return fastest <= best[TORCH]

    def answer(self, rows: int) -> tuple[dict, str]:
        results = sorted(self.results.items())
        layouts = {n: min((p for p in t if p != TORCH), key=t.get) for n, t in results}
        seconds = {n: self.results[n][layout] for n, layout in layouts.items()}
        why = "; ".join([describe_count(n, t) for n, t in results] + self.notes)
        return {"rows": rows, "layouts": layouts, "seconds": seconds, "stopped_before": self.stopped}, why


def describe_count(rows: int, times: dict) -> str:
    """One count's timings for the start-up log, e.g. ``4 rows: C 35.0 ms (row-major 37.5), torch 81.0 ms``."""
    c = times[PACKED] if PACKED in times else min(t for p, t in times.items() if p != TORCH)
    other = times.get(ROW_MAJOR)
    return (
        f"{rows} row{'s' if rows > 1 else ''}: C {c * 1e3:.1f} ms"
        + (f" (row-major {other * 1e3:.1f})" if other is not None else "")
        + f", torch {times[TORCH] * 1e3:.1f} ms"
    )


def measured_step_key(model, plans: dict, block_size: int, decode_attention_in_c: bool) -> dict:
    """What the C step's measured row limit depends on: the machine, the model's shape and its
    matrices' formats (fp32 or blocks), the products' plans (the torch step's speed), the
    attention path and both C sources (with the headers they include)."""
    from .linear_calibration import machine_key
    from .native_build import source_digest

    config = model.config
    return dict(
        machine_key(),
        version=9,
        what="whole decode steps: the C step (panels and row-major) against the torch forward",
        dtype=str(model.dtype),
        formats=matrix_formats(model),
        layers=config.num_layers,
        vocab=config.vocab_size,
        heads=[config.num_heads, config.num_kv_heads, config.head_dim],
        block_size=block_size,
        plans={f"{o}x{i}": p.describe() for (o, i), p in sorted(plans.items())},
        decode_attention_in_c=decode_attention_in_c,
        source=source_digest(SOURCE),
    )


def layer_shapes(model) -> set[tuple[int, int]]:
    """The weight shapes ``(out, in)`` the fused step multiplies (every layer's four matrices)."""
    return {(m.out_features, m.in_features) for m in layer_matrices(model)[0].values()}


def pack(weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``weight [out, in]`` in the packed layout of ``row_kernels.h``: panels of ``panel_rows`` rows,
    each stored column by column (one read stream; each weight vector serves a whole tile of x).
    Into ``out`` (the same number of floats) where given, e.g. a view of a huge-page buffer."""
    panel_rows, _ = packed_layout()
    rows, inner = weight.shape
    panels = weight.detach().reshape(rows // panel_rows, panel_rows, inner).transpose(1, 2)
    if out is None:
        return panels.contiguous().reshape(rows, inner)
    out.view(rows // panel_rows, inner, panel_rows).copy_(panels)
    return out.view(rows, inner)


def layer_tensors(model) -> list[tuple[torch.Tensor, nn.Module | None]]:
    """Every tensor of the layers that ``c_step.c`` reads, each with its module where it is an
    fp32 matrix to be read packed (None otherwise: a norm, a row-major weight, a block plane)."""
    ok = packable(model)
    tensors = []
    for layer, matrices in zip(model.layers, layer_matrices(model)):
        tensors += [(layer.input_layernorm.weight, None), (layer.post_attention_layernorm.weight, None)]
        for name, module in matrices.items():
            if is_blocks(module):
                tensors += [(t, None) for t in module.blocks.tensors()]
                if module.interleaved is not None:  # re-laid for integer products (interleaved_blocks.py)
                    tensors += [(t, None) for t in module.interleaved.tensors()]
            else:
                tensors.append((module.weight, module if ok[name] else None))
    return tensors


def weight_stamp(tensor: torch.Tensor) -> tuple[int, int]:
    """Where a tensor lives and how often it was written in place: a copy made under another stamp is stale."""
    return tensor.data_ptr(), tensor._version


def packed_weight(module: nn.Module) -> torch.Tensor:
    """``module``'s weight in the packed layout, kept on the module: made once, and again whenever
    the weight moves or is written in place (its address or version changes), so the C step never
    reads a stale copy. A draft that shares the target's layers shares their copies too."""
    weight = module.weight
    stamp = weight_stamp(weight)
    cached = getattr(module, "_c_step_packed", None)
    if cached is None or cached[0] != stamp:
        with torch.no_grad():
            cached = (stamp, pack(weight))
        module._c_step_packed = cached
    return cached[1]


def pack_all(model) -> int:
    """Make every packed copy now, in one buffer of 2 MiB pages where the system gives them
    (``huge_pages.py``: the row-major weights live in such pages, and one core reads them about a
    quarter faster there); returns the bytes packed. A second call while every copy is current does
    nothing. A copy made later, for a weight changed in place, goes to ordinary memory (``packed_weight``)."""
    from .huge_pages import ALIGN, huge_page_buffer, huge_pages_available

    modules = list({id(m): m for _, m in layer_tensors(model) if m is not None}.values())
    stamps = [weight_stamp(m.weight) for m in modules]
    if stamps and model.__dict__.get("_c_step_packed_all") == stamps:
        return sum(m.weight.numel() * m.weight.element_size() for m in modules)  # made here already, still current
    model._c_step_packed_all = stamps
    if not modules or not huge_pages_available():
        return sum(packed_weight(m).numel() * 4 for m in modules)
    sizes = [m.weight.numel() * m.weight.element_size() for m in modules]
    buffer = huge_page_buffer(sum(-(-n // ALIGN) * ALIGN for n in sizes))
    offset = 0
    with torch.no_grad():
        for module, size in zip(modules, sizes):
            view = buffer[offset : offset + size].view(torch.float32)
            module._c_step_packed = (weight_stamp(module.weight), pack(module.weight, out=view))
            offset += -(-size // ALIGN) * ALIGN
    model.__dict__.get("_c_step_pointers", {}).pop(True, None)  # pointers to older copies
    return sum(sizes)


class PointerCache(dict):
    """The ``Layer`` arrays ``weight_pointers`` made, by ``packed``. A copy of the model (``copy.deepcopy``,
    pickling) starts without them: they point into the original's tensors, and ctypes will not copy
    pointers anyway."""

    def __deepcopy__(self, memo):
        return PointerCache()

    def __reduce__(self):
        return PointerCache, ()


def step_tensors(model) -> list[tuple[torch.Tensor, nn.Module | None]]:
    """``layer_tensors``, kept on the model while its layer matrices stay the same modules (a model
    quantized after a C step, ``quantize_model``, has new ones) and keep their re-laid copies or none."""
    matrices = [module for layer in layer_matrices(model) for module in layer.values()]
    # the modules, and their re-laid copies or none (other tensors to read)
    modules = [id(m) for m in matrices] + [id(m.__dict__.get("interleaved")) for m in matrices]
    cached = model.__dict__.get("_c_step_tensors")
    if cached is None or cached[0] != modules:
        cached = model._c_step_tensors = (modules, layer_tensors(model))
    return cached[1]


def matrix_pointers(module: nn.Module, packed: bool, packable_here: bool) -> tuple[Matrix, list[torch.Tensor]]:
    """One layer matrix as ``block_kernels.h`` reads it, and the tensors it points into (kept alive)."""
    if is_blocks(module):
        planes, code = module.blocks, FORMAT_CODES[module.format]
        if module.interleaved is not None:  # re-laid in groups of 16 rows: integer products
            planes, code = module.interleaved, FORMAT_CODES[f"{module.format}-x16"]
        mins = planes.mins.data_ptr() if planes.mins is not None else None
        matrix = Matrix(code, planes.quants.data_ptr(), planes.scales.data_ptr(), mins)
        return matrix, planes.tensors()
    if packed and packable_here:
        copy = packed_weight(module)
        return Matrix(FORMAT_CODES["fp32-packed"], copy.data_ptr(), None, None), [copy]
    return Matrix(FORMAT_CODES["fp32"], module.weight.data_ptr(), None, None), [module.weight]


def weight_pointers(model, packed: bool = True) -> ctypes.Array:
    """The per-layer ``Layer`` structs ``c_step.c`` reads: the norms, and each matrix in its format
    (fp32 from its packed copy where the layout holds it, unless ``packed`` is False; else row-major;
    or its blocks).

    Called every step, so the answer is kept on the model with a stamp of every tensor's address, and the
    version of each weight read through a packed copy: a step then costs one pass over a few hundred
    integers, not a rebuild (which cost ~2 ms).
    """
    tensors = step_tensors(model)
    # every tensor's address (one replaced, or given new memory, is read from elsewhere), and the version of
    # those read through a packed copy (one written in place needs a new copy; the others are read in place)
    stamp = [t.data_ptr() for t, _ in tensors] + [t._version for t, module in tensors if module is not None]
    cached = getattr(model, "_c_step_pointers", {}).get(packed)
    if cached is not None and cached[0] == stamp:
        return cached[1]
    ok, layers, kept = packable(model), [], []
    for layer, matrices in zip(model.layers, layer_matrices(model)):
        norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
        described = {name: matrix_pointers(module, packed, ok[name]) for name, module in matrices.items()}
        layers.append(Layer(*(t.data_ptr() for t in norms), *(matrix for matrix, _ in described.values())))
        kept += [*norms, *(t for _, held in described.values() for t in held)]
    pointers = (Layer * len(layers))(*layers)
    model.__dict__.setdefault("_c_step_pointers", PointerCache())[packed] = (stamp, pointers, kept)
    return pointers


def drop_packed(model) -> None:
    """Free the packed copies (a runner that measured the row-major layout faster at every count)."""
    model.__dict__.pop("_c_step_packed_all", None)
    for _, module in layer_tensors(model):
        if module is not None:
            module.__dict__.pop("_c_step_packed", None)
    model.__dict__.get("_c_step_pointers", {}).pop(True, None)


def packed_bytes(model) -> int:
    """Bytes of the C step's packed copies of the layer matrices."""
    return sum(t.numel() * t.element_size() for t, module in layer_tensors(model) if module is not None)


def rows_of_step(meta, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query row's block table and context length (``[m, max_blocks]``, ``[m]``), as ``c_step.c`` reads them.

    A row at position ``p`` of its sequence attends to that sequence's tokens ``0 .. p``: for a
    one-token decode that is the whole sequence, for the rows of a verify or a prefill chunk
    a causal prefix, found through the same block table.
    """
    query_lens = (meta.query_start_loc[1:] - meta.query_start_loc[:-1]).long()
    seq_of_row = torch.repeat_interleave(torch.arange(query_lens.numel()), query_lens)
    block_tables = meta.block_tables.to(torch.int32)[seq_of_row].contiguous()
    context_lens = torch.where(meta.slot_mapping >= 0, positions + 1, 0)  # a padding row sees nothing
    return block_tables, context_lens.to(torch.int32).contiguous()


def decode_hidden_states(
    model, input_ids: torch.Tensor, positions: torch.Tensor, meta, packed: bool = True
) -> torch.Tensor:
    """Final normalised hidden states ``[m, hidden]`` of a small step (``meta``: ``PagedCacheMetadata``; any rows);
    ``packed``: read the packed copies of fp32 matrices where the layout holds them (else the row-major
    weights); block matrices are read as blocks either way."""
    config, attn = model.config, model.layers[0].self_attn
    m = input_ids.shape[0]
    kv = meta.cache.kv
    block_tables, seq_lens = rows_of_step(meta, positions)
    dims = Dims(
        config.hidden_size,
        config.num_heads,
        config.num_kv_heads,
        config.head_dim,
        config.intermediate_size,
        config.num_layers,
        meta.cache.num_blocks,
        meta.cache.block_size,
        block_tables.shape[1],
        model.norm.eps,
        meta.scale if meta.scale is not None else config.head_dim**-0.5,
        KV_FORMATS[meta.cache.kv_dtype],
    )
    pointers = weight_pointers(model, packed)  # kept alive until the call returns
    hidden = model.embed_tokens(input_ids).contiguous()
    positions = positions.to(torch.int64).contiguous()
    slots = meta.slot_mapping.to(torch.int64).contiguous()
    empty = functools.partial(torch.empty, dtype=torch.float32)
    threads = torch.get_num_threads()
    blocks = -(-max(config.hidden_size, attn.q_size, config.intermediate_size) // BLOCK)
    room = m * blocks * BLOCK + m * blocks * DIGIT_FLOATS_PER_BLOCK
    scratch = [
        empty(threads, m, config.hidden_size),
        empty(m, attn.q_size + 2 * attn.kv_size),
        empty(m, attn.q_size),
        empty(m, config.intermediate_size),
        empty(threads, room),  # each thread's copy of a block product's input in whole blocks, then its digits
    ]
    step_kernel()(
        ctypes.byref(dims),
        ctypes.addressof(pointers),
        model.norm.weight.data_ptr(),
        hidden.data_ptr(),
        m,
        positions.data_ptr(),
        slots.data_ptr(),
        block_tables.data_ptr(),
        seq_lens.data_ptr(),
        kv.data_ptr(),
        meta.cache.scales.data_ptr() if meta.cache.scales is not None else None,
        model.rotary.cos.data_ptr(),
        model.rotary.sin.data_ptr(),
        *(t.data_ptr() for t in scratch),
        room,
        threads,
    )
    return hidden


@functools.cache
def attention_kernel():
    """The compiled ``decode_attention`` function, or None where it cannot be built here."""
    return c_function(
        SOURCE, "decode_attention", [ctypes.POINTER(Dims)] + [ctypes.c_void_p] * 8 + [ctypes.c_long, ctypes.c_int]
    )


def decode_attention(
    query: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention of one query row per sequence ``[m, heads, D]`` over its keys in the paged pool, by block table;
    the pools fp32 tensors or q8_0 ``BlockPool``s (``model/kv_cache_formats.py``)."""
    m, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, _ = k_pool.shape
    block_tables = block_tables.to(torch.int32).contiguous()
    seq_lens = seq_lens.to(torch.int32).contiguous()
    dims = Dims(
        num_heads * head_dim,
        num_heads,
        num_kv_heads,
        head_dim,
        0,
        0,
        num_blocks,
        block_size,
        block_tables.shape[1],
        0.0,
        scale,
        KV_FORMATS[getattr(k_pool, "kind", "auto")],
    )
    query = query.contiguous()
    out = torch.empty_like(query)
    codes = [getattr(pool, "codes", pool).data_ptr() for pool in (k_pool, v_pool)]
    scales = [pool.scales.data_ptr() if hasattr(pool, "scales") else None for pool in (k_pool, v_pool)]
    attention_kernel()(
        ctypes.byref(dims),
        query.data_ptr(),
        *codes,
        *scales,
        block_tables.data_ptr(),
        seq_lens.data_ptr(),
        out.data_ptr(),
        m,
        torch.get_num_threads(),
    )
    return out


def decode_attention_faster(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> tuple[bool, str]:
    """Whether ``decode_attention`` beats the torch path (gather + SDPA) here, timed once per machine and cached.

    Timed on 16 sequences of 256 cached tokens in scattered blocks, alternating the two, best
    of several rounds: the kind of decode group a busy engine step holds.
    """
    from ..model.paged_attention import AttentionPlan, paged_attention
    from .linear_calibration import cached_verdict, machine_key

    key = dict(
        machine_key(),
        version=1,
        what="decode attention: C against gather + SDPA",
        heads=[num_heads, num_kv_heads, head_dim],
        block_size=block_size,
    )

    def measure():
        seqs, context = 16, 256
        width = -(-context // block_size)
        generator = torch.Generator().manual_seed(0)
        k_pool, v_pool = torch.randn(
            2, seqs * width * 2, block_size, num_kv_heads, head_dim, generator=generator
        ).unbind(0)
        block_tables = torch.randperm(seqs * width * 2, generator=generator)[: seqs * width].view(seqs, width).int()
        seq_lens = torch.full((seqs,), context, dtype=torch.int32)
        starts = torch.arange(seqs + 1, dtype=torch.int32)
        query = torch.randn(seqs, num_heads, head_dim, generator=generator)
        plan = AttentionPlan.build(starts, seq_lens, block_tables=block_tables, block_size=block_size)
        best = {True: float("inf"), False: float("inf")}
        for _ in range(5):
            for in_c in (True, False):
                start = time.perf_counter()
                paged_attention(
                    query,
                    k_pool,
                    v_pool,
                    block_tables,
                    seq_lens,
                    starts,
                    1,
                    context,
                    head_dim**-0.5,
                    plan=plan,
                    decode_kernel=decode_attention if in_c else None,
                )
                best[in_c] = min(best[in_c], time.perf_counter() - start)
        why = f"C {best[True] * 1e3:.2f} ms, torch {best[False] * 1e3:.2f} ms for 16 x 256 cached tokens"
        return best[True] < best[False], why, {}

    return cached_verdict(key, measure)

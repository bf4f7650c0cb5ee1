"""Choosing the CPU matrix-product path by measurement, on the machine that runs, once.

Which routine multiplies ``M`` rows by a weight fastest depends on the processor, the thread
count, the weight's shape and ``M`` itself (``linear.py`` lists the paths). So at start-up the
model runner times every available path on the model's own weights, for every row count up
to ``MAX_PLANNED_ROWS`` (a decode step has one row per running sequence), and keeps the
fastest per shape and row count. Above that, products are compute-bound, and oneDNN's packed
weights are used where they measured no slower than ``x @ W.T``.

Timing a product on one small matrix would measure the cache, not memory: in a real step
every weight comes from DRAM, because the whole model is larger than the last-level cache.
So each measurement runs over enough matrices of one shape to exceed twice that cache.

The choice is written under ``$LIFEOFPROMPT_CACHE/cpu_tuning/``, keyed by the CPU's model and
flags, torch's version, the thread count, the dtype and the shapes: a second start reads it
in milliseconds, and a machine gives the same tokens run after run. The engine's
``cpu_tuning="linear"`` (or any other path name) skips the timing and pins one path; tests and
checked notebook cells do that, so their tokens never depend on a timing.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..env import cache_dir, cpu_flags, cpu_model
from ..errors import ConfigError
from ..model.linear import MAX_PLANNED_ROWS, PATHS, Linear, RowPlan, available_paths, plannable, run_path
from .huge_pages import huge_pages_setting, move_weights_to_huge_pages

CALIBRATION_VERSION = 3  # 2: weights timed where the engine keeps them (2 MiB pages, huge_pages.py); 3: tiled rowwise
LARGE_ROWS = 64  # the row count that stands for "more than MAX_PLANNED_ROWS"
BUDGET_SECONDS = 2.5  # past this, row counts not yet timed take the choice below them (~3 s in all)
DROP_FACTOR = 2.0  # a row-by-row path this many times slower than the best is not timed for more rows
ROW_BY_ROW = ("transposed", "transposed_doubled", "rowwise")


@dataclass
class LinearChoice:
    """The plans a runner applied and where they came from (for the start-up log and results)."""

    plans: dict[tuple[int, int], RowPlan]
    source: str  # "pinned: linear", "calibrated in 2.1 s", "cached (file)"
    timings: dict = field(default_factory=dict)  # "960x576" -> {rows: {path: seconds}}

    @property
    def pinned(self) -> str | None:
        """The path every product was pinned to, or None where the choice was measured."""
        return self.source.removeprefix("pinned: ") if self.source.startswith("pinned: ") else None

    def describe(self) -> list[str]:
        lines = [f"CPU matrix products ({self.source}):"]
        for (out_features, in_features), plan in self.plans.items():
            lines.append(f"  {out_features}x{in_features}: {plan.describe()}")
        return lines


# ----------------------------------------------------------------------------- measuring


def last_level_cache_bytes(default: int = 32 << 20) -> int:
    """The largest CPU cache, from sysfs (``default`` where it cannot be read)."""
    sizes = []
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = entry.read_text().strip().upper()
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        try:
            sizes.append(int(text.rstrip("KMG")) * scale)
        except ValueError:
            continue
    return max(sizes, default=default)


def weights_by_shape(model: nn.Module) -> dict[tuple[int, int], list[Linear]]:
    """The model's plannable ``Linear`` modules grouped by weight shape, in model order (tied weights once)."""
    groups: dict[tuple[int, int], list[Linear]] = defaultdict(list)
    seen = set()
    for module in model.modules():
        if plannable(module) and module.weight.data_ptr() not in seen:
            seen.add(module.weight.data_ptr())
            groups[tuple(module.weight.shape)].append(module)
    return dict(groups)


def sample_modules(modules: list[Linear], min_bytes: int) -> list[Linear]:
    """The first modules of a shape whose weights add up to ``min_bytes`` (all of them if they don't)."""
    chosen, total = [], 0
    for module in modules:
        chosen.append(module)
        total += module.weight.numel() * module.weight.element_size()
        if total >= min_bytes:
            break
    return chosen


def time_path(path: str, modules: list[Linear], rows: int, repeats: int = 1) -> float:
    """Seconds for ``rows`` rows through every module of ``modules`` by ``path`` (fastest of ``repeats`` passes)."""
    x = torch.randn(rows, modules[0].in_features, dtype=modules[0].weight.dtype)
    run_path(path, x, modules[0])  # warm-up: first-call set-up, kernel selection
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for module in modules:
            run_path(path, x, module)
        best = min(best, time.perf_counter() - start)
    return best


# The order row counts are timed in: the powers of two first, so a machine too slow for the
# budget still gets a plan measured across the whole range, with the gaps filled from below.
ROW_ORDER = (1, 2, 4, 8, 16, 3, 6, 12, 5, 7, 10, 14, 9, 11, 13, 15)


@dataclass
class _ShapeSearch:
    """The search for one weight shape: the choice per measured row count, the timings."""

    modules: list[Linear]
    paths: tuple[str, ...]
    choice: dict[int, str] = field(default_factory=dict)
    dropped: dict[str, int] = field(default_factory=dict)  # row-by-row path -> rows where it fell far behind
    timings: dict = field(default_factory=dict)

    def measure_rows(self, rows: int, measure) -> None:
        # Doubling changes only a single row: from two rows on it is the plain transposed product.
        # A path that works row by row costs about M times one row, so once it is far behind it
        # only falls further back: it is not timed for more rows. The blocked products (BLAS,
        # oneDNN) get cheaper per row, so they are always timed.
        named = ("transposed" if rows > 1 and p == "transposed_doubled" else p for p in self.paths)
        here = [p for p in dict.fromkeys(named) if self.dropped.get(p, MAX_PLANNED_ROWS + 1) >= rows]
        times = self.timings[rows] = {p: measure(p, self.modules, rows) for p in here}
        best = self.choice[rows] = min(times, key=times.get)
        for p in here:  # one row is a kernel of its own (a matrix-vector product): judge from two
            if rows > 1 and p in ROW_BY_ROW and times[p] >= DROP_FACTOR * times[best]:
                self.dropped[p] = min(self.dropped.get(p, rows), rows)

    def plan(self, large: str) -> RowPlan:
        """Every row count takes the choice of the nearest measured row count at or below it."""
        by_rows = [self.choice[max(m for m in self.choice if m <= rows)] for rows in range(1, MAX_PLANNED_ROWS + 1)]
        return RowPlan(tuple(by_rows), large)

    def large_rows_path(self, measure) -> str:
        """oneDNN above MAX_PLANNED_ROWS where it measured no slower than ``x @ W.T`` (compute-bound: one matrix)."""
        if "onednn" not in self.paths:  # not available here
            return "linear"
        times = self.timings[LARGE_ROWS] = {p: measure(p, self.modules[:1], LARGE_ROWS) for p in ("linear", "onednn")}
        return "onednn" if times["onednn"] <= times["linear"] else "linear"


def warm_up(searches: dict, paths: tuple[str, ...]) -> None:
    """One untimed pass over every sampled matrix: the first touch of freshly loaded weights and of
    new packed copies costs page faults, which would otherwise be timed as the path's speed."""
    for search in searches.values():
        x = torch.randn(1, search.modules[0].in_features)
        for path in {"linear", "onednn"} & set(paths):
            for module in search.modules:
                run_path(path, x, module)


def calibrate(model: nn.Module, paths: tuple[str, ...], measure=None, budget_s: float = BUDGET_SECONDS):
    """Time ``paths`` on the model's own shapes; returns ``(plans, timings)``.

    Row counts are measured in ``ROW_ORDER`` across all shapes; if the budget runs out, the row
    counts not reached take the choice of the nearest measured one below them.
    ``measure(path, modules, rows) -> seconds`` is injectable, so tests can make each path win.
    """
    if measure is None:
        measure = lambda path, modules, rows: time_path(path, modules, rows, repeats=2 if rows <= 2 else 1)  # noqa: E731
    min_bytes = 2 * last_level_cache_bytes()
    searches = {
        shape: _ShapeSearch(sample_modules(modules, min_bytes), tuple(paths))
        for shape, modules in weights_by_shape(model).items()
    }
    if "onednn" in paths:
        for search in searches.values():
            for module in search.modules:
                module.prepack()
    try:
        with torch.no_grad():
            warm_up(searches, paths)
            deadline = time.perf_counter() + budget_s
            large = {shape: search.large_rows_path(measure) for shape, search in searches.items()}
            for rows in ROW_ORDER:
                if rows > 1 and time.perf_counter() > deadline:
                    break
                for search in searches.values():
                    search.measure_rows(rows, measure)
            plans = {shape: search.plan(large[shape]) for shape, search in searches.items()}
    finally:
        for search in searches.values():
            for module in search.modules:
                module.packed = None
    return plans, {f"{o}x{i}": search.timings for (o, i), search in searches.items()}


# ----------------------------------------------------------------------------- the cached choice


def machine_key() -> dict:
    """The machine fields every cached timing depends on: the CPU and its flags, torch's kernels,
    the thread count, whether weights sit in huge pages, and the C kernels' target where it is
    not this CPU. Each cache key adds what it timed."""
    from .native_build import MARCH_VARIABLE

    key = dict(
        cpu=cpu_model(),
        flags=" ".join(sorted(cpu_flags())),
        torch=torch.__version__,
        threads=torch.get_num_threads(),
        huge_pages=huge_pages_setting(),
    )
    if os.environ.get(MARCH_VARIABLE):  # the C kernels built for another target
        key["native_march"] = os.environ[MARCH_VARIABLE]
    return key


def cache_key(model: nn.Module, paths: tuple[str, ...]) -> dict:
    """Everything the fastest path depends on; a change in any of it means timing again."""
    return dict(
        machine_key(),
        version=CALIBRATION_VERSION,
        dtype=str(model.dtype),
        shapes=sorted(f"{o}x{i}" for o, i in weights_by_shape(model)),
        paths=list(paths),
        rowwise_source=rowwise_source_digest(),
    )


def rowwise_source_digest() -> str:
    """A digest of the rowwise kernel's C source: a changed kernel is timed again."""
    from .native_build import source_digest
    from .row_kernels import SOURCE

    return source_digest(SOURCE)


def cache_file(key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / "cpu_tuning" / f"{digest}.json"


def read_cached(path: Path) -> tuple[dict, dict] | None:
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    plans = {
        tuple(int(n) for n in shape.split("x")): RowPlan(tuple(p["by_rows"]), p["large"])
        for shape, p in stored["plans"].items()
    }
    return plans, stored.get("timings", {})


def write_json(path: Path, payload: dict) -> None:
    """Write atomically (another process may be reading the same file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_suffix(f".tmp-{os.getpid()}")
    staging.write_text(json.dumps(payload, indent=1))
    os.replace(staging, path)


def cached_answer(key: dict, measure):
    """An answer measured once per machine: ``(answer, why)`` from the cache under ``key``, or from
    ``measure() -> (answer, why, extra)``, whose answer is then stored with ``extra`` beside it
    (``extra`` None: an answer to use now but not keep, measured again next time; ``extra`` with
    ``provisional=True``: kept, but measured once more at the next start, whose answer then stays)."""
    path = cache_file(key)
    try:
        stored = json.loads(path.read_text())
        if not stored.get("provisional"):
            return stored["answer"], stored["why"]
    except (OSError, ValueError, KeyError):
        stored = None
    answer, why, extra = measure()
    if extra is not None:
        if stored is not None:  # the second measurement of a provisional answer: final
            extra = {k: v for k, v in extra.items() if k != "provisional"}
        write_json(path, dict(key=key, answer=answer, why=why, **extra))
    return answer, why


def cached_verdict(key: dict, measure) -> tuple[bool, str]:
    """``cached_answer`` for a yes/no (is one path faster than another here)."""
    faster, why = cached_answer(key, measure)
    return bool(faster), why


def write_cached(path: Path, key: dict, plans: dict, timings: dict, seconds: float) -> None:
    write_json(
        path,
        dict(
            key=key,
            seconds=round(seconds, 3),
            timings=timings,
            plans={f"{o}x{i}": dict(by_rows=list(p.by_rows), large=p.large) for (o, i), p in plans.items()},
        ),
    )


def choose_cpu_linear(model: nn.Module, path: str = "auto", prepack: bool = True) -> LinearChoice:
    """The CPU speed-ups' entry point (``cpu/speedups.py``): a pinned path, the cached choice, or a
    fresh calibration. ``path``: ``"auto"`` or a product path's name (``PATHS``)."""
    shapes = list(weights_by_shape(model))
    if path != "auto":
        if path not in PATHS:
            raise ConfigError(f"cpu_tuning={path!r}: use 'auto' or one of {', '.join(PATHS)}", param="cpu_tuning")
        if path not in available_paths(prepack=prepack):
            raise ConfigError(
                f"cpu_tuning={path!r} is not available on this machine "
                f"(available: {', '.join(available_paths(prepack=prepack))})",
                param="cpu_tuning",
            )
        return LinearChoice({shape: RowPlan.single(path) for shape in shapes}, f"pinned: {path}")
    paths = available_paths(prepack=prepack)
    key = cache_key(model, paths)
    path = cache_file(key)
    cached = read_cached(path)
    if cached is not None:
        return LinearChoice(cached[0], f"cached in {path}", cached[1])
    start = time.perf_counter()
    plans, timings = calibrate(model, paths)
    seconds = time.perf_counter() - start
    write_cached(path, key, plans, timings, seconds)
    return LinearChoice(plans, f"calibrated in {seconds:.1f} s, saved to {path}", timings)


# ----------------------------------------------------------------------------- bf16 or fp32 on this CPU


def time_dtype(dtype: torch.dtype, rows: int, path: str = "linear", shape=(3072, 576)) -> float:
    """Seconds for ``rows`` rows by ``path`` through enough ``shape`` matrices of ``dtype`` to pass twice the cache."""
    count = max(2, -(-2 * last_level_cache_bytes() // (shape[0] * shape[1] * dtype.itemsize)))
    modules = [Linear(shape[1], shape[0], bias=False, dtype=dtype) for _ in range(count)]
    for module in modules:  # where the engine keeps its weights (huge_pages.py)
        move_weights_to_huge_pages(module)
    if path == "onednn":
        for module in modules:
            module.prepack()
    with torch.no_grad():
        return time_path(path, modules, rows, repeats=3)


def bf16_decode_faster() -> tuple[bool, str]:
    """Whether this CPU multiplies decode-sized bf16 products faster than fp32 ones (cached per machine).

    Having bf16 instructions is necessary, not sufficient: what matters is how fast torch's bf16
    kernels read the weights. A bf16 step reads half the bytes, so it pays off only if it reads
    them at more than half the rate of the *fastest* fp32 path here (the one the engine would
    choose); timed for 1 and 8 rows.
    """
    key = dict(machine_key(), version=CALIBRATION_VERSION, what="bf16 vs the fastest fp32 path")

    def measure():
        fp32_paths = [p for p in available_paths() if p != "transposed"]  # doubled covers it for one row
        ratios = [
            time_dtype(torch.bfloat16, rows) / min(time_dtype(torch.float32, rows, p) for p in fp32_paths)
            for rows in (1, 8)
        ]
        why = f"a bf16 product took {ratios[0]:.2f}x / {ratios[1]:.2f}x the fastest fp32 path's time for 1 / 8 rows"
        return max(ratios) <= 1.0, why, dict(ratios=ratios)

    return cached_verdict(key, measure)

"""``CpuSpeedups``: everything that exists only to make a CPU fast, behind one object.

On a CPU a decode step reads every weight once and does little else, so what pays is reading
weights fast and doing nothing between the reads. In start-up order:

1. the weights move into 2 MiB pages and a big step's freed memory stays mapped (``place_weights``:
   ``cpu/huge_pages.py``, ``cpu/allocator.py``);
2. each matrix product takes the path measured fastest here for its shape and row count
   (``cpu/linear_calibration.py``), with oneDNN's packed copies where it wins;
3. the decode rows' attention runs in C, straight from the pool, where that measured faster, and
   steps of up to ``c_step_rows`` rows run every layer in one C call (``cpu/c_step.py``),
   from packed copies of the layer matrices at the row counts where those measured faster;
4. the step's token budget: as many tokens as one step prefills in ``STEP_SECONDS`` here, so a
   short request never waits behind a long prompt's step of several seconds;
5. async scheduling, when the engine asks (``choose_async_scheduling``): one request's decode timed
   with it on and off, the faster kept.

Each answer is timed once per machine and cached (``$LIFEOFPROMPT_CACHE``). With ``cpu_tuning``
pinned to a path (tests, checked notebook cells) nothing is timed, so no timing moves a token:
``rowwise`` brings the C paths, ``c-step`` forces the C step up to 16 rows, any other path leaves
them out, and the budget keeps its default. A split model (tensor or pipeline parallel) takes the
products only: the one-call step has no place for the all-reduces.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field

import torch

from ..model.attention import PagedKVCache, synthetic_step
from ..model.attention_backends import attention_backend as backend_named
from ..model.device import DeviceDefaults
from ..model.linear import apply_plans, plannable
from ..model.quantized_linear import cpu_kernel_rows
from ..units import format_bytes
from . import big_step_weights, c_step
from .allocator import keep_freed_memory
from .huge_pages import move_weights_to_huge_pages
from .linear_calibration import cached_answer, cached_verdict, choose_cpu_linear, machine_key

STEP_SECONDS = 0.25  # a step's token budget: as many tokens as this CPU prefills in this long
FORCED_C_STEP_ROWS = 16  # "c-step": every step of up to this many rows in C
TIMING_CONTEXT = 64  # cached tokens per sequence in the C step's timed decode steps
PREFILL_PROBE_TOKENS = 256  # the prompt that times the prefill speed
ASYNC_TIMING_PAIRS = 3  # async scheduling on and off, timed in turns (after one warm-up run of each)


@dataclass(frozen=True)
class CpuChoices:
    """What ``CpuSpeedups.choose`` settled on (the CPU part of the engine's ``ResolvedConfig``)."""

    tuning: str  # "auto", or the pinned path
    products: str  # where the product plans came from: pinned, calibrated, cached
    decode_attention_in_c: bool
    c_step_rows: int  # steps of up to this many rows run as one C call (0: never)
    c_step_layouts: dict = field(default_factory=dict)  # row count -> the C layout measured faster there
    step_seconds: dict = field(default_factory=dict)  # row count -> the C step's measured seconds
    step_tokens: int | None = None  # the measured token budget (None: not measured)
    notes: dict = field(default_factory=dict)  # why each answer fell as it did, for the log


class CpuSpeedups(DeviceDefaults):
    """The CPU's speed-ups, answering the runner as ``model/device.py: DeviceDefaults`` does (which sets what
    they share: the model, the settings, the attention backend); the engine reaches them only through
    ``model/loader.py: prepare_for_device``."""

    def __init__(self, model, config, split: bool = False):
        super().__init__(model, config, split)  # split: tensor or pipeline parallel
        self.name = "CPU tuning"  # the attention backend becomes cpu-hybrid where decode attention in C wins
        self.tuning, self.prepack = config.cpu_tuning, config.prepack_cpu_weights
        self.pinned = None if self.tuning == "auto" else "linear" if self.tuning == "c-step" else self.tuning
        self.linear_choice = None
        self.c_step_layouts: dict = {}
        self.placement: list[str] = []  # what place_weights did, for the log
        self.prepacked_bytes = self.packed_bytes = 0

    # ------------------------------------------------------------------ start-up
    def place_weights(self) -> None:
        """Weights into 2 MiB pages, which one core streams about a quarter faster than 4 KiB ones (before
        anything is timed, so it is timed there); and a big step's freed memory kept for the next step."""
        if move_weights_to_huge_pages(self.model):
            self.placement.append("weights in 2 MiB pages")
        note = keep_freed_memory()
        if note:
            self.placement.append(note)

    def choose(self, num_blocks: int) -> CpuChoices:
        """The products' paths; then the C attention and the C step's row limit, timed with those products;
        then the step's token budget, timed with all of them."""
        self.model.cpu_step = None  # the torch layers while the products are timed
        if self.model.dtype == torch.float32:
            self.linear_choice = choose_cpu_linear(self.model, self.pinned or "auto", prepack=self.prepack)
        self.prepacked_bytes = apply_plans(self.model, self.linear_choice.plans if self.linear_choice else None)
        notes = {}
        if self.model.quantization is not None:  # block matrices: their kernel built or loaded and its row limit
            cpu_kernel_rows()  # read now (timed once per machine), so that no request's first step pays for them
            big_step_weights.drop_copies(self.model)  # a model an earlier engine gave copies: timed without them
            notes["activations"] = self.choose_block_activations()
            notes["big_steps"] = self.choose_big_step_weights()
        in_c = self.config.kv_cache_dtype in c_step.KV_FORMATS  # the C paths read an fp32 pool or a q8_0 one
        if not in_c:
            notes["c_step"] = (
                f"the C step and decode attention read fp32 or q8_0 pools, not {self.config.kv_cache_dtype}"
            )
        if in_c and not self.split and self.backend == "torch" and c_step.supports(self.model):
            self.decode_attention_in_c, notes["attention"] = self.choose_decode_attention()
            if self.decode_attention_in_c:  # chosen once: every step's decode rows attend in C
                self.attention = backend_named("cpu-hybrid")
            notes["c_step"] = self.choose_c_step_rows(num_blocks)
        self.model.cpu_step = self.chosen_c_step()
        self.packed_bytes = self.pack_for_c_step()
        self.step_tokens, self.budget_note = self.measure_step_tokens()
        notes["budget"] = self.budget_note
        products = self.linear_choice.source if self.linear_choice else "torch's own (not fp32)"
        layouts, seconds = dict(self.c_step_layouts), dict(self.step_seconds)
        args = (self.decode_attention_in_c, self.c_step_rows, layouts, seconds, self.step_tokens, notes)
        self.choices = CpuChoices(self.tuning, products, *args)
        self.log_lines = self.describe()
        return self.choices

    def choose_block_activations(self) -> str:
        """Integer or float products for the block matrices (``block_activations``; ``cpu/interleaved_blocks.py``):
        as asked, or with "auto" a batch-1 step timed both ways where this CPU has a vector path for integer
        ones (cached); pinned, float (nothing is timed). Integer products keep a re-laid copy of the blocks."""
        from ..errors import ConfigError
        from .block_calibration import integer_products_faster
        from .interleaved_blocks import (
            can_interleave_model,
            drop_interleaved,
            integer_on_offer,
            integer_path,
            interleave_model,
        )

        asked = self.config.block_activations
        if asked == "integer":
            if integer_path() is None or not can_interleave_model(self.model):
                raise ConfigError(
                    "block_activations='integer' needs the compiled block kernels and matrices of whole groups of "
                    "16 rows; use block_activations='float'",
                    param="block_activations",
                )
            interleave_model(self.model)
            return f"integer ({integer_path()}), as asked"
        if asked == "float" or not integer_on_offer(self.model):
            drop_interleaved(self.model)
            return (
                "float, as asked"
                if asked == "float"
                else f"float: no vector path for integer ones here ({integer_path()})"
            )
        if self.pinned is not None:
            drop_interleaved(self.model)
            return f"float: the pinned {self.tuning} path times nothing (block_activations='integer' asks for them)"
        way = c_step.ROW_MAJOR if c_step.supports(self.model) and c_step.step_kernel() else c_step.TORCH
        drop_interleaved(self.model)  # the key below describes the model without them
        key = dict(self.step_key("block activations"), integer_path=integer_path(), way=way, turns="in runs")
        faster, why = cached_verdict(key, lambda: integer_products_faster(self.model, way))
        interleave_model(self.model) if faster else drop_interleaved(self.model)
        return f"{f'integer ({integer_path()})' if faster else 'float'}: {why}"

    def choose_big_step_weights(self) -> str:
        """Whether big steps (prompt chunks, large batches) read a float copy of the layer matrices
        (``big_step_weights``; ``cpu/big_step_weights.py``): as asked (from ``ASKED_FROM_ROWS`` rows), or with
        "auto" prompt chunks of several sizes timed from the blocks and from each copy that memory allows
        (cached); pinned or split, the blocks (nothing is timed)."""
        from .block_calibration import BIG_STEP_ROWS, big_step_choice

        asked = self.config.big_step_weights
        big_step_weights.drop_copies(self.model)  # the keys below describe the model without them
        if asked in big_step_weights.FORMS:
            big_step_weights.make_copies(self.model, asked, big_step_weights.ASKED_FROM_ROWS)
            return f"{asked} from {big_step_weights.ASKED_FROM_ROWS} rows, as asked"
        if asked == "blocks" or self.pinned is not None or self.split:
            why = (
                "as asked"
                if asked == "blocks"
                else f"the {'split model' if self.split else 'pinned path'} times nothing"
            )
            return f"the blocks at every size: {why}"
        available = big_step_weights.available_memory()
        forms = big_step_weights.forms_that_fit(self.model, available)
        if not forms:
            need = format_bytes(big_step_weights.copy_bytes(self.model, "bfloat16"))
            return f"the blocks at every size: a bfloat16 copy ({need}) would take over a quarter of the memory free"
        pool = self.scratch_pool(math.ceil(max(BIG_STEP_ROWS) / self.block_size))
        key = dict(self.step_key("big step weights"), forms=forms, rows=list(BIG_STEP_ROWS))
        answer, why = cached_answer(key, lambda: big_step_choice(self.model, forms, pool))
        if answer["form"] is None:
            return f"the blocks at every size: {why}"
        big_step_weights.make_copies(self.model, answer["form"], answer["from_rows"])
        return f"{answer['form']} from {answer['from_rows']} rows: {why}"

    def choose_decode_attention(self) -> tuple[bool, str]:
        """Whether decode rows attend in C, straight from the pool (``c_step.decode_attention``): timed
        once per machine against gather + SDPA; pinned, ``rowwise`` and ``c-step`` mean yes, any other no."""
        if self.pinned is not None:
            return self.tuning in ("rowwise", "c-step"), f"follows the pinned {self.tuning} path"
        c = self.model.config
        return c_step.decode_attention_faster(c.num_heads, c.num_kv_heads, c.head_dim, self.block_size)

    def choose_c_step_rows(self, num_blocks: int) -> str:
        """Up to how many rows a step runs as one C call (and, timed, the faster layout and its seconds per
        row count): pinned, from the products' plans (``c_step.usable_rows``); else whole steps timed."""
        if self.tuning == "c-step":
            self.c_step_rows = FORCED_C_STEP_ROWS
            return "asked for"
        if self.linear_choice is None:
            return ""
        if self.pinned is not None:
            plans, timings = self.linear_choice.plans, self.linear_choice.timings
            self.c_step_rows = c_step.usable_rows(plans, c_step.layer_shapes(self.model), timings)
            return f"follows the pinned {self.pinned} path"
        answer, why = self.measure_c_step_rows(num_blocks)
        if isinstance(answer, dict):
            self.c_step_rows = answer["rows"]
            self.c_step_layouts = {int(n): layout for n, layout in answer["layouts"].items()}
            self.step_seconds = {int(n): s for n, s in answer["seconds"].items() if int(n) <= answer["rows"]}
        return why

    def measure_c_step_rows(self, num_blocks: int) -> tuple[dict | int, str]:
        """``c_step.measured_rows`` on decode steps of this model over as many blocks as the engine's pool
        will have, cached per machine (0 where that pool is too small to time)."""
        per_block = math.ceil(TIMING_CONTEXT / self.block_size)
        counts = tuple(n for n in c_step.STEP_ROW_COUNTS if n * per_block <= num_blocks)
        if len(counts) < 4:
            least = c_step.STEP_ROW_COUNTS[3]
            return 0, f"not measured: the pool holds fewer than {least} x {TIMING_CONTEXT} tokens"
        plans, in_c = self.linear_choice.plans, self.decode_attention_in_c
        key = dict(c_step.measured_step_key(self.model, plans, self.block_size, in_c), row_counts=list(counts))
        key.update(packed=self.prepack)
        if self.config.kv_cache_dtype != "auto":  # a q8_0 pool's attention costs otherwise
            key.update(kv_cache_dtype=self.config.kv_cache_dtype)

        def measure(rows: int, way: str) -> float:  # way: a C layout, or c_step.TORCH
            step = synthetic_step(self.model, cache, [TIMING_CONTEXT] * rows, decode=True, backend=self.attention)
            start = time.perf_counter()
            with torch.no_grad(), c_step.running(self.model, c_step.CStep.only(way)):
                self.model(*step)
            return time.perf_counter() - start

        cache = self.scratch_pool(counts[-1] * per_block)
        return cached_answer(key, lambda: self.time_c_step(measure, counts))

    def time_c_step(self, measure, counts) -> tuple:
        """The timing behind ``measure_c_step_rows``, with its caching rule: a run the budget cut short early
        (a busy moment) is used but not cached; one cut short later is kept but measured once more."""
        # The packed copies first, where the engine keeps them, outside the budget: made by the first packed
        # step instead, they cost 1.4 s of a slow CPU's 3 s, and were timed from ordinary pages.
        layouts = c_step.C_LAYOUTS if self.prepack else (c_step.ROW_MAJOR,)
        if self.prepack:
            c_step.pack_all(self.model)
        answer, why = c_step.measured_rows(measure, row_counts=counts, c_paths=layouts)
        stopped = answer["stopped_before"]
        if stopped is not None and stopped <= c_step.MIN_CACHED_ROWS:
            why += f"; not cached (the budget ran out before {stopped} rows, a sign of a busy machine)"
            return answer, why + ": measured again at the next start", None
        if stopped is not None:  # a slow machine, or a busy moment: one more look at the next start
            why += "; kept, and measured once more at the next start (a moment's load may have cut it short)"
            return answer, why, {"provisional": True}
        return answer, why, {}

    def pack_for_c_step(self) -> int:
        """Make the C step's packed copies now, not on the first step that needs them, or free them where no
        step will read them (or the memory setting forbids them); returns their bytes, for the log."""
        step = self.model.cpu_step
        wanted = step is not None and any(step.layout_for(n) == c_step.PACKED for n in range(1, step.max_rows + 1))
        if not (wanted and self.prepack):
            if self.c_step_rows:
                c_step.drop_packed(self.model)
            return 0
        c_step.pack_all(self.model)
        c_step.weight_pointers(self.model)
        return c_step.packed_bytes(self.model)

    def measure_step_tokens(self) -> tuple[int | None, str]:
        """How many tokens one step prefills in ``STEP_SECONDS`` here, with the paths just chosen (a prompt of
        ``PREFILL_PROBE_TOKENS`` tokens, or the model's context if shorter; best of two after a warm-up,
        cached); pinned or split: not timed."""
        if self.pinned is not None or self.split:
            return None, f"the default, not timed ({'a split model' if self.split else 'a pinned path'})"
        key = self.step_key("prefill speed")
        probe = min(
            PREFILL_PROBE_TOKENS, self.model.config.max_position_embeddings
        )  # a small model's positions end sooner
        cache = self.scratch_pool(math.ceil(probe / self.block_size))

        def measure():
            seconds = []
            for _ in range(3):  # the first warms up
                step = synthetic_step(self.model, cache, [probe], backend=self.attention)
                start = time.perf_counter()
                with torch.no_grad(), c_step.running(self.model, None):
                    self.model(*step)
                seconds.append(time.perf_counter() - start)
            rate = probe / min(seconds[1:])
            return rate, f"prefill measured at {rate:,.0f} tokens/s", {}

        rate, why = cached_answer(key, measure)
        tokens = int(rate * STEP_SECONDS) // self.block_size * self.block_size
        tokens = max(tokens, self.block_size)  # the engine caps it at its default (engine/config.py: resolve)
        return tokens, f"{why}, {STEP_SECONDS:g} s a step in whole blocks"

    def step_key(self, what: str) -> dict:
        """The cache key of a timing of whole steps: the machine, the model's shape and dtype, the product
        plans, and a block model's formats and kernels (what sets a step's speed)."""
        c = self.model.config
        shape = [c.num_layers, c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.vocab_size]
        plans = self.linear_choice.plans if self.linear_choice else {}
        products = {f"{o}x{i}": plan.describe() for (o, i), plan in sorted(plans.items())}
        key = dict(machine_key(), version=1, what=what, dtype=str(self.model.dtype), shape=shape)
        key.update(products=products, block_size=self.block_size)
        if self.config.kv_cache_dtype != "auto":
            key.update(kv_cache_dtype=self.config.kv_cache_dtype)
        if self.model.quantization is not None:  # block matrices: their formats and kernels set the speed
            from ..cpu.native_build import source_digest
            from .interleaved_blocks import interleaved_bytes

            key.update(formats=c_step.matrix_formats(self.model), head=self.model.lm_head.format)
            key.update(kernels=source_digest(c_step.SOURCE), integer_products=interleaved_bytes(self.model) > 0)
            key.update(big_step_copies=big_step_weights.describe(self.model))
        return key

    def choose_async_scheduling(self, time_decode) -> tuple[bool, str] | None:
        """Async scheduling on or off here: one request's decode timed with it on and off, in turns
        (``time_decode(on)``: seconds a token), and the faster kept (cached). The forward thread keeps all
        of torch's threads and the engine's thread does the host's work beside them, on the same cores, so
        whether hiding that work pays for two thread hand-offs a step depends on the machine. Pinned or
        split: not timed (None), and the engine's rule keeps it off."""
        if self.pinned is not None or self.split:
            return None
        key = dict(self.step_key("async scheduling"), c_step_rows=self.c_step_rows, pairs=ASYNC_TIMING_PAIRS)

        def measure():
            time_decode(False), time_decode(True)  # warm-ups: the first steps of each way pay for set-up
            pairs = [(time_decode(True), time_decode(False)) for _ in range(ASYNC_TIMING_PAIRS)]
            ratio = statistics.median(on / off for on, off in pairs)
            on_ms, off_ms = (1e3 * statistics.median(p[i] for p in pairs) for i in (0, 1))
            why = (
                f"timed here, one request's decode at {on_ms:.2f} ms a token on and {off_ms:.2f} ms off "
                f"(on/off {ratio:.3f}, the median of {ASYNC_TIMING_PAIRS} pairs in turns)"
            )
            return ratio < 1.0, why, dict(ratio=ratio, seconds_on_off=pairs)

        on, why = cached_verdict(key, measure)
        return on, f"{'on' if on else 'off'}: {why}"

    def scratch_pool(self, num_blocks: int) -> PagedKVCache:
        """A small KV pool for timing, before the engine's own is allocated."""
        kv_dtype = self.config.kv_cache_dtype  # the engine's own form, so that what is timed is what runs
        return PagedKVCache.for_model(self.model.config, num_blocks, self.block_size, self.model.dtype, "cpu", kv_dtype)

    def chosen_c_step(self) -> c_step.CStep | None:
        """What the model runs its small steps with: the C step up to ``c_step_rows`` rows (None: never)."""
        if not self.c_step_rows:
            return None
        unmeasured = c_step.PACKED if self.prepack else c_step.ROW_MAJOR
        return c_step.CStep(self.c_step_rows, self.c_step_layouts, unmeasured)

    def for_draft(self, draft) -> CpuSpeedups:
        """A draft model's own speed-ups, its C step given to it as the target's is (``draft_speedups``)."""
        theirs = self.draft_speedups(draft)
        draft.cpu_step = theirs.chosen_c_step()
        return theirs

    def draft_speedups(self, draft) -> CpuSpeedups:
        """A draft that shares the target's layers shares their plans and C step; one with weights of its
        own gets its own products (pinned if the target's were) and C rows."""
        theirs = CpuSpeedups(draft, self.config, self.split)
        if self.linear_choice is None or draft.dtype != torch.float32:
            return theirs
        linears = [m for m in draft.modules() if plannable(m)]
        theirs.c_step_layouts = self.c_step_layouts
        if linears and all(m.plan is not None for m in linears):  # the target's own modules
            theirs.c_step_rows = self.c_step_rows
            return theirs
        move_weights_to_huge_pages(draft)  # where the target's weights are, before timing
        theirs.linear_choice = choose_cpu_linear(draft, self.pinned or "auto", prepack=self.prepack)
        apply_plans(draft, theirs.linear_choice.plans)
        if self.c_step_rows and c_step.supports(draft):
            shapes, choice = c_step.layer_shapes(draft), theirs.linear_choice
            theirs.c_step_rows = c_step.usable_rows(choice.plans, shapes, choice.timings)
        return theirs

    def share_with(self, parallel, model) -> None:
        """A split model: the products' plans go to every rank (``ParallelGroup.share_plans``).

        Ranks timing products against each other on shared cores would measure each other, so the driver
        times its own shard (every tensor-parallel rank's shard has the same shapes) while the workers
        wait. Its choice is for its thread count; where the workers run fewer threads, it times (or reads
        from the cache) the choice for theirs. A shape only another stage holds (the last stage's LM head)
        keeps plain products. Under torchrun on other machines the plans are the driver's CPU's: right, if
        not tuned there."""
        choice = self.linear_choice
        if choice is None:
            return
        plans, source = choice.plans, f"the driver's ({choice.source})"
        threads = parallel.worker_threads
        if choice.pinned is None and threads != torch.get_num_threads():
            previous = torch.get_num_threads()
            torch.set_num_threads(threads)
            try:
                theirs = choose_cpu_linear(model, "auto")
            finally:
                torch.set_num_threads(previous)
                apply_plans(model, choice.plans)  # timing drops packed copies: restore the driver's
            plans, source = theirs.plans, f"for {threads} thread(s) a rank ({theirs.source})"
        parallel.share_plans(plans, source)

    def describe(self) -> list[str]:
        """The start-up log's lines for what was chosen here."""
        notes = self.choices.notes if self.choices else {}
        lines = list(self.placement)
        if self.prepacked_bytes:
            lines.append(f"oneDNN's packed copies of the weights its plans use: + {format_bytes(self.prepacked_bytes)}")
        lines += self.linear_choice.describe() if self.linear_choice else []
        if self.c_step_rows:
            rows = "1 row" if self.c_step_rows == 1 else f"1-{self.c_step_rows} rows"
            copy = f", from a packed copy of the layer matrices (+ {format_bytes(self.packed_bytes)})"
            why = f"; {notes['c_step']}" if notes.get("c_step") else ""
            lines.append(
                f"steps of {rows} (decodes, verifies, short prompt chunks): all layers in one C call "
                f"(cpu/c_step.c){copy if self.packed_bytes else ''}{why}"
            )
        elif notes.get("c_step"):  # measured, and turned down: say why
            lines.append(f"no step runs as one C call (cpu/c_step.c): {notes['c_step']}")
        if notes.get("attention"):
            how = "in C, from the pool" if self.decode_attention_in_c else "gather + SDPA (torch)"
            lines.append(f"decode attention: {how} ({notes['attention']})")
        if notes.get("activations"):
            from .interleaved_blocks import interleaved_bytes

            copy = interleaved_bytes(self.model)
            extra = f"; the blocks re-laid for them: + {format_bytes(copy)}" if copy else ""
            lines.append(f"products with block matrices: {notes['activations']}{extra}")
        if notes.get("big_steps"):
            copy = big_step_weights.copies_bytes(self.model)
            extra = f" (+ {format_bytes(copy)})" if copy else ""
            in_c = (
                f"; steps of up to {self.c_step_rows} rows run as one C call from the blocks"
                if copy and self.c_step_rows
                else ""
            )
            lines.append(f"big steps' layer matrices{extra}: {notes['big_steps']}{in_c}")
        return lines

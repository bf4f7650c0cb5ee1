"""``CpuPathChoices``: which CPU fast paths a model runner takes, each measured on this machine once.

* the one-call C step (``model/cpu_decode.c``) for steps of up to ``cpu_decode_rows`` rows: as far
  as whole steps measured faster in C than through the torch forward (``measured_rows``, cached);
* the decode rows' attention in C, straight from the paged pool, where that measured faster than
  torch's gather + SDPA.

With the matrix products pinned (tests, checked notebook cells) neither is timed: pinned
``rowwise`` means the C paths, any other pinned path the torch ones, so no timing moves a token.
``ModelRunner`` inherits this.
"""

from __future__ import annotations

import math
import time

import torch

from ..model.cpu_decode import (
    C_STEP,
    MIN_CACHED_ROWS,
    STEP_ROW_COUNTS,
    decode_attention_faster,
    layer_shapes,
    layout_for,
    measured_rows,
)
from ..model.cpu_decode import (
    supports as cpu_decode_supports,
)
from ..model.cpu_decode import (
    usable_rows as cpu_decode_rows,
)
from .sequence import Sequence


class CpuPathChoices:
    def choose_cpu_decode_rows(self, cpu_decode: bool | None) -> int:
        """Up to how many rows a step runs as one C call (``model/cpu_decode.py``); 0 for never.

        ``None``: as far as whole steps measured faster in C than through the torch forward on
        this machine (``cpu_decode.measured_rows``, once, then cached); with the products pinned,
        where ``rowwise`` is every layer matrix's plan, so no timing can move a test's tokens.
        ``True``: every step of up to 16 rows (tests); ``False``: never.
        """
        if cpu_decode is False or self.backend != "torch" or not cpu_decode_supports(self.model):
            return 0
        if cpu_decode:
            self.cpu_decode_reason = "asked for"
            return 16
        if not self.linear_choice:
            return 0
        if self.linear_choice.pinned is not None:
            self.cpu_decode_reason = f"follows the pinned {self.linear_choice.pinned} path"
            return cpu_decode_rows(self.linear_choice.plans, layer_shapes(self.model), self.linear_choice.timings)
        answer, self.cpu_decode_reason = self.measure_cpu_decode_rows()
        if isinstance(answer, int):  # measured as "not measurable" (a small pool)
            return answer
        self.cpu_step_layouts = {int(n): layout for n, layout in answer["layouts"].items()}
        self.cpu_step_seconds = {int(n): s for n, s in answer["seconds"].items() if int(n) <= answer["rows"]}
        return answer["rows"]

    def cpu_step_layout(self, rows: int) -> str:
        """How the C step reads the weights in a step of ``rows``: as measured faster at that count
        (``cpu_decode.layout_for``), packed where nothing was measured."""
        return layout_for(rows, getattr(self, "cpu_step_layouts", None))

    def pack_for_cpu_step(self) -> int:
        """Make the C step's packed copies of the layer matrices now, not on the first step that needs
        them (``cpu_decode.packed_weight``), or free them where no step will read them; returns
        their bytes, for the start-up log."""
        from ..model import cpu_decode

        if not any(self.cpu_step_layout(n) == C_STEP for n in range(1, self.cpu_decode_rows + 1)):
            if self.cpu_decode_rows:
                cpu_decode.drop_packed(self.model)
            return 0
        cpu_decode.pack_all(self.model)
        cpu_decode.weight_pointers(self.model)
        return cpu_decode.packed_bytes(self.model)

    def measure_cpu_decode_rows(self) -> tuple[dict | int, str]:
        """``cpu_decode.measured_rows`` on decode steps of this runner's own model and pool, cached per machine
        (the row limit and the faster layout per count; 0 where the pool is too small to time)."""
        from ..model.cpu_decode import measured_step_key
        from ..model.linear_calibration import cached_answer

        context = 64  # cached tokens per dummy sequence
        per_block = math.ceil(context / self.block_size)
        counts = tuple(n for n in STEP_ROW_COUNTS if n * per_block <= self.num_blocks)  # what the pool holds
        if len(counts) < 4:
            return 0, f"not measured: the pool holds fewer than {STEP_ROW_COUNTS[3]} x {context} tokens"
        key = dict(
            measured_step_key(self.model, self.linear_choice.plans, self.block_size, self.decode_attention_in_c),
            row_counts=list(counts),
        )

        def measure(rows: int, fused) -> float:
            input_ids, positions, meta = self.dummy_decode(rows, context)
            start = time.perf_counter()
            with torch.no_grad():
                self.model(input_ids, positions, meta, fused_kernels=fused)
            return time.perf_counter() - start

        def measure_all():
            # The packed copies first, where the engine keeps them (2 MiB pages), outside the budget: made
            # by the first packed step instead, they cost 1.4 s of a slow CPU's 3 s, and were timed from
            # ordinary pages. A runner that ends up reading none frees them (``pack_for_cpu_step``).
            from ..model import cpu_decode

            cpu_decode.pack_all(self.model)
            answer, why = measured_rows(measure, row_counts=counts)
            stopped = answer["stopped_before"]
            if stopped is not None and stopped <= MIN_CACHED_ROWS:
                return (
                    answer,
                    why + f"; not cached (the budget ran out before {stopped} rows, a sign of a busy "
                    "machine): measured again at the next start",
                    None,
                )
            if stopped is not None:  # a slow machine, or a busy moment: one more look at the next start
                return (
                    answer,
                    why + "; kept, and measured once more at the next start (a moment's load may have cut it short)",
                    {"provisional": True},
                )
            return answer, why, {}

        return cached_answer(key, measure_all)

    def dummy_decode(self, rows: int, context: int):
        """Inputs of one decode step of ``rows`` sequences of ``context`` tokens each, in the runner's pool (timing)."""
        from .sampling_params import SamplingParams

        blocks = math.ceil(context / self.block_size)
        seqs = []
        for i in range(rows):
            seq = Sequence(f"timing-{i}", [i % self.config.vocab_size] * context, SamplingParams(temperature=0))
            seq.block_table = list(range(i * blocks, (i + 1) * blocks))
            seq.num_computed_tokens = context - 1
            seqs.append(seq)
        return self.prepare(seqs, [1] * rows)

    def choose_decode_attention(self, cpu_decode: bool | None) -> tuple[bool, str]:
        """Whether the decode rows of every step attend in C, straight from the pool (``cpu_decode.decode_attention``).

        Measured once per machine against the torch path (gather + SDPA); never timed when the
        products are pinned (tests, checked notebook cells): then pinned ``rowwise`` means the C
        paths and any other pinned path the torch ones, so no timing can move a token.
        """
        if cpu_decode is False or self.backend != "torch" or not cpu_decode_supports(self.model):
            return False, ""
        if cpu_decode:
            return True, "asked for"
        pinned = self.linear_choice.pinned if self.linear_choice else None
        if pinned is not None:
            return pinned == "rowwise", f"follows the pinned {pinned} path"
        config = self.config
        return decode_attention_faster(config.num_heads, config.num_kv_heads, config.head_dim, self.block_size)

"""The model's matrix products: ``nn.Linear`` with several CPU paths, each used where it measured fastest.

A decode step multiplies a handful of rows ``x [M, in]`` by every weight ``W [out, in]``: the
work is tiny and the cost is reading ``W``. How fast a CPU reads ``W`` depends on which routine
does the product, and the winner changes with the processor, the thread count and ``M``:
``benchmarks/cpu_linear.py`` measured 12 to 33 GB/s for the same product on one machine, and
the order of the paths on an Intel Xeon was not the order on an AMD EPYC. So nothing here is a
constant tuned on one CPU. The paths (all give ``x @ W.T`` up to fp32 summation order):

* ``linear``: ``x @ W.T``, what ``nn.Linear`` and transformers run (one BLAS call);
* ``transposed``: ``(W @ x.T).T``: BLAS walks ``W`` against a skinny ``x.T``;
* ``transposed_doubled``: the same with a single row doubled (some BLAS builds have a fast
  two-column kernel, and two dot products per weight row read no more memory than one);
* ``onednn``: oneDNN (inside torch) reorders each weight *once* into the blocked layout its
  kernels read fastest; the packed copy costs as much memory again as the weight;
* ``rowwise``: a small C kernel compiled for this machine (``row_kernels.py``) that reads each weight
  row once, front to back.

The engine's model runner times the candidates on the model's own shapes at start-up
(``linear_calibration.py``), gives every ``Linear`` a ``RowPlan`` (a path per row count), and
prepacks only the weights whose plan uses oneDNN. Without a plan a ``Linear`` is exactly
``nn.Linear``: on GPUs (cuBLAS chooses well), in training (no autograd through these paths),
and for bf16 weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

MAX_PLANNED_ROWS = 16  # row counts timed one by one; larger products share one choice
PATHS = ("linear", "transposed", "transposed_doubled", "onednn", "rowwise")


def onednn_available() -> bool:
    """Whether this torch build can prepack linear weights (x86 and ARM CPU builds can)."""
    ops = getattr(torch.ops, "mkldnn", None)
    try:
        return (
            torch.backends.mkldnn.is_available()
            and ops is not None
            and hasattr(ops, "_reorder_linear_weight")
            and hasattr(ops, "_linear_pointwise")
        )
    except (AttributeError, RuntimeError):
        return False


def rowwise_available() -> bool:
    """Whether the compiled ``rowwise`` kernel exists on this machine (builds it on first call)."""
    from ..cpu.row_kernels import rows_kernel

    return rows_kernel() is not None


def available_paths(prepack: bool = True) -> tuple[str, ...]:
    """The paths this machine can run (``prepack=False`` leaves out oneDNN's packed copy)."""
    paths = ["linear", "transposed", "transposed_doubled"]
    if prepack and onednn_available():
        paths.append("onednn")
    if rowwise_available():
        paths.append("rowwise")
    return tuple(paths)


# ----------------------------------------------------------------------------- the paths


def transposed_linear(x: torch.Tensor, weight: torch.Tensor, double_single_row: bool = False) -> torch.Tensor:
    """``x @ weight.T`` computed as ``(weight @ x.T).T`` (one row doubled first if asked)."""
    rows = x.shape[0]
    if double_single_row and rows == 1:
        x = x.expand(2, -1).contiguous()
    return (weight @ x.t())[:, :rows].t().contiguous()


def run_path(path: str, x: torch.Tensor, module: Linear) -> torch.Tensor:
    """``module``'s product of ``x [M, in]`` by one named path."""
    if path == "linear":
        return nn.functional.linear(x, module.weight)
    if path == "transposed":
        return transposed_linear(x, module.weight)
    if path == "transposed_doubled":
        return transposed_linear(x, module.weight, double_single_row=True)
    if path == "onednn":
        if module.packed is None:
            raise RuntimeError("the onednn path needs a prepacked weight (Linear.prepack)")
        return torch.ops.mkldnn._linear_pointwise(x, module.packed, None, "none", [], "")
    if path == "rowwise":
        from ..cpu.row_kernels import rows_linear

        return rows_linear(x, module.weight)
    raise ValueError(f"unknown matrix-product path {path!r}: use one of {', '.join(PATHS)}")


@dataclass(frozen=True)
class RowPlan:
    """Which path multiplies ``M`` rows: ``by_rows[M - 1]`` up to ``MAX_PLANNED_ROWS``, ``large`` beyond."""

    by_rows: tuple[str, ...]
    large: str

    @classmethod
    def single(cls, path: str) -> RowPlan:
        """One path for every row count (what a pinned ``cpu_linear`` gives)."""
        return cls((path,) * MAX_PLANNED_ROWS, path)

    def path_for(self, rows: int) -> str:
        return self.by_rows[rows - 1] if rows <= len(self.by_rows) else self.large

    @property
    def uses_onednn(self) -> bool:
        return "onednn" in self.by_rows or self.large == "onednn"

    def describe(self) -> str:
        """``"M=1-2 rowwise, M=3-16 onednn, M>16 onednn"``: runs of equal choices, for the start-up log."""
        runs, start = [], 1
        for m in range(2, len(self.by_rows) + 2):
            if m > len(self.by_rows) or self.by_rows[m - 1] != self.by_rows[start - 1]:
                span = f"{start}" if start == m - 1 else f"{start}-{m - 1}"
                runs.append(f"M={span} {self.by_rows[start - 1]}")
                start = m
        return ", ".join(runs + [f"M>{len(self.by_rows)} {self.large}"])


# ----------------------------------------------------------------------------- the module


class Linear(nn.Linear):
    """``nn.Linear`` (no bias) that follows a ``RowPlan`` on the CPU once it is given one."""

    packed: torch.Tensor | None = None
    plan: RowPlan | None = None

    def prepack(self) -> int:
        """Reorder the weight for oneDNN (CPU, fp32, no bias); returns the bytes of the packed copy (0 if none).

        Only fp32 is packed: that is what is timed, and oneDNN's bf16 kernels need CPU
        instructions (AVX-512 BF16, AMX) that not every machine has.
        """
        if (
            self.bias is not None
            or not self.weight.is_cpu
            or self.weight.dtype != torch.float32
            or not onednn_available()
        ):
            self.packed = None
            return 0
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), None)
        return self.weight.numel() * self.weight.element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.plan is not None and x.is_cpu and x.dim() == 2 and not torch.is_grad_enabled():
            return run_path(self.plan.path_for(x.shape[0]), x, self)
        return super().forward(x)


def plannable(module: nn.Module) -> bool:
    """A ``Linear`` whose product the CPU paths can take over: fp32, CPU, contiguous, no bias."""
    return (
        isinstance(module, Linear)
        and module.bias is None
        and module.weight.is_cpu
        and module.weight.dtype == torch.float32
        and module.weight.is_contiguous()
    )


def apply_plans(model: nn.Module, plans: dict[tuple[int, int], RowPlan] | None) -> int:
    """Give each plannable ``Linear`` the plan of its weight shape; prepack exactly those that use oneDNN.

    ``plans=None`` removes every plan and packed copy (plain ``nn.Linear`` again). Returns the
    bytes the packed copies take.
    """
    packed_bytes = 0
    for module in model.modules():
        if not isinstance(module, Linear):
            continue
        plan = plans.get(tuple(module.weight.shape)) if plans and plannable(module) else None
        module.plan = plan
        if plan is not None and plan.uses_onednn:
            packed_bytes += module.prepack()
        else:
            module.packed = None
    return packed_bytes

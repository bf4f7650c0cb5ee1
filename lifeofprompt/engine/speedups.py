"""The device's speed-ups: everything that makes steps fast on one kind of device, in one object chosen at start-up.

The runner asks it, in start-up order, to place the weights and to choose its paths (measured or
pinned); a GPU's says whether the runner captures decode graphs once the pool exists. What it
chooses goes into the model and the attention backend, so a step asks it nothing. Three kinds:

* ``Speedups`` (here): none, the torch forward as written, nothing measured (``cpu_tuning="off"``);
* ``GpuSpeedups`` (here): the Triton attention, the fused element-wise kernels and CUDA graphs;
* ``CpuSpeedups`` (``cpu/speedups.py``): everything that exists only to make a CPU fast.

``model_runner.speedups_for`` picks one by the model's device; a GPU engine never imports the CPU's modules.
"""

from __future__ import annotations

from ..model.attention_backends import attention_backend as backend_named
from ..model.attention_backends import resolve_backend
from ..model.layers import triton_installed

# The modules that exist only to make a CPU fast: CpuSpeedups imports them, nothing on a GPU's path does
# (tests/test_engine_config.py and tests/gpu/test_engine_gpu.py check it in a fresh process).
CPU_TUNING_MODULES = (
    "lifeofprompt.cpu.speedups",
    "lifeofprompt.cpu.c_step",
    "lifeofprompt.cpu.row_kernels",
    "lifeofprompt.cpu.linear_calibration",
    "lifeofprompt.cpu.huge_pages",
    "lifeofprompt.cpu.allocator",
    "lifeofprompt.cpu.native_build",
)


class Speedups:
    """No speed-ups: the torch forward as written, nothing measured; the base the other two build on."""

    name = "plain torch"
    fused_kernels = False
    cuda_graphs = False
    decode_attention_in_c = False
    c_step_rows = 0

    def __init__(self, model, config, split: bool = False):
        self.model, self.config, self.split = model, config, split  # split: tensor or pipeline parallel
        self.block_size = config.block_size
        self.backend = resolve_backend(config.attention_backend, model.device)
        self.attention = backend_named(self.backend)  # what every step's metadata carries (the CPU may refine it)
        self.choices = None  # what ``choose`` settled on, for the resolved config
        self.step_tokens: int | None = None  # a measured token budget (None: the default)
        self.budget_note = ""  # how it was measured, for the log
        self.step_seconds: dict = {}  # a measured step time by row count (prices speculative drafts)

    def place_weights(self) -> None:
        """Where the weights live: as loaded."""

    def choose(self, num_blocks: int):
        """Nothing to measure: the model runs its torch layers (a CPU start-up before may have left a C step)."""
        self.model.cpu_step = None

    def for_draft(self, draft) -> Speedups:
        """A draft model's speed-ups: none, its forward the plain way."""
        draft.cpu_step = None
        return Speedups(draft, self.config, self.split)

    def share_with(self, parallel, model) -> None:
        """Nothing to send to other ranks."""

    log_lines: list[str] = []  # what was chosen, for the start-up log (none here)


class GpuSpeedups(Speedups):
    """A GPU's speed: the Triton attention, the element-wise steps as fused Triton kernels (which the
    layers call themselves on a GPU: ``model/layers.py``), and decode steps replayed from CUDA graphs
    (``cuda_graphs.py``).
    Graphs need the Triton backend and eager-free steps: a draft model mirrors every forward, and a
    pipeline stage's graph would wait inside on the stage before, so those run eagerly."""

    name = "GPU: Triton, fused kernels, CUDA graphs"

    def __init__(self, model, config, split: bool = False):
        super().__init__(model, config, split)
        from .speculative import SpeculativeConfig

        spec = SpeculativeConfig.from_user(config.speculative_config)
        self.fused_kernels = model.device.type == "cuda" and triton_installed()  # what the layers will do
        one_stage = config.pipeline_parallel_size == 1
        graphs_possible = model.device.type == "cuda" and self.backend == "triton" and one_stage
        self.cuda_graphs = graphs_possible and not config.enforce_eager and not (spec and spec.method != "ngram")

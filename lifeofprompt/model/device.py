"""What a model's device needs before it serves, chosen once at start-up (``loader.py: prepare_for_device``).

On a CPU that is the speed work of ``cpu/`` (``cpu/speedups.py: CpuSpeedups``: products, C attention,
the C step, the step's budget; timed once per machine, cached): the engine reaches ``cpu/`` here and
nowhere else (the loader's timed dtype and blocks choices and the products' C kernels reach it from
within ``model/``). Elsewhere, or with ``cpu_tuning="off"``, nothing is timed (``DeviceDefaults``): on a GPU the
Triton attention, the layers' fused kernels (they call them themselves: ``layers.py``) and decode steps
the runner may replay from CUDA graphs. Either object answers the runner the same way: place the
weights, choose with the pool's size, then what was chosen (the backend, the budget, the log's lines).
"""

from __future__ import annotations

from .attention_backends import attention_backend, resolve_backend
from .layers import triton_installed


class DeviceDefaults:
    """The speed-ups that need no timing: a GPU's, or none (the torch layers as written)."""

    decode_attention_in_c = False
    c_step_rows = 0

    def __init__(self, model, config, split: bool = False):
        self.model, self.config, self.split = model, config, split
        self.block_size = config.block_size
        self.backend = resolve_backend(config.attention_backend, model.device)
        self.attention = attention_backend(self.backend)  # what every step's metadata carries
        cuda = model.device.type == "cuda"
        self.name = "GPU: Triton, fused kernels, CUDA graphs" if cuda else "plain torch"
        self.fused_kernels = cuda and triton_installed()  # what the layers will do (layers.py)
        # Graphs need the Triton backend and eager-free steps: a pipeline stage's graph would wait inside
        # on the stage before, and the runner leaves them out where a draft model mirrors every forward.
        one_stage = config.pipeline_parallel_size == 1
        self.cuda_graphs = cuda and self.backend == "triton" and one_stage and not config.enforce_eager
        self.choices = None  # nothing chosen by timing
        self.step_tokens: int | None = None  # no measured token budget: the engine's default
        self.budget_note = ""
        self.step_seconds: dict = {}  # no measured step times (they price speculative drafts on a CPU)
        self.log_lines: list[str] = []

    def place_weights(self) -> None:
        """The weights stay where they were loaded."""

    def choose(self, num_blocks: int) -> None:
        """Nothing to time: the model runs its layers (a CPU start-up before may have left it a C step)."""
        self.model.cpu_step = None

    def choose_async_scheduling(self, time_decode) -> tuple[bool, str] | None:
        """Nothing timed: the engine's rule decides (``engine/async_scheduling.py: choose``)."""
        return None

    def for_draft(self, draft) -> DeviceDefaults:
        """A draft model's: none, its forward the plain way."""
        draft.cpu_step = None
        return DeviceDefaults(draft, self.config, self.split)

    def share_with(self, parallel, model) -> None:
        """Nothing to send to other ranks."""

"""Which executor runs the model: this one process, or a process group (vLLM's ``distributed_executor_backend``).

* ``None`` (the default) picks by size: one process when T×P = 1, the process group otherwise;
* ``"uni"`` insists on one process, so a split model is refused rather than quietly started;
* ``"mp"`` takes the process-group path even when T×P = 1: a world of one rank (rank 0 alone, no
  worker spawned) that still broadcasts each step's inputs and runs every all-reduce through the
  real backend (gloo, NCCL). On a machine with one device that is the only way to run the
  distributed path at all, and set beside the same engine without it, it measures what the
  path itself costs a step.
"""

from __future__ import annotations

from ..errors import ConfigError

EXECUTOR_BACKENDS = (None, "uni", "mp")


def uses_process_group(backend, tensor_parallel_size: int, pipeline_parallel_size: int) -> bool:
    """Whether the engine starts a process group; ``ConfigError`` for an unknown backend or a split ``"uni"``."""
    if not (backend is None or isinstance(backend, str)) or backend not in EXECUTOR_BACKENDS:
        raise ConfigError(
            f"distributed_executor_backend={backend!r} is not one of: None (one process when "
            "tensor_parallel_size x pipeline_parallel_size = 1, else a process group), 'uni' (one "
            "process), 'mp' (a process group, even of one rank)",
            param="distributed_executor_backend",
        )
    split = tensor_parallel_size != 1 or pipeline_parallel_size != 1
    if backend == "uni" and split:
        raise ConfigError(
            f"distributed_executor_backend='uni' runs one process, but tensor_parallel_size="
            f"{tensor_parallel_size} x pipeline_parallel_size={pipeline_parallel_size} asks for "
            "several: use 'mp' or None",
            param="distributed_executor_backend",
        )
    return split or backend == "mp"

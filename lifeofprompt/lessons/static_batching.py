"""Static batching: the baseline continuous batching is measured against.

The old way to batch: take up to ``batch_size`` requests, prefill them together, decode them
together, and only when the *longest* of them has finished take the next batch. A request that
finishes early leaves its seat empty until then, and a request that arrives meanwhile waits for
the whole batch, however short its own answer would be. Here that is the same ``Scheduler``
with one rule changed — admission only when nobody is running — on the same model runner and
block manager, so the comparison with continuous batching isolates the policy.

(This is the kind version: a finished request stops costing compute. Padded implementations
such as ``transformers.generate`` on a static batch keep computing its pad tokens too.)
"""

from __future__ import annotations

from ..engine.config import SchedulerConfig
from ..engine.scheduler import Scheduler


class StaticScheduler(Scheduler):
    """Admit a new batch only when the previous one has completely finished; never chunk a prompt."""

    def __init__(self, block_manager, batch_size: int, max_model_len: int, eos_token_ids=()):
        super().__init__(block_manager, SchedulerConfig(batch_size, 1 << 30, max_model_len), eos_token_ids)

    def admission_open(self) -> bool:
        return not self.running


def make_static(engine, batch_size: int = 8):
    """Switch an idle ``LLMEngine`` (or ``Simulator``) to static batching with ``batch_size`` seats."""
    if engine.scheduler.has_unfinished():
        raise RuntimeError("switch the scheduling policy only while the engine is idle")
    old = engine.scheduler
    engine.scheduler = StaticScheduler(engine.block_manager, batch_size, old.config.max_model_len, old.eos_token_ids)
    return engine


def static_engine(model, tokenizer, batch_size: int = 8, **engine_kwargs):
    """An ``LLMEngine`` on an already loaded model that batches statically."""
    from ..engine.llm_engine import LLMEngine

    return make_static(LLMEngine(model, tokenizer=tokenizer, **engine_kwargs), batch_size)

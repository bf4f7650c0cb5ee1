"""The engine's start-up log: the resolved config, one line per decision, the way vLLM's start-up lines read.

``LLMEngine`` builds it once (``startup_log``) and logs it unless ``log_stats=False``; notebooks print it.
"""

from __future__ import annotations

from ..model.quantized_linear import describe_weights, weight_bytes
from ..units import format_bytes


def kv_form(kv_dtype: str) -> str:
    """What the KV line adds for a ``kv_cache_dtype`` other than "auto" (the activations' dtype: nothing)."""
    forms = {"q8_0": "q8_0, int8 with an fp16 scale per 32", "fp8": "fp8 e4m3, a scale per layer"}
    return "" if kv_dtype == "auto" else f"; stored as {forms.get(kv_dtype, kv_dtype)}"


def startup_lines(engine) -> list[str]:
    """What the engine prints when it starts (vLLM prints the same facts): the model and its dtype, the
    weights and the KV pool, the scheduler's limits, the device's paths, speculation, parallelism."""
    r, model = engine.resolved, engine.model
    weights = weight_bytes(model)
    kv = engine.runner.kv_cache.nbytes
    tokens = r.num_kv_blocks * r.block_size
    dtype_why = f" ({model.dtype_reason})" if model.dtype_reason else ""
    limits = r.scheduler  # the longest request and the step's budgets
    lines = [
        f"model {model.source}",
        f"{model.dtype} on {model.device}{dtype_why}; weights take {format_bytes(weights)}",
        f"weights: {describe_weights(model)}; quantization {r.quantization} ({r.why['quantization']})",
        f"KV cache: {format_bytes(kv)} = {r.num_kv_blocks} blocks × {r.block_size} tokens = {tokens} tokens "
        f"({format_bytes(kv / max(tokens, 1))} per token){kv_form(r.kv_cache_dtype)}",
        # vLLM's line: the pool over the longest allowed request
        f"maximum concurrency for {limits.max_model_len} tokens per request: {tokens / limits.max_model_len:.2f}x",
        f"scheduler: up to {limits.max_num_seqs} sequences and {limits.max_num_batched_tokens} tokens per step "
        f"({r.why['budget']}); requests up to {limits.max_model_len} tokens; prefix caching "
        f"{'on' if r.enable_prefix_caching else 'off'}",
        f"speed-ups: {r.speedups}; attention backend {r.attention_backend}; "
        + ("decode steps replayed from CUDA graphs" if r.cuda_graphs else "no CUDA graphs"),
    ]
    lines.append(f"async scheduling {engine.async_scheduling_why}")
    plan = engine.runner.memory_plan
    if plan is not None:  # a GPU: what the weights left of the usable memory went to the cache
        lines.append(
            f"memory: {format_bytes(plan.usable)} usable - {format_bytes(plan.weights)} weights - "
            f"{format_bytes(plan.activations)} activations = {format_bytes(plan.kv_pool)} for the KV cache"
        )
    lines += engine.runner.speedups.log_lines
    if engine.spec is not None:
        lines += engine.spec.startup_lines(kv, r.num_kv_blocks)
    if engine.parallel is not None:
        lines += engine.parallel.describe(model, engine.pipeline.depth if engine.pipeline is not None else 1)
    if engine.spec is not None and engine.pipeline is not None:
        lines.append(
            f"speculation with pipeline overlap: each group's verify (last token + drafts) goes down the "
            f"{engine.pipeline.depth} stages like a plain step; accepted drafts are kept and the rest rolled "
            "back when it comes back, and only then does that group get new drafts"
        )
    if model.is_random:
        lines.append("NOTE: random weights - generated text is meaningless (speed and memory work only)")
    return lines

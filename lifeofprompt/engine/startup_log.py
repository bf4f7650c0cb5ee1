"""The engine's start-up log: one line per decision it took, the way vLLM's start-up lines read.

``LLMEngine`` builds it once (``startup_log``) and logs it unless ``log_stats=False``; notebooks print it.
"""

from __future__ import annotations


def startup_lines(engine, context_len: int) -> list[str]:
    """What the engine prints when it starts (vLLM prints the same facts): the model and its dtype, the
    weights and the KV pool, the scheduler's limits, the CPU paths it measured, speculation, parallelism."""
    from .memory import format_bytes

    weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    packed = getattr(engine.runner, "prepacked_bytes", 0)
    kv = engine.runner.kv_cache.nbytes
    tokens = engine.num_kv_blocks * engine.block_size
    lines = [
        f"model {getattr(engine.model, 'source', engine.model_name)}",
        f"{engine.model.dtype} on {engine.model.device}"
        + (f" ({engine.model.dtype_reason})" if getattr(engine.model, "dtype_reason", "") else "")
        + f"; weights take {format_bytes(weights)}"
        + (f" (+ {format_bytes(packed)} prepacked for oneDNN)" if packed else "")
        + ("; in 2 MiB pages" if getattr(engine.runner, "huge_page_bytes", 0) else ""),
        f"KV cache: {format_bytes(kv)} = {engine.num_kv_blocks} blocks × {engine.block_size} tokens "
        f"= {tokens} tokens ({format_bytes(kv / max(tokens, 1))} per token)",
        # vLLM's line: the longest allowed request
        f"maximum concurrency for {engine.max_model_len} tokens per request: {tokens / engine.max_model_len:.2f}x",
        f"scheduler: up to {engine.scheduler.max_num_seqs} sequences and {engine.scheduler.max_num_batched_tokens} "
        f"tokens per step; requests up to {engine.max_model_len} tokens; prefix caching "
        f"{'on' if engine.block_manager.enable_prefix_caching else 'off'}",
    ]
    if getattr(engine.runner, "allocator_note", ""):
        lines.append(engine.runner.allocator_note)
    if engine.runner.linear_choice is not None:
        lines += engine.runner.linear_choice.describe()
    rows = getattr(engine.runner, "cpu_decode_rows", 0)
    if rows:
        why = getattr(engine.runner, "cpu_decode_reason", "")
        copy = getattr(engine.runner, "cpu_step_packed_bytes", 0)
        lines.append(
            f"steps of {'1 row' if rows == 1 else f'1-{rows} rows'} (decodes, verifies, short prompt "
            "chunks): all layers in one C call (model/cpu_decode.c)"
            + (
                f", from a packed copy of the layer matrices at the row counts it measured faster"
                f" (+ {format_bytes(copy)})"
                if copy
                else ""
            )
            + (f"; {why}" if why else "")
        )
    if getattr(engine.runner, "decode_attention_reason", ""):
        how = "in C, from the pool" if engine.runner.decode_attention_in_c else "gather + SDPA (torch)"
        lines.append(f"decode attention: {how} ({engine.runner.decode_attention_reason})")
    if engine.spec is not None:
        lines += engine.spec.startup_lines(kv, engine.num_kv_blocks)
    if engine.parallel is not None:
        lines += engine.parallel.describe(
            engine.model, engine._full_weight_bytes, engine.pipeline.depth if engine.pipeline is not None else 1
        )
    if engine.spec is not None and engine.pipeline is not None:
        lines.append(
            f"speculation with pipeline overlap: each group's verify (last token + drafts) goes down the "
            f"{engine.pipeline.depth} stages like a plain step; accepted drafts are kept and the rest rolled "
            "back when it comes back, and only then does that group get new drafts"
        )
    if getattr(engine.model, "is_random", False):
        lines.append("NOTE: random weights - generated text is meaningless (speed and memory work only)")
    return lines

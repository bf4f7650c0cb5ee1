"""The KV pool in fewer bytes (``kv_cache_dtype``, ``model/kv_cache_formats.py``).

Each form written into the pool reads back within what its rounding allows, and the check is shown to
fail on a wrong scale and on a scale applied to the wrong block. Attention over a quantized pool equals
attention over the values it holds, over random shapes with ragged last blocks. Then the engine: the
pool's bytes and capacity, the settings it refuses, fp8's calibration, and greedy tokens under the margin
rule with prefix caching and preemption.
"""

from __future__ import annotations

import pytest
import torch

from lifeofprompt.engine.model_runner import fp8_scales
from lifeofprompt.errors import ConfigError
from lifeofprompt.model import kv_cache_formats as formats
from lifeofprompt.model.attention import PagedKVCache
from lifeofprompt.model.paged_attention import paged_attention, store_kv

FORMS = ["auto", "bfloat16", "float16", "q8_0", "fp8"]


def rounding_bound(kind: str, rows: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """How far each value may read back from what was written: half a step of the form."""
    if kind == "auto":
        return torch.zeros_like(rows)
    if kind in ("bfloat16", "float16"):
        return rows.abs() * (2.0**-8 if kind == "bfloat16" else 2.0**-11)
    if kind == "fp8":  # 3 bits of mantissa; below 2^-6 (subnormals) steps of 2^-9, all in units of the scale
        return torch.maximum(rows.abs() * 2.0**-4, torch.full_like(rows, 2.0**-10 * scale))
    blocks = rows.reshape(*rows.shape[:-1], -1, formats.Q8_BLOCK).abs().amax(-1, keepdim=True)
    step = blocks / 127 * (1 + 2.0**-10)  # the scale, rounded to fp16
    return (step / 2 + blocks * 2.0**-10).expand(*blocks.shape[:-1], formats.Q8_BLOCK).reshape(rows.shape)


def written_and_read(kind: str, rows: torch.Tensor, block_size: int = 16) -> tuple[PagedKVCache, torch.Tensor]:
    """``rows [T, kv, D]`` stored at slots 0..T-1 of a pool's layer 0 keys, then gathered back."""
    cache = PagedKVCache(1, -(-len(rows) // block_size) + 1, block_size, rows.shape[1], rows.shape[2], kv_dtype=kind)
    if kind == "fp8":
        cache.scales[:] = rows.abs().max() / formats.FP8_MAX
    store_kv(rows, rows, cache.k(0), cache.v(0), torch.arange(len(rows)))
    blocks = torch.arange(cache.num_blocks)
    read = cache.k(0).index_select(0, blocks).reshape(-1, *rows.shape[1:])[: len(rows)]
    return cache, read


@pytest.mark.parametrize("kind", FORMS)
def test_each_form_reads_back_within_its_rounding(kind):
    for seed, (tokens, heads, dim) in enumerate([(1, 1, 32), (17, 3, 64), (40, 2, 128)]):
        rows = torch.randn(tokens, heads, dim, generator=torch.Generator().manual_seed(seed)) * 3
        rows[0, 0, :32] = 0.0  # an all-zero block: a zero scale must read back zeros
        cache, read = written_and_read(kind, rows)
        scale = float(cache.scales[0, 0]) if kind == "fp8" else None
        assert ((read.float() - rows).abs() <= rounding_bound(kind, rows, scale) + 1e-7).all(), kind
        assert (read[0, 0, :32] == 0).all()


@pytest.mark.parametrize("kind", ["q8_0", "fp8"])
def test_the_check_fails_on_a_wrong_scale(kind):
    rows = torch.randn(20, 3, 64, generator=torch.Generator().manual_seed(1))
    cache, _ = written_and_read(kind, rows)
    cache.scales.mul_(1.5)
    read = cache.k(0).index_select(0, torch.arange(cache.num_blocks)).reshape(-1, 3, 64)[:20]
    scale = float(cache.scales[0, 0]) if kind == "fp8" else None
    assert not ((read - rows).abs() <= rounding_bound(kind, rows, scale) + 1e-7).all()


def test_the_check_fails_on_a_scale_applied_to_the_wrong_block():
    rows = torch.randn(20, 3, 64, generator=torch.Generator().manual_seed(2))
    rows[..., 32:] *= 10  # the second block of every head ten times the first
    cache, _ = written_and_read("q8_0", rows)
    cache.scales[...] = cache.scales.flip(-1)
    read = cache.k(0).index_select(0, torch.arange(cache.num_blocks)).reshape(-1, 3, 64)[:20]
    assert not ((read - rows).abs() <= rounding_bound("q8_0", rows) + 1e-7).all()


def held_values(cache: PagedKVCache, layer: int, kv: int) -> torch.Tensor:
    """The whole layer's keys or values as the pool holds them, in fp32 (the reference reads these)."""
    pool = cache.layer_pool(layer, kv)
    return pool.index_select(0, torch.arange(cache.num_blocks)).float()


@pytest.mark.parametrize("kind", FORMS)
def test_attention_over_a_quantized_pool_is_attention_over_what_it_holds(kind):
    """Decodes and prefill chunks after cached prefixes, ragged last blocks, 3 random batches."""
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        heads, kv_heads, dim, size = 6, 2, 64, 16
        lengths = torch.randint(1, 70, (4,), generator=g).tolist()
        queries = [1, 1, min(5, lengths[2]), lengths[3]]  # two decodes, a chunk after a prefix, a whole prefill
        cache = PagedKVCache(1, 24, size, kv_heads, dim, kv_dtype=kind)
        tables = torch.full((4, 6), -1, dtype=torch.int32)
        free = torch.randperm(24, generator=g).tolist()
        for b, n in enumerate(lengths):
            tables[b, : -(-n // size)] = torch.tensor([free.pop() for _ in range(-(-n // size))])
        slots = torch.tensor(
            [int(tables[b, j // size]) * size + j % size for b, n in enumerate(lengths) for j in range(n)]
        )
        keys, values = (torch.randn(len(slots), kv_heads, dim, generator=g) for _ in range(2))
        if kind == "fp8":
            cache.scales[0] = torch.tensor([keys.abs().max(), values.abs().max()]) / formats.FP8_MAX
        store_kv(keys, values, cache.k(0), cache.v(0), slots)
        q = torch.randn(sum(queries), heads, dim, generator=g)
        starts = torch.tensor([0, *torch.tensor(queries).cumsum(0).tolist()])
        args = (tables, torch.tensor(lengths), starts, max(queries), max(lengths), dim**-0.5)
        out = paged_attention(q, cache.k(0), cache.v(0), *args)
        reference = paged_attention(q, held_values(cache, 0, 0), held_values(cache, 0, 1), *args)
        assert torch.allclose(out, reference, atol=1e-5, rtol=1e-5), kind


# ----------------------------------------------------------------------------- the engine


def test_bytes_per_token_and_the_pools_capacity(smollm2):
    from lifeofprompt.engine.memory import kv_bytes_per_token

    config = smollm2[0].config
    per_token = {kind: kv_bytes_per_token(config, torch.float32, kind) for kind in FORMS}
    assert per_token == {"auto": 46080, "bfloat16": 23040, "float16": 23040, "q8_0": 12240, "fp8": 11520}
    for kind in FORMS:
        cache = PagedKVCache.for_model(config, 4, 16, torch.float32, "cpu", kind)
        scales = 2 * config.num_layers * 4 if kind == "fp8" else 0  # fp8's key and value scale per layer
        assert cache.nbytes == 4 * 16 * per_token[kind] + scales


def test_the_settings_it_refuses():
    from lifeofprompt import LLM

    with pytest.raises(ConfigError, match="kv_cache_dtype='int4' is not one of"):
        LLM("smollm2-135m", kv_cache_dtype="int4")
    with pytest.raises(ConfigError, match="not served by the triton attention backend on cuda: use one of auto$"):
        formats.check_kv_dtype("q8_0", 64, "cuda", "triton")
    with pytest.raises(ConfigError, match="multiple of 32 .* 80"):
        formats.check_kv_dtype("q8_0", 80, "cpu", "torch")
    formats.check_kv_dtype("fp8", 80, "cpu", "torch")  # served


def test_fp8_scales_are_each_layers_largest_value_over_448_and_the_same_every_time(smollm2, one_thread):
    from lifeofprompt.model.attention import NoCacheMetadata

    model = smollm2[0]
    ids = list(range(100, 160))
    scales = fp8_scales(model, ids)
    assert torch.equal(scales, fp8_scales(model, ids))
    seen = {}

    class Spy(NoCacheMetadata):
        def attend(self, layer_idx, q, k, v):
            seen[layer_idx] = (k.abs().max(), v.abs().max())
            return super().attend(layer_idx, q, k, v)

    with torch.no_grad():
        model.hidden_states(torch.tensor(ids), torch.arange(60), Spy.for_lengths([60]))
    expected = torch.tensor([[float(k), float(v)] for _, (k, v) in sorted(seen.items())]) / formats.FP8_MAX
    assert torch.allclose(scales, expected)


@pytest.mark.parametrize("kind", ["bfloat16", "q8_0", "fp8"])
def test_the_engine_decodes_with_a_smaller_cache_as_with_fp32_under_the_margin_rule(smollm2, story_ids, kind):
    """The story's prompts twice over (the second time their blocks come from the prefix cache) in a pool
    so small that requests are preempted and recomputed."""
    from lifeofprompt import LLM, SamplingParams
    from lifeofprompt.lessons.agreement import MARGIN_SHIFT, assert_greedy_agrees, teacher_forced_logits, top2_margins

    model, tokenizer = smollm2
    params = SamplingParams(max_tokens=16, temperature=0)
    prompts = [{"prompt_token_ids": ids} for ids in story_ids] * 2
    runs, preempted = {}, {}
    for form in ("auto", kind):
        llm = LLM(model, tokenizer=tokenizer, cpu_tuning="linear", kv_cache_dtype=form, num_kv_blocks=7, max_num_seqs=6)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        runs[form] = [o.outputs[0].token_ids for o in outputs]
        preempted[form] = llm.engine.scheduler.num_preemptions
    assert preempted[kind] > 0
    margins = [
        top2_margins(teacher_forced_logits(model, p["prompt_token_ids"], r)) for p, r in zip(prompts, runs["auto"])
    ]
    assert_greedy_agrees(runs[kind], runs["auto"], margins, MARGIN_SHIFT, min_steps=48)


# ----------------------------------------------------------------------------- the C paths on a q8_0 pool


def scattered_pool(kind: str, lengths: list[int], seed: int, kv_heads: int = 3, dim: int = 64, size: int = 16):
    """A pool with one sequence per length in scattered blocks, its random keys and values stored:
    ``(cache, block_tables)``."""
    g = torch.Generator().manual_seed(seed)
    cache = PagedKVCache(1, 40, size, kv_heads, dim, kv_dtype=kind)
    width = max(-(-n // size) for n in lengths)
    tables, free = torch.full((len(lengths), width), -1, dtype=torch.int32), torch.randperm(40, generator=g).tolist()
    for b, n in enumerate(lengths):
        if n:
            tables[b, : -(-n // size)] = torch.tensor([free.pop() for _ in range(-(-n // size))])
    slots = torch.tensor([int(tables[b, j // size]) * size + j % size for b, n in enumerate(lengths) for j in range(n)])
    keys, values = (torch.randn(len(slots), kv_heads, dim, generator=g) for _ in range(2))
    store_kv(keys, values, cache.k(0), cache.v(0), slots)
    return cache, tables


@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize("kind", ["auto", "q8_0"])
def test_the_c_decode_attention_reads_a_q8_0_pool_as_the_torch_path_does(kind, threads, monkeypatch):
    """Many rows, and few rows with long contexts, whose keys are split into parts of their blocks across threads
    and merged (c_step.c: attention_parts): one part, more parts than blocks, and a row that sees no key."""
    from lifeofprompt.cpu.c_step import attention_kernel, decode_attention

    if attention_kernel() is None:
        pytest.skip("no C compiler here")
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)  # the threads decode_attention hands the C code
    for seed, lengths in enumerate([[37, 5, 70, 16], [1], [32, 33, 100], [300], [0, 40], [5], [500]]):
        cache, tables = scattered_pool(kind, lengths, seed)
        q = torch.randn(len(lengths), 9, 64, generator=torch.Generator().manual_seed(seed))
        seq_lens, starts = torch.tensor(lengths), torch.arange(len(lengths) + 1)
        c = decode_attention(q, cache.k(0), cache.v(0), tables, seq_lens, 0.125)
        reference = paged_attention(q, cache.k(0), cache.v(0), tables, seq_lens, starts, 1, max(lengths), 0.125)
        reference = torch.nan_to_num(reference)  # a row that sees no key: zeros in C, NaN from SDPA
        assert torch.allclose(c, reference, atol=1e-5), (kind, (c - reference).abs().max())
    if kind == "q8_0":  # it read the codes and their scales, not some float copy: halving the scales shows
        cache.scales.mul_(0.5)
        assert not torch.allclose(decode_attention(q, cache.k(0), cache.v(0), tables, seq_lens, 0.125), c, atol=1e-3)


def test_the_c_step_writes_a_q8_0_pool_as_the_torch_layers_do(smollm2, one_thread):
    """The same made-up step (three prompts of 7, 4 and 9 tokens) through the C step and the torch layers: the
    logits agree up to fp32 order, and so do the pools (a code may differ by one where the two paths' keys sit
    either side of a rounding boundary)."""
    from lifeofprompt.cpu import c_step
    from lifeofprompt.model.attention import synthetic_step

    model = smollm2[0]
    if not c_step.supports(model):
        pytest.skip("no C step here")
    runs = {}
    for way in ("torch", "c"):
        cache = PagedKVCache.for_model(model.config, 8, 16, model.dtype, "cpu", "q8_0")
        step = synthetic_step(model, cache, [7, 4, 9])
        with torch.no_grad(), c_step.running(model, None if way == "torch" else c_step.CStep.only(c_step.ROW_MAJOR)):
            runs[way] = (model(*step), cache)
    (torch_logits, torch_pool), (c_logits, c_pool) = runs["torch"], runs["c"]
    assert (c_logits - torch_logits).abs().max() < 1e-2
    assert (c_pool.kv.int() - torch_pool.kv.int()).abs().max() <= 1
    assert torch.allclose(c_pool.scales.float(), torch_pool.scales.float(), rtol=2e-3, atol=1e-6)
    assert (c_pool.scales != 0).sum() == (torch_pool.scales != 0).sum() > 0  # the same slots written


def test_the_engine_on_a_q8_0_pool_in_c_decodes_as_on_fp32_under_the_margin_rule(smollm2, story_ids):
    from lifeofprompt import LLM, SamplingParams
    from lifeofprompt.lessons.agreement import MARGIN_SHIFT, assert_greedy_agrees, teacher_forced_logits, top2_margins

    model, tokenizer = smollm2
    params = SamplingParams(max_tokens=16, temperature=0)
    prompts = [{"prompt_token_ids": ids} for ids in story_ids]
    runs = {}
    for form in ("auto", "q8_0"):
        llm = LLM(model, tokenizer=tokenizer, cpu_tuning="c-step", kv_cache_dtype=form, num_kv_blocks=32)
        assert model.cpu_step is not None and llm.engine.runner.kv_cache.kv_dtype == form
        runs[form] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    margins = [
        top2_margins(teacher_forced_logits(model, p["prompt_token_ids"], r)) for p, r in zip(prompts, runs["auto"])
    ]
    assert_greedy_agrees(runs["q8_0"], runs["auto"], margins, MARGIN_SHIFT, min_steps=24)


# ----------------------------------------------------------------------------- perplexity through the pool


def pool_perplexity(smollm2, kind: str, text: str | None = None, chunk: int = 64) -> float:
    from lifeofprompt import LLM
    from lifeofprompt.lessons.perplexity import perplexity_through_the_pool

    model, tokenizer = smollm2
    llm = LLM(model, tokenizer=tokenizer, cpu_tuning="linear", kv_cache_dtype=kind, max_num_batched_tokens=chunk)
    return perplexity_through_the_pool(llm, text)


def test_perplexity_through_an_fp32_pool_is_perplexity_without_one(smollm2):
    """The short text (~450 tokens) in chunks of 64: every chunk after the first reads its context from the pool."""
    from lifeofprompt.lessons.perplexity import perplexity

    assert pool_perplexity(smollm2, "auto") == pytest.approx(perplexity(*smollm2), rel=1e-5)


def test_a_q8_0_pool_keeps_the_short_texts_perplexity_and_a_misplaced_scale_does_not(smollm2, monkeypatch):
    reference = pool_perplexity(smollm2, "auto")
    assert abs(pool_perplexity(smollm2, "q8_0") / reference - 1) <= 0.01
    quantize = formats.quantize

    def scales_of_the_wrong_block(kind, rows, scale):
        codes, scales = quantize(kind, rows, scale)
        return codes, scales.flip(-1) if kind == "q8_0" else scales

    monkeypatch.setattr(formats, "quantize", scales_of_the_wrong_block)
    assert abs(pool_perplexity(smollm2, "q8_0") / reference - 1) > 0.01


@pytest.mark.slow
def test_the_long_texts_perplexity_through_each_pool(smollm2):
    """The 4,891 tokens of the long text in chunks of 512 through the pool, against the fp32 pool (25.785 on the
    fp32 weights' engine). Measured on the GGUF blocks: bf16 -0.016%, fp16 -0.003%, q8_0 -0.032%, fp8 +1.75%."""
    from lifeofprompt.lessons.perplexity import long_evaluation_text

    text = long_evaluation_text()
    reference = pool_perplexity(smollm2, "auto", text, chunk=512)
    assert abs(pool_perplexity(smollm2, "q8_0", text, chunk=512) / reference - 1) <= 0.01
    assert abs(pool_perplexity(smollm2, "bfloat16", text, chunk=512) / reference - 1) <= 0.005


def test_the_lessons_arithmetic_takes_the_pools_form(smollm2):
    """Chapter 05's arithmetic against the engine's own plan: the same pool bytes hold ~3.8x the tokens in q8_0."""
    from lifeofprompt.lessons.memory_arithmetic import (
        kv_bytes_for_tokens,
        max_concurrent_requests,
        num_blocks_for_bytes,
    )

    config = smollm2[0].config
    assert kv_bytes_for_tokens(config, torch.float32, 4096, "q8_0") == 4096 * 12240
    fp32, q8 = (num_blocks_for_bytes(2**31, config, torch.float32, 16, kind) for kind in ("auto", "q8_0"))
    assert (fp32, q8) == (2**31 // (16 * 46080), 2**31 // (16 * 12240)) and 3.7 < q8 / fp32 < 3.8
    assert max_concurrent_requests(2**31, config, torch.float32, 4096, 16, "q8_0") == q8 // 256

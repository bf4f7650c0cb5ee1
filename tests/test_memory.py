"""KV-cache arithmetic and the VRAM land (chapter 05): pinned figures, invariants, typed errors."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_counts import examples

from lifeofprompt.engine.memory import (
    blocks_for_tokens,
    dtype_bytes,
    estimate_activation_bytes,
    kv_bytes_per_block,
    kv_bytes_per_token,
    plan_memory,
    weight_bytes,
)
from lifeofprompt.errors import ConfigError, OutOfMemoryError
from lifeofprompt.lessons.memory_arithmetic import (
    LLAMA_2_13B,
    LLAMA_3_1_8B,
    cpu_blocks,
    kv_bytes_for_tokens,
    max_concurrency,
    max_concurrent_requests,
    num_blocks_for_bytes,
    unusable,
)
from lifeofprompt.lessons.story_model import SMOLLM2_135M
from lifeofprompt.model.config import TINYLLAMA_1_1B
from lifeofprompt.units import GiB, KiB, MiB


def test_bytes_per_token_pinned():
    assert kv_bytes_per_token(TINYLLAMA_1_1B, torch.bfloat16) == 22_528 == 22 * KiB
    assert kv_bytes_for_tokens(TINYLLAMA_1_1B, "bf16", 4096) == 88 * MiB
    assert kv_bytes_per_token(LLAMA_3_1_8B, "bfloat16") == 131_072 == 128 * KiB
    # SmolLM2-135M: 2 × 30 layers × 3 KV heads × 64 × 2 bytes
    assert kv_bytes_per_token(SMOLLM2_135M, "bf16") == 23_040
    assert kv_bytes_per_token(SMOLLM2_135M, torch.float32) == 46_080
    assert kv_bytes_per_block(TINYLLAMA_1_1B, "bf16") == 360_448
    assert kv_bytes_per_block(TINYLLAMA_1_1B, "bf16", block_size=32) == 720_896


def test_the_articles_megabyte_claim():
    gqa_40_layers = dataclasses.replace(LLAMA_2_13B, num_kv_heads=8)
    assert kv_bytes_per_token(gqa_40_layers, "bf16") == 163_840 == 160 * KiB  # not near a megabyte
    assert kv_bytes_per_token(LLAMA_2_13B, "bf16") == 819_200 == 800 * KiB  # 40 KV heads: near one
    assert LLAMA_2_13B.num_parameters() == 13_015_864_320


def test_dtype_names_and_weight_bytes():
    assert dtype_bytes("bf16") == dtype_bytes(torch.float16) == 2
    assert dtype_bytes("float32") == dtype_bytes("torch.float32") == 4
    assert weight_bytes(LLAMA_3_1_8B, "bf16") == 16_060_522_496
    assert weight_bytes(TINYLLAMA_1_1B, "bf16") == 2_200_096_768
    with pytest.raises(ConfigError):
        dtype_bytes("float7")


def test_blocks_and_concurrency():
    assert blocks_for_tokens(1) == 1 and blocks_for_tokens(16) == 1 and blocks_for_tokens(17) == 2
    pool = 100 * kv_bytes_per_block(TINYLLAMA_1_1B, "bf16") + 5
    assert num_blocks_for_bytes(pool, TINYLLAMA_1_1B, "bf16") == 100
    assert max_concurrent_requests(pool, TINYLLAMA_1_1B, "bf16", context_len=4096) == 0  # needs 256 blocks
    assert max_concurrent_requests(pool, TINYLLAMA_1_1B, "bf16", context_len=17) == 50  # 2 blocks each


def test_tinyllama_on_a_16_gib_card():
    plan = plan_memory(TINYLLAMA_1_1B, "bf16", 16 * GiB)
    assert plan.usable == int(16 * GiB * 0.9)
    assert plan.weights == 2_200_096_768
    assert not plan.activations_measured
    assert plan.activations == estimate_activation_bytes(TINYLLAMA_1_1B, "bf16") == 146_014_208
    assert plan.num_gpu_blocks == 36_387
    assert cpu_blocks(plan) == 11_915  # 4 GiB // 360,448
    assert max_concurrency(plan, 4096) == 142
    assert plan.weights + plan.activations + plan.kv_pool == plan.usable


def test_llama_8b_on_an_80_gb_card():
    reported = int(85.5e9)
    no_activations = {u: plan_memory(LLAMA_3_1_8B, "bf16", reported, u, activations=0) for u in (0.9, 0.92)}
    assert max_concurrency(no_activations[0.92], 4096) == 116  # the article's figure: 92 %, nothing for activations
    assert max_concurrency(no_activations[0.9], 4096) == 113  # vLLM's default 0.9
    estimated = {u: plan_memory(LLAMA_3_1_8B, "bf16", reported, u) for u in (0.9, 0.92)}
    assert max_concurrency(estimated[0.92], 4096) == 115
    assert max_concurrency(estimated[0.9], 4096) == 112


def test_a_measured_workspace_is_labelled():
    plan = plan_memory(TINYLLAMA_1_1B, "bf16", 16 * GiB, activations=3 * GiB, activations_measured=True)
    assert plan.activations_measured and plan.activations == 3 * GiB
    with pytest.raises(ConfigError):
        plan_memory(TINYLLAMA_1_1B, "bf16", 16 * GiB, activations_measured=True)


def test_a_plain_kv_budget():
    plan = plan_memory(SMOLLM2_135M, torch.float32, 64 * MiB, 1.0, block_size=16, weights=0, activations=0)
    assert plan.num_gpu_blocks == 64 * MiB // (46_080 * 16) == 91


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(block_size=0),
        dict(block_size=-16),
        dict(gpu_memory_utilization=0.0),
        dict(gpu_memory_utilization=1.01),
        dict(gpu_memory_utilization=-0.5),
        dict(total_memory=0),
    ],
)
def test_settings_out_of_range(kwargs):
    args = dict(total_memory=16 * GiB) | kwargs
    with pytest.raises(ConfigError):
        plan_memory(TINYLLAMA_1_1B, "bf16", **args)
    if "block_size" in kwargs:
        with pytest.raises(ConfigError):
            kv_bytes_per_block(TINYLLAMA_1_1B, "bf16", kwargs["block_size"])


def test_models_that_do_not_fit():
    with pytest.raises(OutOfMemoryError, match="do not fit"):
        plan_memory(LLAMA_3_1_8B, "bf16", 16 * GiB)  # 16.06 GB of weights in 14.4 GiB
    with pytest.raises(OutOfMemoryError, match="no KV block left"):
        plan_memory(TINYLLAMA_1_1B, "bf16", int(2_200_096_768 / 0.9) + 1, activations=0)


@settings(max_examples=examples(60), deadline=None)
@given(
    total_gib=st.floats(8, 200),
    utilization=st.floats(0.4, 1.0),
    block_size=st.sampled_from([1, 8, 16, 32, 128]),
    context_len=st.integers(1, 40_000),
)
def test_the_land_adds_up(total_gib, utilization, block_size, context_len):
    total = int(total_gib * GiB)
    plan = plan_memory(TINYLLAMA_1_1B, "bf16", total, utilization, block_size)
    assert unusable(plan) + plan.weights + plan.activations + plan.kv_pool == total
    assert plan.num_gpu_blocks * plan.bytes_per_block <= plan.kv_pool < (plan.num_gpu_blocks + 1) * plan.bytes_per_block
    n = max_concurrency(plan, context_len)
    assert n * blocks_for_tokens(context_len, block_size) <= plan.num_gpu_blocks
    assert (n + 1) * blocks_for_tokens(context_len, block_size) > plan.num_gpu_blocks
    assert n == max_concurrent_requests(
        plan.num_gpu_blocks * plan.bytes_per_block, TINYLLAMA_1_1B, "bf16", context_len, block_size
    )
    bigger = plan_memory(TINYLLAMA_1_1B, "bf16", total + GiB, utilization, block_size)
    assert bigger.num_gpu_blocks >= plan.num_gpu_blocks

"""FLOP counts from the shapes and the roofline model (notebooks 03–05; reused by the simulator and benchmarks)."""

from __future__ import annotations

import pytest
import torch

from lifeofprompt.engine.memory import kv_bytes_per_token
from lifeofprompt.env import cpu_label
from lifeofprompt.lessons.flops import (
    attention_pairs,
    cached_step_flops,
    forward_flops,
    generation_flops,
    naive_step_flops,
)
from lifeofprompt.lessons.memory_arithmetic import LLAMA_3_1_8B
from lifeofprompt.lessons.roofline import (
    Machine,
    arithmetic_intensity,
    break_even,
    decode_floor,
    decode_weight_bytes,
    fit_overhead,
    measure_copy_bandwidth,
    measure_machine,
    measure_matmul_rate,
    predict_step_time,
    step_bytes_and_flops,
)
from lifeofprompt.lessons.story_model import SMOLLM2_135M
from lifeofprompt.model.config import TINYLLAMA_1_1B

H100 = Machine("H100 SXM (datasheet)", bandwidth=3.35e12, flops=989e12)


def test_matmul_flops_are_twice_the_weights_per_token():
    """Every non-embedding weight takes part in one multiply-add per token row."""
    for config in (TINYLLAMA_1_1B, SMOLLM2_135M, LLAMA_3_1_8B):
        f = forward_flops(config, num_tokens=1, context_tokens=0)
        params = config.num_parameters() - config.vocab_size * config.hidden_size * (
            1 if not config.tie_word_embeddings else 0
        )
        norms = (2 * config.num_layers + 1) * config.hidden_size
        assert f.qkv + f.o + f.mlp + f.lm_head == 2 * (params - norms)
        assert f.scores == f.context == 2 * config.num_layers * config.num_heads * config.head_dim * 1


def test_attention_pairs():
    assert attention_pairs(5) == 15  # a 5-token prefill: 1 + 2 + 3 + 4 + 5
    assert attention_pairs(1, 9) == 10  # a decode after 9 cached tokens sees 10 keys
    assert attention_pairs(4, 4 * 99, num_seqs=4) == 400  # four decodes after 99 tokens each
    with pytest.raises(ValueError):
        attention_pairs(-1)


def test_naive_against_cached_steps():
    config = SMOLLM2_135M
    assert cached_step_flops(config, 10).total == forward_flops(config, 1, 9).total == 269_650_944
    assert naive_step_flops(config, 10).total == 2_183_791_104
    # the naive step repeats every row: its per-row cost is the cached step's minus the LM head, n times over
    n = 50
    naive, cached = naive_step_flops(config, n), cached_step_flops(config, n)
    assert naive.mlp == n * cached.mlp and naive.qkv == n * cached.qkv
    assert naive.scores == attention_pairs(n) * cached.scores // n
    assert naive.lm_head == cached.lm_head


def test_cumulative_cost_quadratic_against_linear():
    naive = generation_flops(SMOLLM2_135M, prompt_len=4, max_new_tokens=64, cached=False)
    cached = generation_flops(SMOLLM2_135M, prompt_len=4, max_new_tokens=64, cached=True)
    assert naive[0] == cached[0]  # the first forward is the same prefill
    deltas = [b - a for a, b in zip(naive, naive[1:])]
    assert all(d > 0 for d in deltas) and deltas[-1] > deltas[0]  # growing steps: quadratic sum
    assert max(cached[1:]) / min(cached[1:]) < 1.05  # nearly flat after the prefill
    assert sum(naive) > 10 * sum(cached)


def test_decode_weight_bytes_leave_out_the_embedding_table():
    assert decode_weight_bytes(LLAMA_3_1_8B, "bf16") == 16_060_522_496 - 128256 * 4096 * 2 == 15_009_849_344
    # a tied table is read in full by the LM head, so it stays in
    assert decode_weight_bytes(SMOLLM2_135M, "bf16") == SMOLLM2_135M.num_parameters() * 2


def test_decode_floor_and_intensity():
    # Serving is a memory problem: Llama-3.1-8B bf16 on an H100 SXM, ~15 GB per token at 3.35 TB/s -> ~4.5 ms
    assert decode_floor(LLAMA_3_1_8B, "bf16", H100) == pytest.approx(4.48e-3, rel=1e-3)
    decode = arithmetic_intensity(LLAMA_3_1_8B, "bf16", num_tokens=1, context_tokens=0)
    prefill = arithmetic_intensity(LLAMA_3_1_8B, "bf16", num_tokens=1024, context_tokens=0)
    assert decode == pytest.approx(1.0, rel=0.01)  # two operations per 2-byte weight
    assert decode < break_even(H100) < prefill
    assert break_even(H100) == pytest.approx(295.2, rel=1e-3)


def test_step_bytes_count_the_cache():
    base, _ = step_bytes_and_flops(TINYLLAMA_1_1B, "bf16", 1, 0)
    deeper, _ = step_bytes_and_flops(TINYLLAMA_1_1B, "bf16", 1, 1000)
    assert deeper - base == 1000 * kv_bytes_per_token(TINYLLAMA_1_1B, "bf16") == 1000 * 22_528


def test_predicted_step_time_is_the_larger_bound_plus_overhead():
    machine = Machine("toy", bandwidth=1e11, flops=1e13, overhead_s=0.002)
    nbytes, flops = step_bytes_and_flops(TINYLLAMA_1_1B, "bf16", 1, 100)
    assert predict_step_time(machine, TINYLLAMA_1_1B, "bf16", 1, 100) == pytest.approx(nbytes / 1e11 + 0.002)
    nbytes, flops = step_bytes_and_flops(TINYLLAMA_1_1B, "bf16", 4096, 0)
    assert predict_step_time(machine, TINYLLAMA_1_1B, "bf16", 4096, 0) == pytest.approx(flops / 1e13 + 0.002)
    # a batch of decodes costs little more than one while memory-bound
    one = predict_step_time(machine, TINYLLAMA_1_1B, "bf16", 1, 500)
    eight = predict_step_time(machine, TINYLLAMA_1_1B, "bf16", 8, 8 * 500, num_seqs=8)
    assert one < eight < 1.2 * one


def test_fit_overhead():
    machine = Machine("toy", bandwidth=1e11, flops=1e13)
    fitted = fit_overhead(machine, TINYLLAMA_1_1B, "bf16", measured_step_s=0.05)
    assert predict_step_time(fitted, TINYLLAMA_1_1B, "bf16", 1, 0) == pytest.approx(0.05)
    assert fit_overhead(machine, TINYLLAMA_1_1B, "bf16", measured_step_s=1e-6).overhead_s == 0.0


def test_measurements_on_this_machine_are_positive():
    """Only that they run and give sane units; speed itself is measured in notebooks and benchmarks."""
    assert measure_copy_bandwidth("cpu", nbytes=4 * 2**20, repeats=1) > 1e7
    assert measure_matmul_rate("cpu", torch.float32, size=64, repeats=1) > 1e6
    machine = measure_machine("cpu")
    assert machine.bandwidth > 0 and machine.flops > 0
    assert (
        machine.name == f"{cpu_label()}, {torch.get_num_threads()} thread{'s' if torch.get_num_threads() != 1 else ''}"
    )

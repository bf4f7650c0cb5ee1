"""Triton kernels against the torch reference, on the CPU under Triton's interpreter.

Every case is a random flat batch (seeded): decode rows and prefill rows after cached
prefixes of any length (zero included), shuffled block tables, padding rows, block sizes
1/8/16/32, GQA groups 1/3/8, head_dim 64/128, fp32 and fp16 (the interpreter's ``tl.dot``
is wrong for bf16, which ``tests/gpu`` checks on a GPU). Whatever the wrapper allocates is
filled with NaN and the pool's unused slots hold NaN, so an element the kernel forgets to
write, or a key it reads that it should not, fails the comparison.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import random

import pytest
import torch

from lifeofprompt.model import paged_attention as reference

if importlib.util.find_spec("triton") is None:  # find it without importing it: lifeofprompt.kernels
    pytest.skip("Triton is not installed", allow_module_level=True)  # must be first (interpreter mode)
from lifeofprompt.kernels.tiles import (
    TileConfig,
    choose_num_kv_splits,  # noqa: E402
    choose_tiles,
)

from lifeofprompt import kernels  # noqa: E402
from lifeofprompt.lessons.kernel_tiles import kernel_tiles  # noqa: E402
from lifeofprompt.lessons.paged_cases import (
    compare_with_reference,
    covering_cases,
    errors_against_fp32,
    make_case,
    run_step,  # noqa: E402
    used_slots,
)

pytestmark = [
    pytest.mark.numerics,
    pytest.mark.skipif(
        torch.cuda.is_available() and not kernels.INTERPRETED,
        reason="CPU interpreter tests; on a GPU machine run tests/gpu",
    ),
]

TOLERANCE = {torch.float32: dict(atol=2e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3)}


CASES = covering_cases(16, [torch.float32, torch.float16])


@pytest.mark.parametrize("params", CASES, ids=[c["id"] for c in CASES])
def test_paged_attention_matches_reference(poison_allocations, params):
    params = dict(params)
    num_kv_splits, tile_n, _ = params.pop("num_kv_splits"), params.pop("tile_n"), params.pop("id")
    case = make_case(**params)
    dtype, num_kv_heads, head_dim, padding_seqs = (
        params[k] for k in ("dtype", "num_kv_heads", "head_dim", "padding_seqs")
    )
    out, expected, (k_pool, v_pool) = run_step(case, num_kv_splits, tile_n)
    assert out.dtype == dtype and out.shape == case.query.shape
    assert not out.isnan().any(), "the kernel left output elements unwritten"
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])
    used = used_slots(case)
    assert torch.equal(
        k_pool.view(-1, num_kv_heads, head_dim)[used], case.k_pool.view(-1, num_kv_heads, head_dim)[used]
    )
    if padding_seqs:
        assert torch.equal(out[-padding_seqs:], torch.zeros_like(out[-padding_seqs:]))


@pytest.mark.parametrize("block_size", [1, 8, 16, 32])
def test_store_kv_writes_slots_and_skips_padding(block_size):
    case = make_case([3, 1, 5], [4, 9, 0], block_size, 4, 2, 64, seed=block_size)
    case.slot_mapping[[1, 7]] = -1  # two padding rows
    k_pool, v_pool = case.k_pool.clone(), case.v_pool.clone()
    kernels.store_kv(case.key, case.value, k_pool, v_pool, case.slot_mapping)
    flat_k, flat_v = k_pool.view(-1, 2, 64), v_pool.view(-1, 2, 64)
    keep = case.slot_mapping >= 0
    assert torch.equal(flat_k[case.slot_mapping[keep]], case.key[keep])
    assert torch.equal(flat_v[case.slot_mapping[keep]], case.value[keep])
    changed = (flat_k != case.k_pool.view(-1, 2, 64)).any(-1).any(-1).nonzero().flatten()
    assert sorted(changed.tolist()) == sorted(case.slot_mapping[keep].tolist())  # nothing else written
    reference.store_kv(case.key, case.value, case.k_pool, case.v_pool, case.slot_mapping)
    assert torch.equal(k_pool, case.k_pool) and torch.equal(v_pool, case.v_pool)


def test_store_kv_casts_to_the_pool_dtype():
    case = make_case([4], [0], 8, 2, 2, 64, seed=1)
    k_pool = torch.zeros_like(case.k_pool, dtype=torch.float16)
    v_pool = torch.zeros_like(k_pool)
    kernels.store_kv(case.key, case.value, k_pool, v_pool, case.slot_mapping)
    assert torch.equal(k_pool.view(-1, 2, 64)[case.slot_mapping], case.key.half())


def test_split_and_unsplit_agree_on_a_long_decode(poison_allocations):
    """Flash-decoding changes only the order of the sum: 1, 2, 5 and 16 splits agree in fp32."""
    case = make_case([1, 1, 6], [250, 90, 40], 16, 8, 2, 64, seed=3)
    outs = [run_step(case, num_kv_splits=n, tile_n=16)[0] for n in (1, 2, 5, 16)]
    expected = run_step(case, num_kv_splits=1)[1]
    for out in outs:
        torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(outs[0], outs[3], atol=2e-6, rtol=1e-6)


def test_sequences_much_longer_than_each_other_share_one_launch(poison_allocations):
    """A 1-token prompt, a 40-token prompt and a 120-token decode in one batch, block size 1."""
    case = make_case([1, 40, 1], [0, 0, 119], 1, 6, 2, 64, seed=4, padding_seqs=2)
    out, expected, _ = run_step(case, num_kv_splits=1)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)


def test_tile_config_asserts_dot_shapes():
    config = choose_tiles(num_heads=9, num_kv_heads=3, head_dim=64, max_query_len=1)
    assert (config.group, config.block_m, config.block_q) == (3, 16, 5)
    prefill = choose_tiles(num_heads=32, num_kv_heads=4, head_dim=64, max_query_len=100)
    assert (prefill.block_m, prefill.block_q, prefill.tile_n) == (64, 8, 128)
    assert choose_tiles(32, 8, 128, 1).tile_n == 64
    assert choose_tiles(32, 1, 80, 1).block_m == 32 and choose_tiles(32, 1, 80, 1).head_dim_padded == 128
    with pytest.raises(ValueError, match="at least 16"):
        choose_tiles(8, 8, 64, 1, tile_n=8)
    with pytest.raises(ValueError, match="powers of 2"):
        choose_tiles(8, 8, 64, 1, tile_n=48)
    with pytest.raises(ValueError, match="evenly"):
        choose_tiles(9, 2, 64, 1)
    with pytest.raises(ValueError, match="fit"):
        TileConfig(group=8, block_m=16, block_q=4, tile_n=16, head_dim=64, head_dim_padded=64).check()


def test_split_heuristic():
    assert choose_num_kv_splits(num_programs=4, max_seq_len=32768, num_sms=132) == 64  # 1 seq, 32k: the cap
    assert choose_num_kv_splits(num_programs=32, max_seq_len=4096, num_sms=132) == 16  # 8 seqs: 256-key pieces
    assert choose_num_kv_splits(num_programs=4, max_seq_len=2048, num_sms=132) == 8  # short: few splits
    assert choose_num_kv_splits(num_programs=256, max_seq_len=4096, num_sms=132) == 1  # grid fills the GPU
    assert choose_num_kv_splits(num_programs=4, max_seq_len=300, num_sms=132) == 1  # too short to split
    assert choose_num_kv_splits(num_programs=4, max_seq_len=32768, num_sms=None) == 1  # interpreter


@pytest.mark.parametrize("block_size,seq_len,query_len,splits", [(1, 37, 1, 2), (4, 32, 12, 1), (16, 100, 30, 3)])
def test_kernel_tiles_cover_exactly_the_visible_keys(block_size, seq_len, query_len, splits):
    table = random.Random(block_size).sample(range(200), -(-seq_len // block_size))
    config = choose_tiles(9, 3, 64, query_len, tile_n=16, block_m=16)
    tiles = kernel_tiles(table, block_size, seq_len, query_len, config, splits)
    context_len = seq_len - query_len
    for program in range(-(-query_len // config.block_q)):
        mine = [t for t in tiles if t.program == program]
        keys = [k for t in mine for k in t.keys]
        last_row = min(query_len, (program + 1) * config.block_q) - 1
        assert keys == list(range(context_len + last_row + 1))  # each visible key once, in order
        for t in mine:
            assert list(t.blocks) == list(dict.fromkeys(table[k // block_size] for k in t.keys))
    assert {t.split for t in tiles} == set(range(splits))


def test_launch_figure_draws_one_rectangle_per_tile():
    """Chapter 11's figure: one panel per sequence, one rectangle per (query tile, KV tile), each block named."""
    import matplotlib

    from lifeofprompt.figures.tiles import launch_figure
    from lifeofprompt.lessons.kernel_tiles import LaunchTiles, SequenceTiles

    matplotlib.use("Agg")
    decode_table = [7, 2, 11, 4, 9, 0, 5, 13, 1, 8, 19, 22, 18, 25, 20, 23]  # shuffled, as after some churn
    prefill_table = [3, 12, 6, 10, 21, 15, 24, 17]
    config = choose_tiles(9, 3, 64, 12, tile_n=16, block_m=16)
    plan = LaunchTiles(config, 2, 4, [SequenceTiles(decode_table, 61, 1), SequenceTiles(prefill_table, 32, 12)])
    fig = launch_figure(plan)
    top, bottom = fig.axes
    assert len(top.patches) == len(kernel_tiles(decode_table, 4, 61, 1, config, 2)) == 4  # 61 keys / 16
    assert len(bottom.patches) == len(kernel_tiles(prefill_table, 4, 32, 12, config, 2)) == len(plan.tiles(1)) > 2
    texts = [t.get_text() for t in top.texts]
    assert texts[:3] == ["block 7", "block 2", "block 11"] and len(texts) == 16
    assert "decode" in top.get_title() and "prefill" in bottom.get_title()


def test_interpreter_is_on_without_cuda():
    if not torch.cuda.is_available():
        assert os.environ.get("TRITON_INTERPRET") == "1" and kernels.INTERPRETED


def test_compare_with_reference_reports_the_difference():
    """The notebook's one-call check: a decode row and a chunked prefill, SmolLM2's heads, block size 4."""
    case = make_case([1, 12], [60, 20], 4, 9, 3, 64, seed=8)
    report = compare_with_reference(case, num_kv_splits=2, tile_n=16)
    assert report["pools_equal"] and (report["rows"], report["heads"]) == (13, 9)
    assert report["max_abs_diff"] < 2e-5


def test_compiled_kernels_refuse_cpu_tensors_with_a_clear_error(monkeypatch):
    from lifeofprompt.errors import ConfigError

    module = importlib.import_module("lifeofprompt.kernels.paged_attention")  # the module, not the function
    monkeypatch.setattr(module, "INTERPRETED", False)
    case = make_case([1], [3], 4, 2, 1, 64)
    with pytest.raises(ConfigError, match="backend='torch'"):
        kernels.paged_attention(*case.attention_args())
    with pytest.raises(ConfigError, match="TRITON_INTERPRET=1"):
        kernels.store_kv(case.key, case.value, case.k_pool, case.v_pool, case.slot_mapping)


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter mode is only switched on without CUDA")
def test_import_order_interpreter_mode_in_fresh_processes():
    """env_report leaves Triton unimported, so the kernels still switch the interpreter on after it;
    Triton imported first (its helpers compiled-mode) gives a clear error instead of a crash mid-kernel."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    after_report = (
        "from lifeofprompt import env_report; env_report(); import lifeofprompt.kernels as k; "
        "from lifeofprompt.lessons.paged_cases import make_case, compare_with_reference; "
        "print(k.INTERPRETED, compare_with_reference(make_case([1], [20], 8, 2, 1, 64))['pools_equal'])"
    )
    run = subprocess.run([sys.executable, "-c", after_report], env=env, capture_output=True, text=True, timeout=300)
    assert run.stdout.split() == ["True", "True"], run.stderr
    triton_first = "import triton; import lifeofprompt.kernels"
    run = subprocess.run([sys.executable, "-c", triton_first], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode != 0 and "ConfigError" in run.stderr and "TRITON_INTERPRET=1" in run.stderr


@pytest.mark.parametrize("num_kv_splits", [1, 3])
def test_fp16_kernel_is_as_precise_as_the_reference(num_kv_splits):
    """Against fp32 attention on the same fp16 inputs, the kernel's error is about the reference's own
    (its output rounding), though it rounds the softmax weights to fp16 for the second tl.dot."""
    case = make_case([1, 1, 20], [90, 3, 30], 8, 8, 2, 64, dtype=torch.float16, seed=9)
    err = errors_against_fp32(case, num_kv_splits=num_kv_splits, tile_n=32)
    assert err["reference_rms"] > 0
    assert err["kernel_rms"] <= 1.5 * err["reference_rms"], err
    assert err["kernel_max"] <= 2 * err["reference_max"], err

"""ModelRunner on the CPU: the flat batch, the padded decode the CUDA graphs replay, the graph ladder, sampling."""

from __future__ import annotations

import os

import pytest
import torch

from lifeofprompt.engine.cuda_graphs import graph_batch_sizes, padded_batch_size
from lifeofprompt.engine.memory import kv_bytes_per_block
from lifeofprompt.engine.model_runner import ModelRunner
from lifeofprompt.engine.sampling_params import SamplingParams
from lifeofprompt.engine.sequence import Sequence
from lifeofprompt.errors import ConfigError
from lifeofprompt.lessons.greedy_loop import run_greedy_loop
from lifeofprompt.model.attention_backends import resolve_backend as attention_backend
from lifeofprompt.model.linear import onednn_available

# generate_cached_batch's greedy tokens for the three story prompts (pinned here too); every step decided far
# beyond fp32 rounding (tests/test_pins.py), so any product path, padding or CPU must give them exactly
STORY_8 = [
    [2026, 365, 10905, 6176, 28, 4836, 260, 3589],
    [281, 260, 216, 34, 33, 302, 2070, 30],
    [506, 787, 737, 288, 536, 357, 30, 198],
]


def test_graph_ladder_and_padding():
    assert graph_batch_sizes(256) == [1, 2, 4, 8] + list(range(16, 257, 16))
    assert graph_batch_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert graph_batch_sizes(1) == [1]
    sizes = graph_batch_sizes(40)
    assert [padded_batch_size(b, sizes) for b in (1, 3, 5, 9, 17, 33, 40, 41)] == [1, 4, 8, 16, 32, 40, 40, None]
    with pytest.raises(ConfigError):
        graph_batch_sizes(0)


def test_backend_choice():
    assert attention_backend("auto", torch.device("cpu")) == "torch"
    assert attention_backend("auto", torch.device("cuda")) == "triton"
    assert attention_backend("triton", torch.device("cpu")) == "triton"
    with pytest.raises(ConfigError):
        attention_backend("cuda", torch.device("cpu"))


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def runner(smollm2):
    model, _ = smollm2
    return ModelRunner.for_model(model, num_kv_blocks=64, max_num_seqs=4, max_model_len=256)


def test_cpu_runner_defaults(runner):
    r = runner.resolved
    assert (r.attention_backend, r.cuda_graphs, runner.graphs) == ("torch", False, None)
    assert graph_batch_sizes(r.max_num_seqs) == [1, 2, 4] and r.max_blocks_per_seq == 16
    assert runner.kv_cache.kv.dtype == torch.float32 and r.num_kv_blocks == 64
    # the tests pin one product path (tests/conftest.py), so no packed copies and no timing
    pinned = os.environ["LIFEOFPROMPT_CPU_TUNING"]  # "linear" unless a portability setting forces one
    assert runner.speedups.linear_choice.source == f"pinned: {pinned}"
    assert (runner.speedups.prepacked_bytes > 0) == (pinned == "onednn")


@pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN")
def test_onednn_prepacks_every_matrix_and_can_be_turned_off(smollm2, story_ids):
    model, _ = smollm2
    settings = dict(num_kv_blocks=64, max_num_seqs=4, max_model_len=256)
    packed = ModelRunner.for_model(model, cpu_tuning="onednn", **settings)
    # every matrix of the model (120 layer matrices + the tied lm_head) prepacked for oneDNN
    weights = sum(p.numel() for n, p in model.named_parameters() if n.endswith("proj.weight"))
    assert packed.speedups.prepacked_bytes == 4 * (weights + 49152 * 576)
    with pytest.raises(ConfigError, match="not available"):  # no packed copies: no oneDNN path
        ModelRunner.for_model(model, cpu_tuning="onednn", prepack_cpu_weights=False, **settings)
    lean = ModelRunner.for_model(model, prepack_cpu_weights=False, **settings)
    assert lean.speedups.prepacked_bytes == 0 and all(getattr(m, "packed", None) is None for m in model.modules())
    assert run_greedy_loop(lean, story_ids, 8) == STORY_8  # the pinned path again, without packed copies


@pytest.mark.numerics
def test_greedy_matches_the_cached_generator(runner, story_ids):
    assert run_greedy_loop(runner, story_ids, 8) == STORY_8


@pytest.mark.numerics
def test_padded_static_decode_gives_the_same_tokens(runner, story_ids):
    """The computation a CUDA graph replays (3 sequences padded to 4, slot -1) run eagerly."""
    runner.start_decode_graphs(capture=False)
    try:
        assert run_greedy_loop(runner, story_ids, 8) == STORY_8
    finally:
        runner.graphs = None


def test_fill_static_decode_pads_rows(runner):
    seqs = []
    for i, (n, table) in enumerate([(5, [7]), (20, [3, 9])]):
        seq = Sequence(f"s{i}", list(range(10, 10 + n)), SamplingParams(temperature=0))
        seq.block_table, seq.num_computed_tokens = table, n - 1
        seqs.append(seq)
    runner.start_decode_graphs(capture=False)
    buffers, runner.graphs = runner.graphs, None
    buffers.fill(seqs, 4)
    assert buffers.static_input_ids[:4].tolist() == [14, 29, 0, 0]
    assert buffers.static_positions[:4].tolist() == [4, 19, 0, 0]
    assert buffers.static_slot_mapping[:4].tolist() == [7 * 16 + 4, 9 * 16 + 3, -1, -1]
    assert buffers.static_seq_lens[:4].tolist() == [5, 20, 1, 1]
    assert buffers.static_block_tables[:4, :3].tolist() == [[7, 0, 0], [3, 9, 0], [0, 0, 0], [0, 0, 0]]
    meta = buffers.static_decode_metadata(4)
    assert meta.max_seq_len == 256 and meta.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert meta.block_tables.shape == (4, 16)


@pytest.mark.numerics
def test_mid_prompt_chunk_samples_nothing_and_logprobs_come_back(runner, story_ids):
    params = SamplingParams(temperature=0, logprobs=3)
    seq = Sequence("c", story_ids[1], params)
    seq.block_table = [5]
    first = step_and_return(runner, seq, 4)
    assert first.tokens == [None] and first.logprobs == [None]
    second = step_and_return(runner, seq, len(seq) - 4)
    assert second.tokens == [STORY_8[1][0]]
    chosen, top = second.logprobs[0]
    assert list(top)[0] == STORY_8[1][0] and len(top) == 3 and chosen == max(top.values()) < 0


def step_and_return(runner, seq, n):
    out = runner.execute([seq], [n])
    seq.num_computed_tokens += n
    if out.tokens[0] is not None:
        seq.output_token_ids.append(out.tokens[0])
    return out


def test_seeded_sampling_repeats_through_the_runner(runner, story_ids):
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    a = run_greedy_loop(runner, story_ids[:1], 6, params=params)
    b = run_greedy_loop(runner, story_ids[:1], 6, params=params)
    assert a == b and a != [STORY_8[0][:6]]


def test_cpu_pool_sizing(smollm2):
    model, _ = smollm2
    small = ModelRunner.for_model(model, max_num_seqs=2, max_model_len=64, kv_cache_memory=1 << 30)
    assert small.resolved.num_kv_blocks == 2 * 4 + 1  # capped at what 2 full sequences could use
    per_block = kv_bytes_per_block(model.config, model.dtype, 16)
    assert per_block == 2 * 30 * 3 * 64 * 16 * 4  # layers × kv heads × head_dim × tokens × fp32, K and V
    tight = ModelRunner.for_model(model, max_num_seqs=256, kv_cache_memory=10 * per_block)
    assert tight.resolved.num_kv_blocks == 10
    with pytest.raises(ConfigError):
        ModelRunner.for_model(model, num_kv_blocks=4, block_size=0)

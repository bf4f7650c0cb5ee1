"""The fused C decode step (cpu/c_step.c) against the torch forward, and the weights' 2 MiB pages."""

import copy
import itertools
import random
from pathlib import Path

import pytest
import torch
from torch import nn

from lifeofprompt import LLM, SamplingParams
from lifeofprompt.cpu import c_step, huge_pages
from lifeofprompt.cpu.block_kernels import blocks_linear
from lifeofprompt.engine.model_runner import ModelRunner
from lifeofprompt.engine.sampling_params import SamplingParams as Params
from lifeofprompt.engine.sequence import Sequence
from lifeofprompt.errors import ConfigError
from lifeofprompt.lessons.agreement import FP32_TOLERANCE, assert_greedy_agrees, teacher_forced_logits, top2_margins
from lifeofprompt.model import quantized_linear
from lifeofprompt.model.block_formats import quantize
from lifeofprompt.model.config import ModelConfig
from lifeofprompt.model.linear import RowPlan
from lifeofprompt.model.llama import LlamaForCausalLM
from lifeofprompt.model.quantized_linear import QuantizedLinear, quantize_model
from lifeofprompt.story import STORY_PROMPTS

pytestmark = [
    pytest.mark.numerics,
    pytest.mark.skipif(c_step.step_kernel() is None, reason="no C compiler: the fused step is not offered"),
]


def random_model(rng: random.Random, packable: bool = False) -> LlamaForCausalLM:
    """A 2-layer Llama of random shape: GQA groups of 1-3, head sizes and widths that are not multiples
    of the vector width (some matrices then stay row-major in the C step); with ``packable``, shapes
    whose four matrices all take the packed layout."""
    kv_heads, group, head_dim = rng.choice([1, 2, 3]), rng.choice([1, 2, 3]), rng.choice([8, 16, 34])
    hidden, inter = rng.choice([40, 64, 100]), rng.choice([36, 96, 130])
    if packable:
        head_dim, hidden, inter = 32, rng.choice([32, 64, 96]), rng.choice([32, 96, 160])
    config = ModelConfig(
        name="random",
        vocab_size=97,
        hidden_size=hidden,
        intermediate_size=inter,
        num_layers=2,
        num_heads=kv_heads * group,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        tie_word_embeddings=rng.random() < 0.5,
    )
    torch.manual_seed(rng.randrange(1 << 30))
    model = LlamaForCausalLM(config).eval()
    for param in model.parameters():
        nn.init.normal_(param, std=0.3)
    return model


def step_batch(runner: ModelRunner, rng: random.Random, num_seqs: int, mixed: bool = False):
    """Sequences with random cached contexts (0-40 tokens) in scattered blocks, and the tokens each runs.

    Each decodes one token, or with ``mixed`` some run 2-6 (a verify's rows or a prompt chunk,
    causal among themselves). Returns ``(seqs, num_scheduled_tokens)``.
    """
    blocks = list(range(runner.resolved.num_kv_blocks))
    rng.shuffle(blocks)
    seqs, scheduled = [], []
    for i in range(num_seqs):
        context, new = rng.randrange(0, 41), rng.choice([1, 1, rng.randrange(2, 7)]) if mixed else 1
        seq = Sequence(f"s{i}", [rng.randrange(97) for _ in range(context + new)], Params(temperature=0))
        seq.num_computed_tokens = context
        needed = (context + new - 1) // runner.resolved.block_size + 1
        seq.block_table, blocks = blocks[:needed], blocks[needed:]
        seqs.append(seq)
        scheduled.append(new)
    return seqs, scheduled


def assert_c_step_computes_the_torch_forward(model, rng: random.Random, threads: int, mixed: bool) -> None:
    """One step of random sequences (``step_batch``) in C and by the torch forward: the same hidden
    states, and the same KV rows written."""
    block_size = rng.choice([1, 4, 16])
    runner = ModelRunner.for_model(
        model,
        num_kv_blocks=64 * 41 // block_size + 64,
        block_size=block_size,
        attention_backend="torch",
        max_num_seqs=8,
        cpu_tuning="c-step",
    )
    runner.kv_cache.kv.normal_()  # stale values everywhere: only the right slots may be read
    seqs, scheduled = step_batch(runner, rng, rng.randrange(1, 7), mixed=mixed)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        before = runner.kv_cache.kv.clone()
        with c_step.running(model, None):  # the torch layers
            want = model.hidden_states(*runner.prepare(seqs, scheduled))
        want_kv = runner.kv_cache.kv.clone()
        runner.kv_cache.kv.copy_(before)
        assert model.cpu_step is not None  # the runner gave the model its C step
        with c_step.running(model, c_step.CStep.only(c_step.PACKED)):
            got = model.hidden_states(*runner.prepare(seqs, scheduled))
    finally:
        torch.set_num_threads(previous)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    written = (want_kv != before).flatten(0, 1).flatten(2).any(-1)  # [layers * 2, slots]
    assert written.any()
    assert torch.equal((runner.kv_cache.kv != before).flatten(0, 1).flatten(2).any(-1), written)
    torch.testing.assert_close(runner.kv_cache.kv, want_kv, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("seed", range(12))
@torch.no_grad()
def test_the_c_step_computes_the_torch_forward(seed, threads):
    """Random shapes, block sizes, contexts and scattered blocks; one-token decodes, and (odd seeds)
    steps that mix them with rows of verifies and prompt chunks: the same hidden states and the
    same KV rows written. Seeds from 8 on take shapes the packed layout holds for every matrix."""
    rng = random.Random(seed)
    model = random_model(rng, packable=seed >= 8)
    if seed >= 8:
        assert all(c_step.packable(model).values())
    assert_c_step_computes_the_torch_forward(model, rng, threads, mixed=seed % 2 == 1)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("fmt", ["q8_0", "q4_1"])
@pytest.mark.parametrize("seed", range(6))
@torch.no_grad()
def test_the_c_step_reads_blocks_and_computes_the_dequantized_forward(seed, fmt, threads, monkeypatch):
    """A model whose layer matrices are GGUF blocks (``quantize_model``): the C step reads the blocks
    themselves, and computes what the torch forward does with every matrix dequantized (the kernel
    taken out of the torch path, so the two share no product code). The random widths include ones
    that are not whole blocks of 32 (40, 100, 36, 130; heads of 34), and (seed 5) a model with
    a packable shape, which still gets no packed copy."""
    monkeypatch.setattr(quantized_linear, "cpu_kernel_rows", lambda: 0)
    rng = random.Random(100 + seed)
    model = quantize_model(random_model(rng, packable=seed == 5), fmt)
    assert c_step.supports(model) and not any(c_step.packable(model).values())
    assert_c_step_computes_the_torch_forward(model, rng, threads, mixed=seed % 2 == 1)


@torch.no_grad()
def test_each_matrix_is_read_in_its_own_format(monkeypatch):
    """Formats mixed across layers and matrices (as a GGUF may mix them): layer 0 all Q4_1; in
    layer 1 an fp32 o_proj, a Q8_0 gate_up and Q4_1 qkv and down. Each is read as it is stored."""
    monkeypatch.setattr(quantized_linear, "cpu_kernel_rows", lambda: 0)
    rng = random.Random(7)
    model = quantize_model(random_model(rng, packable=True), "q4_1")
    layer = model.layers[1]
    o = nn.Linear(layer.self_attn.o_proj.in_features, layer.self_attn.o_proj.out_features, bias=False)
    o.weight.data = layer.self_attn.o_proj.blocks.dequantize()
    layer.self_attn.o_proj = o
    layer.mlp.gate_up_proj = QuantizedLinear(quantize(layer.mlp.gate_up_proj.blocks.dequantize(), "q8_0"))
    formats = [[m.format for m in (p.qkv, p.o, p.gate_up, p.down)] for p in c_step.weight_pointers(model)]
    codes = c_step.FORMAT_CODES
    assert formats == [[codes["q4_1"]] * 4, [codes["q4_1"], codes["fp32"], codes["q8_0"], codes["q4_1"]]]
    assert c_step.matrix_formats(model) == {"qkv": "q4_1", "o": "fp32,q4_1", "gate_up": "q4_1,q8_0", "down": "q4_1"}
    assert_c_step_computes_the_torch_forward(model, rng, threads=2, mixed=True)


def test_block_matrices_get_no_packed_copy_and_are_read_as_blocks():
    model = quantize_model(random_model(random.Random(9), packable=True), "q8_0")
    assert c_step.packable(model) == dict.fromkeys(c_step.MATRICES, False)
    assert c_step.pack_all(model) == c_step.packed_bytes(model) == 0
    down, described = model.layers[1].mlp.down_proj, c_step.weight_pointers(model)[1].down
    assert (described.format, described.data, described.scales, described.mins) == (
        c_step.FORMAT_CODES["q8_0"],
        down.quants.data_ptr(),
        down.scales.data_ptr(),
        None,
    )


def test_a_model_quantized_after_a_c_step_or_copied_is_described_afresh():
    """The step's pointers are kept on the model, stamped with its tensors: a copy of the model, or the
    same model once its matrices became blocks, gets its own."""
    model = random_model(random.Random(9), packable=True)
    fp32 = c_step.weight_pointers(model)
    twin = copy.deepcopy(model)  # ctypes arrays of pointers do not copy: the copy starts without them
    assert c_step.weight_pointers(twin)[0].qkv.data != fp32[0].qkv.data
    quantize_model(model, "q4_1")
    qkv = c_step.weight_pointers(model)[0].qkv
    assert (qkv.format, qkv.data) == (
        c_step.FORMAT_CODES["q4_1"],
        model.layers[0].self_attn.qkv_proj.quants.data_ptr(),
    )


def test_the_c_step_timing_is_kept_apart_for_each_format():
    """The measured row limit is cached per model shape and per format: a quantized model's steps are
    not the fp32 model's."""
    fp32 = random_model(random.Random(2), packable=True)
    blocks = quantize_model(copy.deepcopy(fp32), "q4_1")
    key = lambda model: c_step.measured_step_key(model, {}, 16, False)
    assert key(fp32) != key(blocks)
    assert key(blocks)["formats"] == dict.fromkeys(c_step.MATRICES, "q4_1")
    assert key(fp32)["formats"] == dict.fromkeys(c_step.MATRICES, "fp32")
    assert c_step.layer_shapes(blocks) == c_step.layer_shapes(fp32)


def test_the_packed_layout_stores_panels_of_rows_column_by_column():
    """Element (row, column) of a packed weight sits in its panel of ``panel_rows`` rows, at its
    column within the panel, at its row within that column: checked on every element, and the
    copy made into a given buffer is the same."""
    panel_rows, _ = c_step.packed_layout()
    out, inner = 3 * panel_rows, 5
    weight = torch.arange(out * inner, dtype=torch.float32).view(out, inner)
    packed = c_step.pack(weight).flatten()
    rows, cols = torch.meshgrid(torch.arange(out), torch.arange(inner), indexing="ij")
    where = (rows // panel_rows) * panel_rows * inner + cols * panel_rows + rows % panel_rows
    assert torch.equal(packed[where.flatten()], weight.flatten())
    buffer = torch.empty(out * inner)
    assert torch.equal(c_step.pack(weight, out=buffer).flatten(), packed) and torch.equal(buffer, packed)


def test_all_copies_are_made_at_once_and_read_by_the_step():
    """``pack_all`` packs every packable matrix (in huge pages where the system gives them) and the
    C step's pointers then lead to those copies."""
    model = random_model(random.Random(9), packable=True)
    assert c_step.pack_all(model) == c_step.packed_bytes(model) > 0
    down = model.layers[1].mlp.down_proj
    assert torch.equal(c_step.packed_weight(down), c_step.pack(down.weight))
    assert c_step.weight_pointers(model)[1].down.data == c_step.packed_weight(down).data_ptr()


def test_packing_all_again_keeps_current_copies_and_renews_stale_ones():
    """The runner packs before timing the C step and again before serving: the second call makes nothing
    new while every copy is current, and packs afresh once a weight changed."""
    model = random_model(random.Random(9), packable=True)
    c_step.pack_all(model)
    down = model.layers[1].mlp.down_proj
    copy = c_step.packed_weight(down)
    assert c_step.pack_all(model) == c_step.packed_bytes(model) and c_step.packed_weight(down) is copy
    with torch.no_grad():
        down.weight.mul_(2)
    c_step.pack_all(model)
    assert c_step.packed_weight(down) is not copy
    assert torch.equal(c_step.packed_weight(down), c_step.pack(down.weight))


def test_the_packed_copy_follows_the_weights():
    """A weight written in place after the first C step is packed again: the C step never reads stale weights."""
    model = random_model(random.Random(3), packable=True)
    first = c_step.weight_pointers(model)
    assert c_step.weight_pointers(model) is first  # unchanged weights: the same copy
    with torch.no_grad():
        model.layers[0].mlp.down_proj.weight.mul_(2)
    assert c_step.weight_pointers(model) is not first
    down = model.layers[0].mlp.down_proj
    assert torch.equal(c_step.packed_weight(down), c_step.pack(down.weight))
    assert c_step.weight_pointers(model)[0].down.data == c_step.packed_weight(down).data_ptr()


def test_rows_follow_the_calibrated_choice():
    """The C step runs for as many rows as ``rowwise`` is every layer matrix's choice, and never where it is not."""
    shapes = {(48, 16), (16, 16)}
    two = RowPlan(("rowwise",) * 2 + ("onednn",) * 14, "onednn")
    assert c_step.usable_rows({(48, 16): two, (16, 16): RowPlan.single("rowwise")}, shapes) == 2
    assert c_step.usable_rows({(48, 16): RowPlan.single("linear"), (16, 16): two}, shapes) == 0
    assert c_step.usable_rows(None, shapes) == 0


def test_rowwise_within_noise_of_the_best_still_takes_the_c_step():
    """A shape whose choice at 2 rows was another path by a hair keeps the C step; by a wide margin it does not."""
    shapes = {(48, 16), (16, 16)}
    plans = {
        (48, 16): RowPlan(("rowwise", "transposed") + ("onednn",) * 14, "onednn"),
        (16, 16): RowPlan.single("rowwise"),
    }
    close = {
        "48x16": {
            "1": {"rowwise": 1.0, "transposed": 1.1},
            "2": {"rowwise": 2.1, "transposed": 2.0},
            "4": {"rowwise": 6.0, "onednn": 3.0},
        }
    }
    assert c_step.usable_rows(plans, shapes, close) == 3  # 3 rows take 2 rows' measurement
    far = {"48x16": {1: {"rowwise": 1.0}, 2: {"rowwise": 3.0, "transposed": 2.0}}}
    assert c_step.usable_rows(plans, shapes, far) == 1


ONE = ("packed",)  # the C step in one layout only (the row-limit tests)


@pytest.fixture
def all_rounds(monkeypatch):
    """Every count timed the given number of rounds, however long or short its fake steps."""
    monkeypatch.setattr(c_step, "LONG_STEP_S", float("inf"))
    monkeypatch.setattr(c_step, "SHORT_STEP_S", 0.0)


def fake_step_timer(c_ms: dict, torch_ms: dict, calls: list, row_major_ms: dict | None = None):
    """A ``measure(rows, fused)`` that returns set times (ms) and records what was asked."""

    def measure(rows, fused):
        calls.append((rows, fused))
        times = {"packed": c_ms, "row-major": row_major_ms, "torch": torch_ms}[fused]
        value = times[rows]
        return (
            value.pop(0)
            if isinstance(value, list) and len(value) > 1
            else (value[0] if isinstance(value, list) else value)
        ) / 1e3

    return measure


def test_whole_steps_decide_the_rows_and_the_timing_stops_at_the_first_loss(all_rounds):
    """The C step takes steps up to the largest row count where it won, all smaller counts won too,
    and counts above the first loss are never timed."""
    calls = []
    c = {n: 10 * n for n in range(1, 17)}
    eager = {n: 10 * n + (5 if n <= 8 else -5) for n in range(1, 17)}  # C wins up to 8 rows
    answer, why = c_step.measured_rows(fake_step_timer(c, eager, calls), row_counts=(1, 2, 4, 8, 12, 16), c_paths=ONE)
    assert answer["rows"] == 8
    assert "8 rows: C 80.0 ms, torch 85.0 ms" in why and "12 rows: C 120.0 ms, torch 115.0 ms" in why
    assert {r for r, _ in calls} == {1, 2, 4, 8, 12, 10, 9}  # 16 is above the first loss: never run
    # a loss at a small count ends it there, even where larger counts would win
    answer, _ = c_step.measured_rows(fake_step_timer({**c, 2: 40}, eager, []), c_paths=ONE)
    assert answer["rows"] == 1
    # each side is its fastest round: one slow round of the C step does not lose the count
    noisy = {
        r: [t * 3] * (2 if r == 1 else 1) + [t] for r, t in c.items()
    }  # (warm-up: first count), round 1 slow; 2 fast
    answer, _ = c_step.measured_rows(fake_step_timer(noisy, eager, []), row_counts=(1, 2, 4, 8), rounds=2, c_paths=ONE)
    assert answer["rows"] == 8


def test_the_gap_between_the_last_win_and_the_first_loss_is_halved_until_it_closes(all_rounds):
    """4 won, 8 lost: 6 and then 5 or 7 are measured, so a 5-row verify is not sent eager for want of a measurement."""
    c = {n: 10 * n for n in range(1, 17)}
    eager = {n: 10 * n + (5 if n <= 6 else -5) for n in range(1, 17)}  # C wins up to 6 rows
    calls = []
    answer, why = c_step.measured_rows(fake_step_timer(c, eager, calls), row_counts=(1, 2, 4, 8, 16), c_paths=ONE)
    assert answer["rows"] == 6
    assert {r for r, _ in calls} == {1, 2, 4, 8, 6, 7}
    assert why.index("6 rows") < why.index("7 rows") < why.index("8 rows")  # listed by row count


def test_each_count_takes_its_faster_layout_and_the_c_step_the_faster_of_the_two(all_rounds):
    """Packed wins at 1-4 rows, row-major from 8: the layouts follow; the row limit counts the faster
    layout (at 10 and 11 rows only row-major beats torch)."""
    packed = {n: 10 * n + (0 if n < 10 else 15) for n in range(1, 17)}
    row_major = {n: 10 * n + (2 if n < 8 else -8) for n in range(1, 17)}  # within LAYOUT_SLACK of packed at 1 row
    eager = {n: 10 * n + (2 if n < 12 else -20) for n in range(1, 17)}  # 10 rows: packed 115 loses to 102
    calls = []
    answer, why = c_step.measured_rows(fake_step_timer(packed, eager, calls, row_major), row_counts=(1, 2, 4, 8, 12))
    assert answer["rows"] == 11  # packed alone would have stopped at 9
    assert answer["layouts"] == {
        1: "packed",
        2: "packed",
        4: "packed",
        8: "row-major",
        12: "row-major",
        10: "row-major",
        11: "row-major",
    }
    assert (1, "row-major") in calls and (2, "row-major") in calls
    assert "8 rows: C 80.0 ms (row-major 72.0), torch 82.0 ms" in why
    assert answer["seconds"][8] == pytest.approx(0.072) and answer["seconds"][2] == pytest.approx(
        0.020
    )  # the faster layout's
    # between measured counts, the largest measured count below decides; nothing measured: packed
    assert [c_step.CStep(16, answer["layouts"]).layout_for(n) for n in (3, 5, 7, 8, 11)] == [
        "packed",
        "packed",
        "packed",
        "row-major",
        "row-major",
    ]
    assert c_step.CStep(16).layout_for(5) == "packed"


def test_a_layout_far_behind_is_not_timed_at_larger_counts(all_rounds):
    """Row-major 30% behind the packed copy at 4 rows: from 8 rows on only the packed one and torch run."""
    packed = {n: 10 * n for n in range(1, 33)}
    row_major = {n: 10 * n * (1.1 if n < 4 else 1.3) for n in range(1, 33)}
    eager = {n: 20 * n for n in range(1, 33)}
    calls = []
    answer, why = c_step.measured_rows(fake_step_timer(packed, eager, calls, row_major), row_counts=(1, 2, 4, 8, 16))
    assert answer["rows"] == 16 and set(answer["layouts"].values()) == {"packed"}
    assert {r for r, p in calls if p == "row-major"} == {1, 2, 4}
    assert {r for r, p in calls if p == "packed"} == {1, 2, 4, 8, 16}


def test_long_steps_are_timed_one_round_fewer_and_short_ones_two_more():
    """C 5 ms a row, torch 10: steps forecast over ``LONG_STEP_S`` (8 rows and up) get rounds - 1,
    the first count and those under ``SHORT_STEP_S`` (2 rows) rounds + 2."""
    c = {n: 5 * n for n in range(1, 17)}
    calls = []
    c_step.measured_rows(
        fake_step_timer(c, {n: 2 * t for n, t in c.items()}, calls), row_counts=(1, 2, 4, 8, 16), rounds=3, c_paths=ONE
    )
    per_count = {n: sum(1 for r, p in calls if r == n and p == "packed") for n in (1, 2, 4, 8, 16)}
    assert per_count == {1: 6, 2: 5, 4: 3, 8: 2, 16: 2}  # 1 row: a warm-up and 5 rounds


def test_the_timing_stops_before_a_count_that_would_overrun_the_budget():
    """The next count's forecast (each path's line through the last two counts) past the budget: not started."""
    slow = {n: 100.0 * n for n in range(1, 65)}  # 0.1 s a row; 8 rows: 2 rounds x (0.8 + 1.6 s) = 4.8 s
    calls = []
    answer, why = c_step.measured_rows(
        fake_step_timer(slow, {n: 2 * t for n, t in slow.items()}, calls),
        row_counts=(1, 2, 4, 8),
        budget_s=4.0,
        c_paths=ONE,
    )
    assert answer["rows"] < 8 and not any(r == 8 for r, _ in calls)
    assert "stopped before" in why and "budget would be spent" in why


def test_a_spent_budget_stops_the_timing_and_says_so():
    answer, why = c_step.measured_rows(fake_step_timer({1: 1, 2: 1}, {1: 2, 2: 2}, []), row_counts=(1, 2), budget_s=0)
    assert answer["rows"] == 0 and "budget would be spent" in why


def test_an_unpinned_runner_times_whole_steps_once_and_reads_the_cache_after(tmp_path, monkeypatch):
    monkeypatch.setenv("LIFEOFPROMPT_CACHE", str(tmp_path))
    monkeypatch.delenv("LIFEOFPROMPT_CPU_TUNING", raising=False)
    model = random_model(random.Random(3))
    asked = []

    def fake_rows(measure, **_):
        asked.append(all(measure(2, way) > 0 for way in ("packed", "row-major", "torch")))  # the real step, each way
        return (
            {
                "rows": 4,
                "layouts": {1: "packed", 2: "row-major", 4: "packed"},
                "seconds": {1: 1e-3, 2: 1e-3, 4: 2e-3},
                "stopped_before": None,
            },
            "2 rows: C 1.0 ms, torch 2.0 ms",
        )

    monkeypatch.setattr("lifeofprompt.cpu.c_step.measured_rows", fake_rows)
    first = ModelRunner.for_model(model, num_kv_blocks=512, block_size=4, attention_backend="torch")
    assert first.speedups.linear_choice.pinned is None
    assert (first.speedups.c_step_rows, first.resolved.cpu.notes["c_step"]) == (4, "2 rows: C 1.0 ms, torch 2.0 ms")
    assert asked == [True]
    second = ModelRunner.for_model(model, num_kv_blocks=512, block_size=4, attention_backend="torch")
    assert second.speedups.c_step_rows == 4 and asked == [True]  # from the cache: not timed again
    assert model.cpu_step.max_rows == 4  # the runner gives the model its C step, which steps of 5 rows skip
    assert [model.cpu_step.layout_for(n) for n in (1, 2, 3, 4)] == ["packed", "row-major", "row-major", "packed"]
    assert second.speedups.packed_bytes == c_step.packed_bytes(model) > 0  # 4 rows read the packed copies
    small = ModelRunner.for_model(
        random_model(random.Random(3)), num_kv_blocks=16, block_size=4, attention_backend="torch"
    )
    assert small.speedups.c_step_rows == 0 and "not measured" in small.resolved.cpu.notes["c_step"]


def test_the_runner_packs_before_it_times_the_c_step(tmp_path, monkeypatch):
    """The packed copies exist, in their final place, before the first timed step: packing inside the
    budget cost a slow CPU 1.4 s of its 3 s, and timed the copies from other pages than the engine's."""
    monkeypatch.setenv("LIFEOFPROMPT_CACHE", str(tmp_path))
    monkeypatch.delenv("LIFEOFPROMPT_CPU_TUNING", raising=False)
    model = random_model(random.Random(3), packable=True)
    seen = []

    def fake_rows(measure, **_):
        seen.append([getattr(m, "_c_step_packed", None) is not None for _, m in c_step.layer_tensors(model) if m])
        return ({"rows": 4, "layouts": {1: "packed"}, "seconds": {1: 1e-3}, "stopped_before": None}, "1 row: C 1.0 ms")

    monkeypatch.setattr("lifeofprompt.cpu.c_step.measured_rows", fake_rows)
    ModelRunner.for_model(model, num_kv_blocks=512, block_size=4, attention_backend="torch")
    assert len(seen) == 1 and seen[0] and all(seen[0])


def stopped_the_first_time(asked: list, stopped_before: int, rows_then: int, rows_after: int):
    """A fake ``measured_rows``: the budget stops it before ``stopped_before`` rows the first time (a busy
    moment), with ``rows_then`` measured; later calls reach ``rows_after``. ``asked`` counts the calls."""

    def fake_rows(measure, **_):
        asked.append(True)
        stopped = stopped_before if len(asked) == 1 else None
        return (
            {
                "rows": rows_then if stopped else rows_after,
                "layouts": {1: "packed"},
                "seconds": {1: 1e-3},
                "stopped_before": stopped,
            },
            "1 row: C 1.0 ms, torch 2.0 ms"
            + (f"; stopped before {stopped} rows: the budget would be spent" if stopped else ""),
        )

    return fake_rows


def test_a_measurement_the_budget_cut_short_is_used_but_not_kept(tmp_path, monkeypatch):
    """A busy machine spends the budget at 1-2 rows: that start uses what it measured, says so, and the
    next start measures again (a cached 1-row limit would have switched speculation off for good)."""
    monkeypatch.setenv("LIFEOFPROMPT_CACHE", str(tmp_path))
    monkeypatch.delenv("LIFEOFPROMPT_CPU_TUNING", raising=False)
    model = random_model(random.Random(3))
    asked = []
    monkeypatch.setattr("lifeofprompt.cpu.c_step.measured_rows", stopped_the_first_time(asked, 2, 1, 8))
    busy = ModelRunner.for_model(model, num_kv_blocks=512, block_size=4, attention_backend="torch")
    assert busy.speedups.c_step_rows == 1 and "not cached" in busy.resolved.cpu.notes["c_step"]
    again = ModelRunner.for_model(model, num_kv_blocks=512, block_size=4, attention_backend="torch")
    assert again.speedups.c_step_rows == 8 and len(asked) == 2  # measured again, and this time kept
    assert (
        ModelRunner.for_model(model, num_kv_blocks=512, block_size=4, attention_backend="torch").speedups.c_step_rows
        == 8
        and len(asked) == 2
    )


def test_the_runner_uses_it_only_where_asked_or_measured():
    model = random_model(random.Random(0))
    pool = dict(num_kv_blocks=16, block_size=4, attention_backend="torch")
    pinned = ModelRunner.for_model(model, cpu_tuning="linear", **pool)
    assert pinned.speedups.c_step_rows == 0  # a pinned non-rowwise path: the torch forward
    assert ModelRunner.for_model(model, cpu_tuning="rowwise", **pool).speedups.c_step_rows == 16
    assert ModelRunner.for_model(model, cpu_tuning="c-step", **pool).speedups.c_step_rows == 16
    with pytest.raises(ConfigError, match="cpu_tuning='linear'"):
        ModelRunner.for_model(model, cpu_decode=False, **pool)  # the old flag: refused, saying how now
    bf16 = random_model(random.Random(0)).to(torch.bfloat16)
    assert ModelRunner.for_model(bf16, cpu_tuning="c-step", **pool).speedups.c_step_rows == 0


@pytest.fixture(scope="module")
def story_greedy():
    """Greedy tokens of the story's prompts through the engine, with and without the C step (fp32)."""
    runs = {}
    for flag in (False, True):
        llm = LLM("smollm2-135m", dtype="float32", cpu_tuning="rowwise" if flag else "linear", log_stats=False)
        assert llm.engine.runner.speedups.c_step_rows == (16 if flag else 0)
        outs = llm.generate(list(STORY_PROMPTS), SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
        runs[flag] = ([list(o.prompt_token_ids) for o in outs], [list(o.outputs[0].token_ids) for o in outs], llm)
    return runs


@pytest.mark.slow
def test_the_engine_gives_the_same_greedy_tokens_with_the_c_step(story_greedy, smollm2):
    prompts, want, _ = story_greedy[False]
    _, got, llm = story_greedy[True]
    assert llm.engine.step_records[-1].launch.path == "c-step (packed)"
    layers = llm.engine.model.layers
    matrices = [
        m.weight
        for layer in layers
        for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
    ]
    assert llm.engine.runner.speedups.packed_bytes == sum(w.numel() * 4 for w in matrices)  # made at start, all four
    assert any("from a packed copy of the layer matrices" in line for line in llm.engine.startup_log)
    model, _ = smollm2
    margins = [top2_margins(teacher_forced_logits(model, p, w)) for p, w in zip(prompts, want)]
    assert_greedy_agrees(got, want, margins, FP32_TOLERANCE, min_steps=int(0.9 * sum(map(len, want))))


CODE = (
    "def area(width, height):\n    return width * height\n\n"
    "def perimeter(width, height):\n    return 2 * (width + height)\n\nRewrite both functions with type hints:\n"
)


@pytest.mark.slow
def test_speculative_verifies_run_in_the_c_step_and_keep_the_greedy_tokens(story_greedy, smollm2):
    """Prompt lookup's k + 1 verify rows go through the C step too (causal among themselves), and the
    tokens are the plain C engine's wherever the margin decides them."""
    _, _, plain = story_greedy[True]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = list(plain.generate([CODE], params)[0].outputs[0].token_ids)
    spec = LLM(
        "smollm2-135m",
        dtype="float32",
        cpu_tuning="rowwise",
        log_stats=False,
        speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4},
    )
    launches = []
    forward = spec.engine.runner.run_model
    spec.engine.runner.run_model = lambda ids, pos, meta: (
        launches.append((ids.shape[0], meta.max_query_len)) or forward(ids, pos, meta)
    )
    out = spec.generate([CODE], params)[0]
    verifies = [rows for rows, query in launches if 1 < rows <= 16 and query == rows]
    assert out.metrics.spec_decode.num_accepted_tokens > 5 and verifies, (
        "prompt lookup should have fired on the code prompt"
    )
    assert spec.engine.step_records[-1].launch.path == "c-step (packed)"
    first = LLM(
        "smollm2-135m",
        dtype="float32",
        cpu_tuning="rowwise",
        log_stats=False,
        speculative_config={"model": "smollm2-135m", "num_speculative_tokens": 2},
    )
    assert first.engine.proposer.speedups.c_step_rows == 16  # a draft of its own: calibrated (pinned), C step too
    model, tokenizer = smollm2
    prompt = tokenizer.encode(CODE)
    margins = [top2_margins(teacher_forced_logits(model, prompt, want))]
    assert_greedy_agrees(
        [list(out.outputs[0].token_ids)], [want], margins, FP32_TOLERANCE, min_steps=int(0.9 * len(want))
    )
    drafted = list(
        first.generate([CODE], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].outputs[0].token_ids
    )
    assert_greedy_agrees([drafted], [want[:8]], [margins[0][:8]], FP32_TOLERANCE, min_steps=7)


@pytest.fixture(scope="module")
def smollm2_q4_1(smollm2):
    """The embedded SmolLM2 with its layer matrices and LM head quantized to Q4_1 at load (a copy: the
    session's model stays fp32)."""
    model, tokenizer = smollm2
    return quantize_model(copy.deepcopy(model), "q4_1"), tokenizer


@pytest.mark.parametrize("rows", [1, 5, 16])  # a decode, a verify of 4 drafts, a prompt chunk
@torch.no_grad()
def test_a_quantized_smollm2_runs_its_steps_in_c(smollm2_q4_1, rows, monkeypatch):
    """SmolLM2 in Q4_1, after a cached prefix of 20 tokens: ``rows`` new tokens (causal among
    themselves) in C against the torch forward with every matrix dequantized. The same hidden
    states and logits up to fp32 summation order; the runner takes the C step and packs nothing."""
    model, tokenizer = smollm2_q4_1
    runner = ModelRunner.for_model(
        model, num_kv_blocks=16, block_size=16, attention_backend="torch", max_num_seqs=8, cpu_tuning="c-step"
    )
    assert runner.speedups.c_step_rows == 16 and runner.speedups.packed_bytes == 0
    text = tokenizer.encode(CODE)  # the code prompt below: 43 tokens
    prefix, new = text[:20], text[20 : 20 + rows]
    first = Sequence("s", prefix, Params(temperature=0))
    first.block_table = [3, 9, 5]  # scattered blocks
    model.hidden_states(*runner.prepare([first], [len(prefix)]))  # the prefix's keys and values
    step = Sequence("s", prefix + new, Params(temperature=0))
    step.num_computed_tokens, step.block_table = len(prefix), [3, 9, 5]
    cache = runner.kv_cache.kv.clone()
    monkeypatch.setattr(quantized_linear, "cpu_kernel_rows", lambda: 0)  # the reference dequantizes every matrix
    with c_step.running(model, None):  # the torch layers
        want = model.hidden_states(*runner.prepare([step], [rows]))
    runner.kv_cache.kv.copy_(cache)
    got = model.hidden_states(*runner.prepare([step], [rows]))  # the C step the runner gave the model
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    logits = model.lm_head(want)  # dequantized
    assert (model.lm_head(got) - logits).abs().max() < FP32_TOLERANCE
    assert (blocks_linear(want, model.lm_head.blocks) - logits).abs().max() < FP32_TOLERANCE  # the block kernel's


def huge_page_bytes(tensor: torch.Tensor) -> int:
    """Bytes of 2 MiB pages the kernel really gave the mapping holding ``tensor`` (``/proc/self/smaps``; 0 elsewhere).

    ``madvise`` is a request, not a promise: this is how the test knows what was granted.
    """
    address = tensor.data_ptr()
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return 0
    inside = False
    for line in lines:
        head = line.split()[0] if line else ""
        if "-" in head and not head.endswith(":"):
            start, end = (int(part, 16) for part in head.split("-"))
            inside = start <= address < end
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1]) * 1024
    return 0


@pytest.mark.skipif(not huge_pages.huge_pages_available(), reason="this system gives no transparent huge pages")
def test_weights_move_to_huge_pages_and_keep_their_values_and_ties():
    model = random_model(random.Random(1))
    model.config.tie_word_embeddings or setattr(model.lm_head, "weight", model.embed_tokens.weight)
    values = {name: p.detach().clone() for name, p in model.named_parameters()}
    moved = huge_pages.move_weights_to_huge_pages(model)
    assert moved >= sum(v.numel() * 4 for v in values.values())
    for name, p in model.named_parameters():
        assert torch.equal(p, values[name]) and p.is_contiguous()
    assert model.lm_head.weight is model.embed_tokens.weight
    assert huge_pages.move_weights_to_huge_pages(model) == 0  # already there: not copied again
    big = huge_pages.huge_page_buffer(8 << 20)
    big.fill_(1)  # pages are granted when first touched
    assert big.data_ptr() % huge_pages.HUGE_PAGE == 0
    assert huge_page_bytes(big) > 0


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("seed", range(15))
@torch.no_grad()
def test_decode_attention_in_c_matches_the_torch_path_in_mixed_steps(seed, threads):
    """A step of decodes (some with no key yet) and prefill chunks: the C decode rows equal gather + SDPA.
    Head sizes of 1 to 16 vectors (AVX2: 8 floats; AVX-512: 16), in groups of up to 8, and sizes that
    are no whole number of vectors (the plain loops); blocks shorter than the four keys scored at once."""
    from lifeofprompt.model.paged_attention import paged_attention

    rng = random.Random(seed)
    kv_heads, group, block_size = rng.choice([1, 3]), rng.choice([1, 3]), rng.choice([1, 3, 16, 16])
    head_dim = [16, 24, 40, 64, 128][seed % 5]
    num_blocks = 800
    k_pool, v_pool = torch.randn(2, num_blocks, block_size, kv_heads, head_dim).unbind(0)
    query_lens = [1] + [
        rng.choice([1, 1, 1, rng.randrange(2, 9)]) for _ in range(rng.randrange(0, 8))
    ]  # a decode row at least
    seq_lens = [q + rng.randrange(0, 60) if q > 1 else rng.randrange(0, 80) for q in query_lens]
    width = max(seq_lens) // block_size + 1
    blocks = rng.sample(range(num_blocks), width * len(seq_lens))
    block_tables = torch.tensor([blocks[i * width : (i + 1) * width] for i in range(len(seq_lens))], dtype=torch.int32)
    starts = torch.tensor([0] + list(itertools.accumulate(query_lens)), dtype=torch.int32)
    query = torch.randn(int(starts[-1]), kv_heads * group, head_dim)
    args = (
        query,
        k_pool,
        v_pool,
        block_tables,
        torch.tensor(seq_lens, dtype=torch.int32),
        starts,
        max(query_lens),
        max(seq_lens),
        head_dim**-0.5,
    )
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = paged_attention(*args, decode_kernel=c_step.decode_attention)
    finally:
        torch.set_num_threads(previous)
    torch.testing.assert_close(got, paged_attention(*args), rtol=1e-5, atol=1e-5)


def test_the_forecast_follows_the_measured_steps_not_the_row_count(monkeypatch):
    """On a slow CPU (an AVX2 EPYC: 1 row C 50 ms, row-major 56, torch 84; a few rows cost about one)
    a forecast proportional to the rows said a 2-row round would take 0.38 s and stopped the timing
    at 1 row. Through the measured points it reaches 8 rows within the same 3 s."""
    c = {1: 50, 2: 52, 4: 58, 8: 75, 16: 120}
    row_major = {1: 56, 2: 60, 4: 70, 8: 95, 16: 160}
    eager = {1: 84, 2: 88, 4: 95, 8: 120, 16: 150}
    clock = [0.0]

    def measure(rows, fused):
        seconds = {"packed": c, "row-major": row_major, "torch": eager}[fused][rows] / 1e3
        clock[0] += seconds  # a fake clock the budget reads
        return seconds

    monkeypatch.setattr(c_step.time, "perf_counter", lambda: clock[0])
    answer, why = c_step.measured_rows(measure, row_counts=(1, 2, 4, 8, 16), budget_s=3.0)
    assert answer["rows"] >= 8 and clock[0] <= 3.0, why


def test_the_default_budget_reaches_a_batched_step_on_a_slow_cpu(monkeypatch):
    """Whole steps measured at start-up on a 2-core AVX2 EPYC at 1 thread (ms): the C step stays ~1.5x
    faster than torch up to 32 rows, the rows of a 32-request batch's decode steps. A 3 s budget
    stopped before 16 rows there and sent those steps through torch; the default reaches 32."""
    c = {1: 48.4, 2: 64.6, 4: 80.3, 8: 105.6, 16: 146.8, 32: 209.8, 64: 400.0}
    row_major = {1: 50.0, 2: 71.1, 4: 81.2, 8: 113.8, 16: 218.7, 32: 312.9, 64: 600.0}
    eager = {1: 76.1, 2: 98.5, 4: 105.4, 8: 164.3, 16: 238.0, 32: 313.8, 64: 600.0}
    clock = [0.0]

    def measure(rows, fused):
        seconds = {"packed": c, "row-major": row_major, "torch": eager}[fused][rows] / 1e3
        clock[0] += seconds
        return seconds

    monkeypatch.setattr(c_step.time, "perf_counter", lambda: clock[0])
    answer, why = c_step.measured_rows(measure)
    assert answer["rows"] >= 32, why
    assert clock[0] <= c_step.STEP_BUDGET_S
    assert answer["layouts"][32] == "packed"
    clock[0] = 0.0
    assert c_step.measured_rows(measure, budget_s=3.0)[0]["rows"] == 8  # what the old budget reached
    # the same VM an hour later, a third slower: still 32 rows
    slower = {
        way: {n: t * 1.35 for n, t in times.items()} for way, times in (("packed", c), ("rm", row_major), ("t", eager))
    }
    c, row_major, eager = slower["packed"], slower["rm"], slower["t"]
    clock[0] = 0.0
    assert c_step.measured_rows(measure)[0]["rows"] >= 32


def test_a_measurement_stopped_past_8_rows_is_kept_and_measured_once_more(tmp_path, monkeypatch):
    """A moment's load stopped the timing before 32 rows (after 16): that start keeps 16 and caches it
    provisionally; the next start measures once more and keeps what it finds, and later starts read it."""
    monkeypatch.setenv("LIFEOFPROMPT_CACHE", str(tmp_path))
    monkeypatch.delenv("LIFEOFPROMPT_CPU_TUNING", raising=False)
    model = random_model(random.Random(3))
    asked = []
    monkeypatch.setattr("lifeofprompt.cpu.c_step.measured_rows", stopped_the_first_time(asked, 32, 16, 32))
    first = ModelRunner.for_model(model, num_kv_blocks=4096, block_size=4, attention_backend="torch")
    assert first.speedups.c_step_rows == 16 and "measured once more" in first.resolved.cpu.notes["c_step"]
    assert (
        ModelRunner.for_model(model, num_kv_blocks=4096, block_size=4, attention_backend="torch").speedups.c_step_rows
        == 32
        and len(asked) == 2
    )
    assert (
        ModelRunner.for_model(model, num_kv_blocks=4096, block_size=4, attention_backend="torch").speedups.c_step_rows
        == 32
        and len(asked) == 2
    )
    # a machine that is simply slow stops early twice: the second answer stays, a third start reads it
    asked.clear()

    def always_stopped(measure, **_):
        asked.append(True)
        answer = {"rows": 16, "layouts": {1: "packed"}, "seconds": {1: 1e-3}, "stopped_before": 32}
        return answer, "stopped before 32 rows"

    monkeypatch.setattr("lifeofprompt.cpu.c_step.measured_rows", always_stopped)
    other = random_model(random.Random(4))
    for _ in range(3):
        assert (
            ModelRunner.for_model(
                other, num_kv_blocks=4096, block_size=4, attention_backend="torch"
            ).speedups.c_step_rows
            == 16
        )
    assert len(asked) == 2


@torch.no_grad()
def test_a_model_with_a_c_step_still_decodes_with_chapter_04s_contiguous_cache():
    """The C step reads the engine's paged pool only: a model the engine gave one (``model.cpu_step``) still
    runs chapter 04's contiguous cache through its torch layers, to the same greedy tokens."""
    from lifeofprompt.lessons.generate import generate_cached

    model = random_model(random.Random(5))
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    want = generate_cached(model, prompt, 6)
    with c_step.running(model, c_step.CStep.only(c_step.PACKED)):
        assert generate_cached(model, prompt, 6) == want

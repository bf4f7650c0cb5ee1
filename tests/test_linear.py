"""The CPU matrix-product paths and the chooser that times them on the machine that runs."""

import json

import pytest
import torch
from torch import nn

from lifeofprompt.cpu import linear_calibration
from lifeofprompt.cpu.linear_calibration import calibrate, choose_cpu_linear
from lifeofprompt.engine.config import EngineConfig
from lifeofprompt.errors import ConfigError
from lifeofprompt.model import linear
from lifeofprompt.model.config import ModelConfig
from lifeofprompt.model.linear import (
    MAX_PLANNED_ROWS,
    Linear,
    RowPlan,
    apply_plans,
    available_paths,
    onednn_available,
    run_path,
    transposed_linear,
)
from lifeofprompt.model.llama import LlamaForCausalLM

HERE = available_paths()
pytestmark = pytest.mark.numerics  # floating-point kernels: scripts/portability.sh runs these per setting


def pair(in_features=96, out_features=160, seed=0):
    torch.manual_seed(seed)
    ours = Linear(in_features, out_features, bias=False)
    plain = nn.Linear(in_features, out_features, bias=False)
    plain.weight.data.copy_(ours.weight.data)
    return ours, plain


def tiny_model(seed=0):
    """A 2-layer Llama with GQA, small enough to calibrate in milliseconds."""
    config = ModelConfig(
        name="tiny",
        vocab_size=301,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    for param in model.parameters():
        nn.init.normal_(param, std=0.2)
    return model


def fake_measure(winner_for_rows, calls=None):
    """A stand-in timer: the path ``winner_for_rows(rows)`` takes 1 s, every other path 2-3 s."""

    def measure(path, modules, rows):
        if calls is not None:
            calls.append((path, tuple(modules[0].weight.shape), rows))
        return 1.0 if path == winner_for_rows(rows) else 2.0 + len(path) / 100

    return measure


# ----------------------------------------------------------------------------- the paths


@pytest.mark.parametrize("rows", [1, 2, 3, 16, 17, 300])
@pytest.mark.parametrize("path", HERE)
@torch.no_grad()
def test_every_path_matches_nn_linear(rows, path):
    ours, plain = pair()
    apply_plans(nn.Sequential(ours), {(160, 96): RowPlan.single(path)})
    assert (ours.packed is not None) == (path == "onednn")
    x = torch.randn(rows, 96)
    out = ours(x)
    assert out.shape == (rows, 160) and out.is_contiguous()
    torch.testing.assert_close(out, plain(x), rtol=1e-5, atol=1e-5)  # fp32, up to summation order


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("path", HERE)
@torch.no_grad()
def test_every_path_on_random_shapes_and_threads(seed, path):
    """Widths that leave a tail past the kernels' vector lanes, odd output counts, 1 or 2 threads."""
    gen = torch.Generator().manual_seed(seed)
    in_features, out_features, rows = (
        int(torch.randint(lo, hi, (1,), generator=gen)) for lo, hi in ((1, 200), (1, 300), (1, 20))
    )
    ours, plain = pair(in_features, out_features, seed)
    apply_plans(nn.Sequential(ours), {(out_features, in_features): RowPlan.single(path)})
    x = torch.randn(rows, in_features, generator=gen)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1 + seed % 2)
        out = ours(x)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(out, plain(x), rtol=1e-5, atol=1e-5)


def test_transposed_path_is_the_transposed_product():
    w, x = torch.randn(7, 5), torch.randn(1, 5)
    torch.testing.assert_close(transposed_linear(x, w), x @ w.t())
    torch.testing.assert_close(transposed_linear(x, w, double_single_row=True), x @ w.t())


def test_unknown_path_and_missing_pack_are_named():
    ours, _ = pair()
    with pytest.raises(ValueError, match="unknown matrix-product path 'blas9'"):
        run_path("blas9", torch.randn(2, 96), ours)
    with pytest.raises(RuntimeError, match="prepacked"):
        run_path("onednn", torch.randn(2, 96), ours)


def test_row_plan_picks_by_row_count_and_describes_itself():
    plan = RowPlan(("rowwise",) * 2 + ("onednn",) * (MAX_PLANNED_ROWS - 2), "linear")
    assert [plan.path_for(m) for m in (1, 2, 3, MAX_PLANNED_ROWS, MAX_PLANNED_ROWS + 1, 500)] == [
        "rowwise",
        "rowwise",
        "onednn",
        "onednn",
        "linear",
        "linear",
    ]
    assert plan.describe() == f"M=1-2 rowwise, M=3-{MAX_PLANNED_ROWS} onednn, M>{MAX_PLANNED_ROWS} linear"
    assert plan.uses_onednn and not RowPlan.single("linear").uses_onednn


@pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN")
def test_training_uses_the_weights_and_a_stale_pack_shows():
    ours, plain = pair()
    assert apply_plans(nn.Sequential(ours, nn.ReLU()), {(160, 96): RowPlan.single("onednn")}) == 96 * 160 * 4
    x = torch.randn(8, 96, requires_grad=True)
    ours(x).sum().backward()  # with grad enabled the plan is not used: autograd works
    assert ours.weight.grad is not None and x.grad is not None
    with torch.no_grad():  # a stale packed copy is what the docs warn about: show it
        ours.weight.mul_(2)
        torch.testing.assert_close(ours(torch.ones(8, 96)), plain(torch.ones(8, 96)), rtol=1e-5, atol=1e-5)
        ours.prepack()
        torch.testing.assert_close(ours(torch.ones(8, 96)), 2 * plain(torch.ones(8, 96)), rtol=1e-5, atol=1e-4)


def test_apply_plans_packs_exactly_the_onednn_shapes_and_none_undoes_everything():
    model = tiny_model()
    shapes = list(linear_calibration.weights_by_shape(model))
    assert sorted(shapes) == [(64, 64), (64, 96), (128, 64), (192, 64), (301, 64)]  # o, down, qkv, gate_up, lm_head
    if not onednn_available():
        pytest.skip("this torch build has no oneDNN")
    plans = {shape: RowPlan.single("onednn" if shape == (192, 64) else "linear") for shape in shapes}
    packed = apply_plans(model, plans)
    assert packed == 2 * 192 * 64 * 4
    assert [m.packed is not None for m in model.modules() if isinstance(m, Linear)].count(True) == 2
    assert apply_plans(model, None) == 0
    assert all(m.packed is None and m.plan is None for m in model.modules() if isinstance(m, Linear))


# ----------------------------------------------------------------------------- the chooser


@pytest.mark.parametrize("winner", ["linear", "transposed", "transposed_doubled", "onednn", "rowwise"])
def test_each_path_wins_in_turn_and_the_forward_then_uses_it(winner, monkeypatch):
    """A fake timer makes one path fastest; the plan picks it and the model's forward runs it,
    giving nn.Linear's logits up to fp32 summation order."""
    if winner not in HERE:
        pytest.skip(f"{winner} is not available on this machine")
    model = tiny_model()
    ids = torch.tensor([5, 17, 42])
    with torch.no_grad():
        reference = model(ids[None])[0]  # no plans: plain nn.Linear
    # doubling only exists for one row: from two rows on, the plain transposed product stands for it
    expected = {1: winner, 2: "transposed" if winner == "transposed_doubled" else winner}
    plans, _ = calibrate(model, HERE, measure=fake_measure(lambda rows: expected[min(rows, 2)]))
    assert all(plan.path_for(1) == expected[1] and plan.path_for(3) == expected[2] for plan in plans.values())
    apply_plans(model, plans)
    used = []
    real_run_path = linear.run_path
    monkeypatch.setattr(linear, "run_path", lambda path, x, module: used.append(path) or real_run_path(path, x, module))
    with torch.no_grad():
        decode_row = model(ids[None, :1])[0]  # one row: the M = 1 choice
        prompt = model(ids[None])[0]  # three rows: the M = 3 choice
    assert set(used) == {expected[1], expected[2]}
    torch.testing.assert_close(prompt, reference, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(decode_row, reference[:1], rtol=1e-4, atol=1e-4)


def test_choice_follows_the_row_count_and_large_products_go_to_onednn_when_no_slower():
    model = tiny_model()
    paths = ("linear", "transposed", "onednn", "rowwise")
    winner = lambda rows: "rowwise" if rows <= 2 else "onednn" if rows <= MAX_PLANNED_ROWS else "onednn"  # noqa: E731
    plans, timings = calibrate(model, paths, measure=fake_measure(winner))
    for plan in plans.values():
        assert plan.by_rows == ("rowwise",) * 2 + ("onednn",) * (MAX_PLANNED_ROWS - 2)
        assert plan.large == "onednn"
    assert set(timings["128x64"]) == set(range(1, MAX_PLANNED_ROWS + 1)) | {linear_calibration.LARGE_ROWS}
    slower = lambda rows: "rowwise" if rows <= MAX_PLANNED_ROWS else "linear"  # noqa: E731
    plans, _ = calibrate(model, paths, measure=fake_measure(slower))
    assert {plan.large for plan in plans.values()} == {"linear"}


def test_paths_far_behind_are_dropped_and_the_budget_is_kept():
    model = tiny_model()
    calls = []
    paths = ("linear", "transposed", "onednn", "rowwise")
    calibrate(model, paths, measure=fake_measure(lambda rows: "rowwise", calls))
    # every path is timed for one and two rows; then the row-by-row path far behind is dropped, the blocked ones kept
    assert {p for p, _, rows in calls if rows == 1} == {p for p, _, rows in calls if rows == 2} == set(paths)
    assert {p for p, _, rows in calls if rows == 4} == {"linear", "onednn", "rowwise"}
    calls.clear()
    plans, _ = calibrate(model, ("linear", "rowwise"), measure=fake_measure(lambda rows: "rowwise", calls), budget_s=0)
    assert {rows for _, _, rows in calls} == {1}  # out of budget after one row
    assert all(plan.by_rows == ("rowwise",) * MAX_PLANNED_ROWS for plan in plans.values())


def test_out_of_budget_the_plan_still_spans_the_row_counts(monkeypatch):
    """Powers of two are timed first; rows not reached take the choice measured just below them."""
    model = tiny_model()
    clock = iter(range(10_000))
    monkeypatch.setattr(linear_calibration.time, "perf_counter", lambda: next(clock))
    winner = lambda rows: "rowwise" if rows < 4 else "onednn"  # noqa: E731
    # each perf_counter call is one "second"; a budget of 3 lets the first rounds of rows through
    plans, timings = calibrate(model, ("linear", "onednn", "rowwise"), measure=fake_measure(winner), budget_s=3)
    measured = set(timings["128x64"]) - {linear_calibration.LARGE_ROWS}
    assert measured and measured < set(range(1, MAX_PLANNED_ROWS + 1)) and measured <= {1, 2, 4, 8, 16}
    assert 4 in measured  # enough budget to see the winner change
    for plan in plans.values():
        assert all(
            plan.path_for(m) == winner(max(r for r in measured if r <= m)) for m in range(1, MAX_PLANNED_ROWS + 1)
        )
        assert plan.path_for(3) == "rowwise" and plan.path_for(MAX_PLANNED_ROWS) == "onednn"


def test_calibration_times_over_more_bytes_than_the_cache(monkeypatch):
    """Each measurement streams matrices from memory, as a real step does: > 2x the last-level cache."""
    model = tiny_model()
    monkeypatch.setattr(linear_calibration, "last_level_cache_bytes", lambda: 128 * 64 * 4)  # one qkv matrix
    seen = {}
    calibrate(
        model,
        ("linear",),
        measure=lambda p, modules, rows: seen.setdefault(modules[0].weight.shape, len(modules)) or 1.0,
    )
    assert seen[(128, 64)] == 2 and seen[(301, 64)] == 1  # both layers' qkv; the one lm_head


def test_the_choice_is_cached_per_machine_and_threads(tmp_path, monkeypatch):
    monkeypatch.setenv("LIFEOFPROMPT_CACHE", str(tmp_path))
    monkeypatch.delenv("LIFEOFPROMPT_CPU_TUNING", raising=False)
    model = tiny_model()
    runs = []

    def counted(model, paths, **_):
        runs.append(paths)
        return calibrate(model, paths, measure=fake_measure(lambda rows: "linear"))

    monkeypatch.setattr(linear_calibration, "calibrate", counted)
    first = choose_cpu_linear(model)
    assert first.source.startswith("calibrated in") and len(runs) == 1
    second = choose_cpu_linear(model)
    assert second.source.startswith("cached in") and second.plans == first.plans and len(runs) == 1
    stored = json.loads(next((tmp_path / "cpu_tuning").glob("*.json")).read_text())
    assert stored["key"]["threads"] == torch.get_num_threads() and stored["key"]["cpu"]
    assert "128x64" in stored["plans"] and "CPU matrix products" in first.describe()[0]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)  # another thread count: timed again
        choose_cpu_linear(model)
    finally:
        torch.set_num_threads(threads)
    assert len(runs) == 2


def test_a_pinned_path_is_not_timed_and_bad_names_are_named(monkeypatch):
    model = tiny_model()
    monkeypatch.setattr(linear_calibration, "calibrate", lambda *a, **k: pytest.fail("a pinned path was timed"))
    choice = choose_cpu_linear(model, "transposed")
    assert choice.source == "pinned: transposed"
    assert all(plan == RowPlan.single("transposed") for plan in choice.plans.values())
    monkeypatch.setenv("LIFEOFPROMPT_CPU_TUNING", "linear")  # the engine's default when set, as tests do
    assert EngineConfig.from_settings().cpu_tuning == "linear"
    assert EngineConfig.from_settings(cpu_tuning="auto").cpu_tuning == "auto"  # a setting given wins
    monkeypatch.delenv("LIFEOFPROMPT_CPU_TUNING")
    monkeypatch.setenv("LIFEOFPROMPT_CPU_LINEAR", "transposed")  # its old name is refused, naming the new one
    with pytest.raises(ConfigError, match="LIFEOFPROMPT_CPU_TUNING"):
        EngineConfig.from_settings()
    monkeypatch.delenv("LIFEOFPROMPT_CPU_LINEAR")
    with pytest.raises(ConfigError, match="cpu_tuning="):
        EngineConfig.from_settings(cpu_linear="rowwise")
    with pytest.raises(ConfigError, match="cpu_tuning='fastest'.*auto"):
        EngineConfig(cpu_tuning="fastest")
    with pytest.raises(ConfigError, match="cpu_tuning='fastest'.*auto"):
        choose_cpu_linear(model, "fastest")
    with pytest.raises(ConfigError, match="not available"):
        choose_cpu_linear(model, "onednn", prepack=False)

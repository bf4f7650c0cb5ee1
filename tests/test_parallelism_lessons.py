"""Chapter 15's arithmetic: device counts by hand, the L + n/β fit (it recovers known values and a broken
fit is caught), ring all-reduce and pipeline-bubble formulas, the figures, and the two measuring helpers."""

from __future__ import annotations

import math
import random

import pytest

from lifeofprompt.engine.memory import estimate_activation_bytes
from lifeofprompt.errors import ConfigError
from lifeofprompt.lessons import parallelism as par
from lifeofprompt.lessons.memory_arithmetic import LLAMA_3_1_8B
from lifeofprompt.lessons.story_model import SMOLLM2_135M

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.ranks]


# ----------------------------------------------------------------------------- devices, by hand


def test_llama70b_per_rank_bytes_by_hand():
    c = par.LLAMA_3_1_70B
    h, layers = 8192, 80
    per_layer = h * 64 * 128 * 2 + h * 8 * 128 * 2 + 3 * h * 28672 + 2 * h
    full = layers * per_layer + 2 * 128256 * h + h
    assert par.weight_bytes_per_rank(c, "bf16", 1) == 2 * full  # 141.1 GB in bf16
    per_layer_2 = h * 32 * 128 * 2 + h * 4 * 128 * 2 + 3 * h * 14336 + 2 * h  # half of every split matrix
    assert par.weight_bytes_per_rank(c, "bf16", 2) == 2 * (layers * per_layer_2 + 2 * 64128 * h + h)
    # the KV heads split to one per rank at T = 8, and stay one (replicated) at T = 16
    assert par.kv_bytes_per_token_per_rank(c, "bf16", 1) == 2 * 80 * 8 * 128 * 2 == 327680
    assert par.kv_bytes_per_token_per_rank(c, "bf16", 8) == 2 * 80 * 1 * 128 * 2
    assert par.kv_bytes_per_token_per_rank(c, "bf16", 16) == par.kv_bytes_per_token_per_rank(c, "bf16", 8)
    assert par.kv_bytes_per_token_per_rank(SMOLLM2_135M, "bf16", 3) == 2 * 30 * 1 * 64 * 2


def test_llama70b_needs_two_h100s_for_its_weights_and_four_for_a_long_context():
    c, card = par.LLAMA_3_1_70B, par.H100_SXM
    usable = int(85.5e9 * 0.92)  # what an "80 GB" H100 reports, at current vLLM's share (notebook 05)
    assert card.memory == 85.5e9 and 2 * c.num_parameters() > usable  # 141 GB of weights, 78.7 GB usable
    # on an H200 they fit the whole card (150.1 GB reported) but not the 92% an engine may claim
    assert int(par.H200.memory * 0.92) < 2 * c.num_parameters() < par.H200.memory
    counted = par.devices_needed(c, "bf16", card, tokens=0)
    assert counted.tensor_parallel_size == 2 and counted.tried[0][0] == 1
    weights = par.weight_bytes_per_rank(c, "bf16", 2)
    activations = estimate_activation_bytes(par.shard_config(c, 2), "bf16")
    block = 16 * 2 * 80 * 4 * 128 * 2  # 16 tokens of 4 KV heads per rank
    assert counted.kv_tokens == (usable - weights - activations) // block * 16
    assert counted.kv_tokens < 131072  # one 128K-token request does not fit on 2
    long = par.devices_needed(c, "bf16", card, tokens=131072)
    assert long.tensor_parallel_size == 4 and [t for t, _ in long.tried] == [1, 2]
    assert par.devices_needed(c, "bf16", par.H200, tokens=131072).tensor_parallel_size == 2
    assert par.devices_needed(LLAMA_3_1_8B, "bf16", card, tokens=131072).tensor_parallel_size == 1


def test_a_model_no_split_can_hold_is_reported_not_guessed():
    tiny_card = par.Card("8 GB", 8e9, 1e12)
    counted = par.devices_needed(par.LLAMA_3_1_70B, "bf16", tiny_card, tokens=10**9)
    assert counted.tensor_parallel_size == 0 and len(counted.tried) == 7  # 1, 2, 4, 8, 16, 32, 64 all tried
    with pytest.raises(ConfigError):
        par.devices_needed(par.LLAMA_3_1_70B, "bf16", tiny_card, tokens=-1)


def test_bytes_on_the_wire():
    c = par.LLAMA_3_1_70B
    assert par.all_reduces_per_step(c) == 161 and par.all_reduces_per_step(c, vocab_parallel_embedding=False) == 160
    assert par.all_reduce_bytes_per_token(c, "bf16") == 16384
    assert par.ring_traffic_per_rank(800, 8) == 1400
    link = par.Link("test", 1e-6, 1e9)
    assert par.ring_all_reduce_s(link, 8000, 8) == pytest.approx(14 * (1e-6 + 1000 / 1e9))
    assert par.ring_all_reduce_s(link, 8000, 1) == 0.0
    assert par.tensor_parallel_step_s(c, "bf16", 4, 8, link) == pytest.approx(
        161 * par.ring_all_reduce_s(link, 4 * 16384, 8)
    )


def test_gpu_layouts_by_hand():
    c, card = par.LLAMA_3_1_70B, par.H100_SXM
    one_node = par.layout_step_s(c, "bf16", card, 64, tp=8)
    hop = par.NVLINK4.latency + 64 * 16384 / 8 / par.NVLINK4.bandwidth
    assert one_node.comm_s == pytest.approx(161 * 14 * hop)
    assert one_node.read_s == pytest.approx(par.weight_bytes_per_rank(c, "bf16", 8) / 3.35e12)
    across = par.layout_step_s(c, "bf16", card, 64, tp=16)  # the ring's slowest hop is the NIC
    assert across.comm_s == pytest.approx(161 * 30 * (par.INFINIBAND_NDR.latency + 64 * 16384 / 16 / 50e9))
    staged = par.layout_step_s(c, "bf16", card, 64, tp=8, pp=2)  # TP in each node, one send between
    send = par.INFINIBAND_NDR.latency + 64 * 16384 / 50e9
    assert staged.comm_s == pytest.approx((2 * 80 + 1) * 14 * hop + send)
    assert staged.read_s == one_node.read_s  # two stages of half the layers, in turn
    assert across.comm_s > 5 * staged.comm_s and staged.total_s == pytest.approx(staged.read_s + staged.comm_s)


# ----------------------------------------------------------------------------- the fit


def synthetic(latency, beta, sizes, noise=0.02, seed=0):
    rng = random.Random(seed)
    return [(latency + n / beta) * (1 + rng.uniform(-noise, noise)) for n in sizes]


def test_the_fit_recovers_known_latency_and_bandwidth():
    sizes = [64, 128, 256, 65536, 262144, 2**20, 2**22]
    for latency, beta in ((50e-6, 2e9), (4e-3, 0.5e9), (3e-6, 450e9)):
        model = par.fit_cost_model(sizes, synthetic(latency, beta, sizes))
        assert model.latency == pytest.approx(latency, rel=0.05)
        assert model.beta == pytest.approx(beta, rel=0.05)
        held_out = [1024, 4096, 16384]
        assert (
            max(abs(e) for e in par.relative_errors(model, held_out, synthetic(latency, beta, held_out, seed=1))) < 0.06
        )
    assert par.CostModel(1e-3, 1e9).total(10, 5e6) == pytest.approx(10e-3 + 5e-3)


def test_a_broken_fit_is_caught():
    sizes = [64, 128, 256, 65536, 262144, 2**20]
    measured = synthetic(50e-6, 2e9, sizes, noise=0.0)
    # a fit that forgot the latency (a line through the origin): the held-out small sizes give it away
    slope = sum(n * s for n, s in zip(sizes, measured)) / sum(n * n for n in sizes)
    broken = par.CostModel(latency=1e-12, beta=1 / slope)
    held_out = [1024, 4096]
    assert min(abs(e) for e in par.relative_errors(broken, held_out, synthetic(50e-6, 2e9, held_out, noise=0.0))) > 0.3
    # times that do not grow with the size, or a single size, give no L and β at all
    with pytest.raises(ConfigError, match="positive"):
        par.fit_cost_model(sizes, [1e-3] * len(sizes))
    with pytest.raises(ConfigError, match="positive"):
        par.fit_cost_model(sizes, list(reversed(measured)))
    with pytest.raises(ConfigError, match="two or more"):
        par.fit_cost_model([4096, 4096], [1e-3, 2e-3])


# ----------------------------------------------------------------------------- bubbles


@pytest.mark.parametrize("stages", [2, 3, 4, 8])
def test_microbatch_bubble_is_the_formula(stages):
    for m in (1, 2, 3, 5, 8, 16):
        slots = par.pipeline_schedule(stages, m)
        assert len(slots) == stages * m
        assert 1 - par.utilisation(slots, stages) == pytest.approx(par.bubble_fraction(stages, m))
        assert par.bubble_fraction(stages, m) == pytest.approx((stages - 1) / (m + stages - 1))
        assert max(s.end for s in slots) == m + stages - 1


def test_decode_keeps_one_stage_busy_unless_p_requests_are_in_flight():
    P, steps = 4, 6
    alone = par.pipeline_schedule(P, 1, steps)
    assert par.utilisation(alone, P) == pytest.approx(1 / P)
    full = par.pipeline_schedule(P, P, steps)
    assert max(s.end for s in full) == P * steps + P - 1  # packed: only the fill and drain idle
    assert par.utilisation(full, P) == pytest.approx(P * steps / (P * steps + P - 1))
    # a group's next step never enters stage 0 before its last step left the last stage
    for g in range(P):
        mine = sorted((s for s in full if s.group == g), key=lambda s: (s.step, s.stage))
        for a, b in zip(mine, mine[1:]):
            assert b.start >= a.end
    with pytest.raises(ConfigError):
        par.pipeline_schedule(0, 1)


# ----------------------------------------------------------------------------- figures and helpers


def test_figures_draw_what_they_say():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from lifeofprompt.figures import parallelism as figs
    from lifeofprompt.lessons.collective_bench import EngineRun

    fig = figs.split_figure(3)
    left, right = fig.axes
    assert len(left.patches) == 1 + 3 + 3 and len(right.patches) == 3 + 3 + 3 + 1
    plt.close(fig)
    fig = figs.bubble_figure([("alone", par.pipeline_schedule(2, 1, 3)), ("two", par.pipeline_schedule(2, 2, 3))], 2)
    assert [ax.get_title() for ax in fig.axes] == [
        "alone: stages busy 50% of the time",
        "two: stages busy 86% of the time",
    ]
    plt.close(fig)
    runs = [
        EngineRun(1, 1, 10, 2e-3, 2e-3),
        EngineRun(3, 1, 10, 30e-3, 31e-3, collectives={"all_reduce": dict(calls=50, bytes=1e5, seconds=0.2)}),
    ]
    fig = figs.measured_figure(runs, {"T=3, P=1": 18e-3})
    assert [t.get_text() for t in fig.axes[1].get_xticklabels()] == ["T=3, P=1"]
    plt.close(fig)


def test_time_collectives_spawns_and_times_every_op():
    from lifeofprompt.lessons.collective_bench import time_collectives

    both = time_collectives(
        2, [64, 4096], ops=("all_reduce", "broadcast", "gather", "send"), repeats=3, statistic="both"
    )
    assert set(both) == {"mean", "median"}
    for times in both.values():
        assert set(times) == {(op, n) for op in ("all_reduce", "broadcast", "gather", "send") for n in (64, 4096)}
        assert all(0 < t < 5 for t in times.values())


def test_measure_engine_single_process():
    from lifeofprompt.lessons.collective_bench import measure_engine
    from lifeofprompt.lessons.tiny_models import tiny_model

    run = measure_engine(
        tiny_model, [[11, 12, 13], [20, 21]], 4, dtype="float32", block_size=4, num_kv_blocks=16, log_stats=False
    )
    assert run.label == "T=1, P=1" and run.steps == 4 and [len(t) for t in run.tokens] == [4, 4]
    assert run.collectives == {} and run.reports == [] and math.isfinite(run.decode_step_s)


# ----------------------------------------------------------------------------- the cost model against the engine


def test_the_fit_leaves_out_the_engines_own_sizes():
    fit, held_out = par.split_sizes([64, 256, 1024, 4096, 16384, 65536], [1728, 5184, 6912])
    assert held_out == [1024, 4096] and fit == [64, 256, 16384, 65536]


def test_a_typical_call_is_its_sizes_median_so_a_stall_moves_only_the_sum():
    calls = [(100, 1e-3), (100, 1e-3), (100, 50e-3), (200, 2e-3), (200, 4e-3)]  # one 50 ms stall
    assert par.typical_seconds(calls) == pytest.approx(3 * 1e-3 + 2 * 3e-3)
    model = par.CostModel(1e-3, 1e9)
    p = par.predict_calls("all_reduce", calls, model, par.CostModel(0.5e-3, 1e9))
    assert (p.calls, p.nbytes) == (5, 700)
    assert p.measured == pytest.approx(58e-3) and p.predicted == pytest.approx(5e-3 + 700e-9)
    assert p.typical_predicted == pytest.approx(2.5e-3 + 700e-9)
    assert p.error == pytest.approx(p.predicted / 58e-3 - 1) and p.typical_error == pytest.approx(
        p.typical_predicted / 9e-3 - 1
    )
    other = par.predict_calls("gather", [(100, 2e-3)], model, model)
    assert par.total_error([p, other]) == pytest.approx((p.predicted + other.predicted) / (58e-3 + 2e-3) - 1)


def test_check_cost_model_fits_on_timings_before_and_after_the_engine():
    """The engine runs between two timings, the fit is their average, each kind on sizes it never sent."""
    from types import SimpleNamespace

    from lifeofprompt.lessons.collective_bench import check_cost_model

    events, grid = [], (64, 256, 1024, 4096, 65536, 2**20)

    def timer(world, sizes, ops, repeats, statistic):
        events.append(("timer", world))
        scale = 1.0 if len(events) == 1 else 3.0  # the load doubled the times while the engine ran
        return {
            stat: {(op, n): scale * factor * (1e-3 + n / 1e9) for op in ops for n in sizes}
            for stat, factor in (("mean", 1.2), ("median", 1.0))
        }

    def engine(factory, prompts, max_tokens, t, p, **kwargs):
        events.append(("engine", t, p))
        calls = {
            "all_reduce": [(1024, 2e-3 + 1024 / 1e9 * 2)] * 10,
            "broadcast": [(64, 2e-3 + 128e-9)] * 4,
            "gather": [],
        }
        worker = [(4096, 1.0)] + [(1024, 2e-3 + 1024 / 1e9 * 2 - 1e-3)] * 10  # one more call, earlier
        return SimpleNamespace(call_samples=calls, reports=[{}, {"collective_calls": {"all_reduce": worker}}])

    check = check_cost_model(None, [], 4, 3, grid=grid, timer=timer, engine=engine)
    assert events == [("timer", 3), ("engine", 3, 1), ("timer", 3)]
    assert check.fit_sizes == {
        "all_reduce": [64, 256, 4096, 65536, 2**20],
        "broadcast": [256, 1024, 4096, 65536, 2**20],
    }
    assert check.held_out == {"all_reduce": [1024], "broadcast": [64]}
    assert [p.op for p in check.predictions] == ["all_reduce", "broadcast"]  # nothing gathered: no line
    assert check.typical_models["all_reduce"].latency == pytest.approx(2e-3)  # (1 + 3) / 2 x 1 ms
    assert check.models["all_reduce"].latency == pytest.approx(2.4e-3)
    assert check.typical_error == pytest.approx(0, abs=1e-9)
    assert check.held_out_errors("all_reduce", typical=True) == pytest.approx([0], abs=1e-9)
    assert len(check.loads) == 3
    assert check.last_arrival.measured == pytest.approx(10 * (1e-3 + 2048e-9))  # the worker waited less


def test_the_last_rank_to_arrive_gives_the_links_own_time():
    rank0 = [(100, 5e-3), (100, 1e-3), (200, 2e-3)]
    rank1 = [(64, 9.0), (100, 1e-3), (100, 4e-3), (200, 2.5e-3)]  # it ran one call before rank 0 counted
    assert par.last_arrival_calls([rank0, rank1]) == [(100, 1e-3), (100, 1e-3), (200, 2e-3)]
    with pytest.raises(ConfigError, match="differ"):
        par.last_arrival_calls([rank0, [(100, 1e-3), (200, 1e-3), (100, 1e-3)]])

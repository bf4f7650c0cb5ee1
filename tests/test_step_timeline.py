"""Chapter 10's timeline: every part of a step recorded, on the thread it ran on, and drawn as recorded."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
from tiny_models import build_tiny_model  # noqa: E402

from lifeofprompt import LLM, SamplingParams  # noqa: E402
from lifeofprompt.figures.engine import plot_step_timeline  # noqa: E402
from lifeofprompt.lessons.step_timeline import (  # noqa: E402
    STEP_PARTS,
    Span,
    forward_gaps,
    forwards,
    recorded_timeline,
    time_per_token,
)  # noqa: E402


def timeline(on: bool, tokens: int = 12):
    model, tokenizer = build_tiny_model()
    llm = LLM(model, tokenizer=tokenizer, num_kv_blocks=32, log_stats=False, async_scheduling=on)
    with recorded_timeline(llm.engine) as spans:
        out = llm.generate(
            [[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True), use_tqdm=False
        )
    return llm, spans, out[0].outputs[0].token_ids


@pytest.mark.parametrize("on", [False, True], ids=["synchronous", "async scheduling"])
def test_every_part_of_every_step_is_recorded_on_its_thread(on):
    llm, spans, tokens = timeline(on)
    ran = forwards(spans)
    assert len(tokens) == 12 and len(ran) == 12  # one forward a token, the prompt's included
    assert {s.what for s in spans} == set(STEP_PARTS)
    assert {s.thread for s in ran} == {"forward" if on else "engine"}
    assert all(s.thread == "engine" for s in spans if s.what != "forward")
    # What comes after a step's inputs on the engine's thread: synchronous, always its forward; with async
    # scheduling, in every step after the first, the sampling of the step still in flight (the order of the code,
    # whatever the threads' timing: a forward on the tiny model can end before the next step is planned)
    engine_order = [s.what for s in sorted(spans, key=lambda s: s.start) if s.thread == "engine"]
    after_inputs = [b for a, b in zip(engine_order, engine_order[1:]) if a == "inputs"]
    if on:
        assert after_inputs.count("sample") >= len(after_inputs) - 2 and "forward" not in after_inputs
    else:
        assert after_inputs == ["forward"] * len(after_inputs) and len(after_inputs) == 12
    assert len(forward_gaps(spans)) == 11 and all(g >= 0 for g in forward_gaps(spans))
    assert time_per_token(spans) > 0
    for owner, method in STEP_PARTS.values():  # the wrappers are gone: the engine runs its own methods again
        assert method not in vars(getattr(llm.engine, owner))


def made_up_run(overlapped: bool, steps: int = 8, forward_ms: float = 10.0) -> list[Span]:
    """A decode of ``steps`` steps with 1 ms of host work per step: before each forward, or, overlapped,
    during the forward before (sample before it, then outputs, schedule and inputs under it)."""
    spans, t = [], 0.0
    for _ in range(steps):
        parts = ["sample", "outputs", "schedule", "inputs"]
        if overlapped:
            spans.append(Span("sample", "engine", t, t + 0.25e-3))
            t += 0.3e-3  # the sample, then the hand-off
            start = t
            for k, what in enumerate(parts[1:]):
                spans.append(Span(what, "engine", start + k * 0.25e-3, start + (k + 1) * 0.25e-3))
        else:
            for what in parts:
                spans.append(Span(what, "engine", t, t + 0.25e-3))
                t += 0.25e-3
        spans.append(Span("forward", "forward" if overlapped else "engine", t, t + forward_ms * 1e-3))
        t += forward_ms * 1e-3
    return spans


def test_the_figure_draws_the_spans_it_was_given():
    runs = {"synchronous": made_up_run(False), "overlapped": made_up_run(True)}
    fig = plot_step_timeline(runs, num_forwards=4)

    def bars(ax, what):
        (collection,) = [c for c in ax.collections if c.get_label() == what]
        return sorted((round(e.x0, 6), round(e.width, 6)) for e in (p.get_extents() for p in collection.get_paths()))

    left, right = fig.axes[0::2], fig.axes[1::2]
    for ax, spans in zip(left, runs.values()):  # four whole forwards from the middle of the run, from x = 0
        steady = forwards(spans)[2:6]
        t0 = steady[0].start
        assert bars(ax, "forward") == [(round((f.start - t0) * 1e3, 6), 10.0) for f in steady]
        assert {c.get_label() for c in ax.collections} == set(STEP_PARTS)
    sync_inputs, overlapped_schedule = bars(right[0], "inputs"), bars(right[1], "schedule")
    assert (-0.25, 0.25) in sync_inputs  # just before the forward that starts at 0
    assert (0.25, 0.25) in overlapped_schedule  # while it runs
    assert right[0].get_xlim() == pytest.approx((-1.5, 1.5)) == right[1].get_xlim()  # 1.5 x the host's 1 ms a step

"""scripts/trace_calls.py's counting and its settings filter, on made-up walks and frames (no model loads):
the numbers it prints are only worth reading if these hold, and a counter that calls every stay a return, or
every call a hop, fails here."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest

from lifeofprompt.cpu import c_step
from lifeofprompt.engine.config import EngineConfig

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "trace_calls.py"
_spec = importlib.util.spec_from_file_location("trace_calls", SCRIPT)
trace_calls = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(trace_calls)

# a.py -> b.py -> a.py -> c.py -> b.py -> a.py: six stays in three files; a.py is returned to twice
WALK = [
    ("a.py", "f"),
    ("a.py", "g"),
    ("b.py", "h"),
    ("a.py", "f"),
    ("c.py", "x"),
    ("c.py", "x"),
    ("b.py", "h"),
    ("a.py", "g"),
]


def test_a_walk_back_and_forth_counts_stays_hops_and_returns():
    counts = trace_calls.count_walk(WALK)
    assert counts == {"stays": 6, "hops": 5, "places": 4, "files": 3, "returns": 3}
    stays = trace_calls.stays_of(WALK)
    assert [file for file, _, _ in stays] == ["a.py", "b.py", "a.py", "c.py", "b.py", "a.py"]
    assert stays[0][1] == ["f", "g"] and stays[3][1] == ["x", "x"]
    assert [back for _, _, back in stays] == [False, False, True, False, True, True]


def test_a_walk_that_never_comes_back_has_no_returns():
    walk = [("a.py", "f"), ("b.py", "g"), ("b.py", "h"), ("c.py", "i")]
    assert trace_calls.count_walk(walk) == {"stays": 3, "hops": 2, "places": 4, "files": 3, "returns": 0}


def test_one_file_is_one_stay_and_an_empty_walk_is_all_zero():
    assert trace_calls.count_walk([("a.py", "f"), ("a.py", "f")]) == {
        "stays": 1,
        "hops": 0,
        "places": 1,
        "files": 1,
        "returns": 0,
    }
    assert set(trace_calls.count_walk([]).values()) == {0}


def _frame(*args, **kwargs):
    return sys._getframe()


def _keyword(model, *, config=None):
    return sys._getframe()


def _as_self(self):
    return sys._getframe()


def _carries(frame, carriers) -> bool:
    return any(map(carriers.check, trace_calls.arguments(frame)))


def test_an_engine_config_by_keyword_is_a_carrier_but_not_as_self():
    config = EngineConfig()
    carriers = trace_calls.Carriers(trace_calls.engine_field_names())
    assert _carries(_keyword("m", config=config), carriers)
    assert _carries(_frame(1, config=config), carriers)  # inside **kwargs
    assert _carries(_frame(config), carriers)  # inside *args
    assert not _carries(_as_self(config), carriers)
    assert not _carries(_keyword("m"), carriers)


def test_settings_dicts_and_held_sub_configs_are_carriers():
    carriers = trace_calls.Carriers(trace_calls.engine_field_names())
    assert carriers.check({"max_num_seqs": 4, "dtype": None})
    assert not carriers.check({"max_num_seqs": 4, "prompt": "hi"})
    assert not carriers.check({})

    @dataclasses.dataclass(frozen=True)
    class Part:
        size: int

    class ResolvedConfig:  # matched by its name, like the real one
        def __init__(self):
            self.scheduler, self.name = Part(1), "x"

    resolved, stranger = ResolvedConfig(), Part(1)
    assert not carriers.check(resolved.scheduler)  # not yet seen inside a carrier
    assert carriers.check(resolved)
    assert carriers.check(resolved.scheduler) and not carriers.check(stranger)


def test_the_tracer_records_package_calls_that_get_settings():
    """``replace()`` gets the config only as ``self`` (and no changes); the copy's check gets it as an argument."""
    config = EngineConfig()
    carriers = trace_calls.Carriers(trace_calls.engine_field_names())
    tracer = trace_calls.Tracer(lambda frame: _carries(frame, carriers), carriers)
    with tracer:
        config.replace()
    assert ("engine/config.py", "check") in tracer.walk
    assert ("engine/config.py", "EngineConfig.replace") not in tracer.walk
    assert all(not name.startswith("<") for _, name in tracer.walk)  # no generated __init__, no <genexpr>


class _Holder:
    def __init__(self, config):
        self.config = config

    def read(self):
        return self.config


@dataclasses.dataclass(slots=True)
class _Slotted:
    config: object

    def read(self):
        return sys._getframe()


def _plain(size, name="x"):
    return size


def test_a_method_whose_self_holds_the_config_is_recorded_and_a_call_without_settings_is_not():
    """Start-up reads the settings from ``self.config``: such a method gets no carrier as an argument, and
    counting only those missed it."""
    carriers = trace_calls.Carriers(trace_calls.engine_field_names())
    holder, bare = _Holder(EngineConfig()), _Holder(None)
    tracer = trace_calls.Tracer(lambda frame: trace_calls.settings_in_reach(frame, carriers), carriers)
    tracer.dirs = [(str(Path(__file__).parent), "tests/")]  # this file's functions count as the package's
    with tracer:
        holder.read()
        bare.read()
        _plain(holder.config.block_size, name="m")
    assert tracer.walk == [("tests/test_trace_calls.py", "_Holder.read")]


def test_settings_in_reach_looks_one_level_into_every_argument_and_its_slots():
    config = EngineConfig()
    carriers = trace_calls.Carriers(trace_calls.engine_field_names())
    assert trace_calls.settings_in_reach(_Slotted(config).read(), carriers)  # a slotted dataclass's field
    assert trace_calls.settings_in_reach(_frame(1, holder=_Holder(config)), carriers)  # held by an argument
    assert trace_calls.settings_in_reach(_keyword("m", config=config), carriers)  # the old rule still holds
    assert not trace_calls.settings_in_reach(_frame(_Holder(_Holder(config))), carriers)  # two levels down
    assert not trace_calls.settings_in_reach(_Slotted(None).read(), carriers)


@pytest.mark.slow
@pytest.mark.skipif(c_step.step_kernel() is None, reason="no C compiler: no C step for the walk to measure")
def test_a_request_reaches_its_first_token_in_at_most_30_hops(monkeypatch):
    """The step's shape, measured as the engine README reports it: ``LLM.generate`` of one prompt to its first
    token, with the CPU tuning pinned so that no timing changes the path (the C step decodes). Each hop is a
    reader opening another file; 30 is what the step's issue allows (nano-vllm's walk is about 25)."""
    monkeypatch.setenv("LIFEOFPROMPT_CPU_TUNING", "rowwise")
    walk = trace_calls.first_token_walk()
    counts = trace_calls.count_walk(walk)
    assert ("engine/scheduler.py", "Scheduler.update_from_output") in walk  # the walk is the step's, not a stub's
    assert counts["hops"] <= 30, trace_calls.report("first-token", walk)

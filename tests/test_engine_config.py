"""The engine's one config, its resolution at start-up, and each device's speed-ups kept apart.

``EngineConfig`` is checked before anything loads (a bad value names its field); ``ResolvedConfig``
is built once, frozen, picklable for worker ranks, and printed by the start-up log; a GPU engine
never imports the CPU's tuning modules; on a CPU the step's token budget comes from the measured
prefill speed unless the user gives one.
"""

from __future__ import annotations

import dataclasses
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_models import build_tiny_model, tiny_model

from lifeofprompt import LLM, ConfigError, SamplingParams, SpeculativeConfigError
from lifeofprompt.cpu.speedups import STEP_SECONDS
from lifeofprompt.engine.config import DEFAULT_STEP_TOKENS, EngineConfig

REPO = Path(__file__).resolve().parents[1]
# The modules that exist only to make a CPU fast: CpuSpeedups imports them, nothing on a GPU's path does
# (checked here and in tests/gpu/test_engine_gpu.py, in a fresh process).
CPU_TUNING_MODULES = (
    "lifeofprompt.cpu.speedups",
    "lifeofprompt.cpu.c_step",
    "lifeofprompt.cpu.row_kernels",
    "lifeofprompt.cpu.linear_calibration",
    "lifeofprompt.cpu.huge_pages",
    "lifeofprompt.cpu.allocator",
    "lifeofprompt.cpu.native_build",
)


@pytest.mark.parametrize(
    "settings, field",
    [
        (dict(block_size=0), "block_size"),
        (dict(max_num_seqs=-1), "max_num_seqs"),
        (dict(num_kv_blocks=2.5), "num_kv_blocks"),
        (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
        (dict(attention_backend="cuda"), "attention_backend"),
        (dict(cpu_tuning="fastest"), "cpu_tuning"),
        (dict(long_prefill_token_threshold=-1), "long_prefill_token_threshold"),
        (dict(distributed_executor_backend="ray"), "distributed_executor_backend"),
        (dict(dtype="float33"), "dtype"),
        (dict(dtype="int8"), "dtype"),
        (dict(device="tpu"), "device"),
        (dict(enable_prefix_caching="yes"), "enable_prefix_caching"),
        (dict(prepack_cpu_weights=3), "prepack_cpu_weights"),
    ],
)
def test_a_bad_setting_is_a_typed_error_naming_its_field_before_anything_loads(settings, field, monkeypatch):
    import lifeofprompt.engine.llm_engine as llm_engine

    monkeypatch.setattr(llm_engine, "load_model", lambda *a, **k: pytest.fail("the model loaded before the check"))
    with pytest.raises(ConfigError, match=field) as raised:
        LLM(**settings)
    assert raised.value.param == field


def test_a_misspelt_setting_names_the_closest_and_a_bad_speculative_field_its_own():
    with pytest.raises(ConfigError, match="'max_num_seqs'"):
        EngineConfig.from_settings(max_num_seq=4)
    with pytest.raises(SpeculativeConfigError, match="num_speculative_tokens"):
        EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 0})


def test_the_old_names_are_refused_naming_the_new_one(monkeypatch):
    """Names that were never released are errors, not warnings: each names the setting that replaced it."""
    monkeypatch.delenv("LIFEOFPROMPT_CPU_TUNING", raising=False)
    with pytest.raises(ConfigError, match="cpu_linear= is now cpu_tuning=") as error:
        EngineConfig.from_settings(cpu_linear="transposed")
    assert error.value.param == "cpu_linear"
    with pytest.raises(ConfigError, match="cpu_tuning='c-step'") as error:
        EngineConfig.from_settings(cpu_decode=True)
    assert error.value.param == "cpu_decode"
    monkeypatch.setenv("LIFEOFPROMPT_CPU_LINEAR", "rowwise")
    with pytest.raises(ConfigError, match="LIFEOFPROMPT_CPU_LINEAR is now LIFEOFPROMPT_CPU_TUNING"):
        EngineConfig.from_settings()
    monkeypatch.delenv("LIFEOFPROMPT_CPU_LINEAR")
    with pytest.raises(ConfigError, match="cpu_tuning='c-step'") as error:
        EngineConfig.from_settings(cpu_tuning="cpu")  # the C step's old path name
    assert error.value.param == "cpu_tuning"
    monkeypatch.setenv("LIFEOFPROMPT_CPU_TUNING", "cpu")
    with pytest.raises(ConfigError, match="cpu_tuning='c-step'"):
        EngineConfig.from_settings()
    monkeypatch.delenv("LIFEOFPROMPT_CPU_TUNING")
    assert EngineConfig.from_settings(cpu_tuning="rowwise").cpu_tuning == "rowwise"
    assert EngineConfig.from_settings(attention_backend=None).attention_backend == "auto"  # None: the default


def test_an_old_name_through_llm_is_a_config_error():
    """Through the front door too, before anything loads."""
    from lifeofprompt import LLM

    with pytest.raises(ConfigError, match="cpu_linear= is now cpu_tuning="):
        LLM(cpu_linear="linear")


def test_each_default_is_written_once_in_the_config():
    """The engine's layers take the config, not loose copies: no signature under engine/, model/,
    distributed/ or serving/ restates one of these defaults."""
    restated = []
    for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "gpu_memory_utilization"):
        default = dataclasses.fields(EngineConfig)[[f.name for f in dataclasses.fields(EngineConfig)].index(name)]
        value = {"max_num_batched_tokens": DEFAULT_STEP_TOKENS}.get(name, default.default)
        for folder in ("engine", "model", "distributed", "serving"):
            for path in set((REPO / "lifeofprompt" / folder).rglob("*.py")) - {REPO / "lifeofprompt/engine/config.py"}:
                for pattern in (f"{name}: int = {value}", f"{name}={value}", f"{name}: float = {value}"):
                    if pattern in path.read_text():
                        restated.append(f"{path.relative_to(REPO)}: {pattern}")
    assert not restated, restated


@pytest.fixture(scope="module")
def engine():
    model, tokenizer = tiny_model()
    return LLM(model, tokenizer=tokenizer, num_kv_blocks=32, block_size=4, max_num_seqs=3, log_stats=False).engine


def test_the_resolved_config_is_frozen_picklable_and_in_the_log(engine):
    r = engine.resolved
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.num_kv_blocks = 1
    assert pickle.loads(pickle.dumps(r)) == r
    assert (r.num_kv_blocks, r.block_size, r.max_num_seqs, r.attention_backend) == (32, 4, 3, "torch")
    assert r.max_model_len == 32 * 4  # the pool caps the tiny model's context
    assert engine.scheduler.config is r.scheduler and engine.runner.kv_cache.num_blocks == r.num_kv_blocks
    assert (engine.block_size, engine.num_kv_blocks, engine.max_model_len) == (4, 32, 128)  # the old attributes
    log = "\n".join(engine.startup_log)
    assert f"up to 3 sequences and {r.max_num_batched_tokens} tokens per step" in log
    assert "speed-ups: CPU tuning; attention backend torch; no CUDA graphs" in log


def test_a_cpu_step_is_bounded_in_time_unless_a_budget_is_given(monkeypatch, tmp_path):
    """Unpinned, the budget is what one step prefills in STEP_SECONDS here (a block multiple, at most the
    default); pinned it is the default; asked for, it is what was asked."""
    monkeypatch.setenv("LIFEOFPROMPT_CACHE", str(tmp_path))
    model, tokenizer = tiny_model()
    settings = dict(tokenizer=tokenizer, num_kv_blocks=128, block_size=4, log_stats=False)
    measured = LLM(model, cpu_tuning="auto", **settings).engine
    budget, note = measured.resolved.max_num_batched_tokens, measured.resolved.why["budget"]
    assert budget % 4 == 0 and 4 <= budget <= DEFAULT_STEP_TOKENS and "tokens/s" in note, note
    rate = float(note.split(" tokens/s")[0].rsplit(" ", 1)[1].replace(",", ""))
    # the note rounds the rate to whole tokens/s, which can move the budget across one block boundary
    assert abs(budget - min(DEFAULT_STEP_TOKENS, max(4, int(rate * STEP_SECONDS) // 4 * 4))) <= 4
    pinned = LLM(model, cpu_tuning="linear", **settings).engine
    assert pinned.resolved.max_num_batched_tokens == DEFAULT_STEP_TOKENS
    asked = LLM(model, cpu_tuning="auto", max_num_batched_tokens=40, **settings).engine
    assert asked.resolved.max_num_batched_tokens == 40 and asked.resolved.why["budget"] == "as asked"


def test_a_model_with_a_short_context_times_its_prefill_within_it(monkeypatch, tmp_path):
    """The prefill probe is 256 tokens; a model that has 64 positions is timed on 64 (it raised an IndexError
    at start-up before), and its budget still comes from the measured rate."""
    monkeypatch.setenv("LIFEOFPROMPT_CACHE", str(tmp_path))
    model, tokenizer = build_tiny_model(max_position_embeddings=64)
    llm = LLM(model, tokenizer=tokenizer, num_kv_blocks=32, block_size=4, log_stats=False, cpu_tuning="auto")
    assert "tokens/s" in llm.engine.resolved.why["budget"]
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_the_gpu_path_never_imports_the_cpu_tuning():
    """In a fresh process: the engine, the server and the GPU's speed-ups, the GPU's chosen for a CUDA model, and
    an engine run with the CPU tuning off; none of the CPU's tuning modules is ever imported."""
    probe = f"""
import sys, types, torch
sys.path.insert(0, {str(REPO / "tests")!r})
from tiny_models import build_tiny_model, tiny_model
import lifeofprompt.engine.llm_engine, lifeofprompt.serving.server
from lifeofprompt import LLM, SamplingParams
from lifeofprompt.engine.config import EngineConfig
from lifeofprompt.model.loader import prepare_for_device
cuda = types.SimpleNamespace(device=torch.device("cuda"), config=None)
assert prepare_for_device(cuda, EngineConfig()).name.startswith("GPU")
model, tokenizer = tiny_model()
llm = LLM(model, tokenizer=tokenizer, num_kv_blocks=16, cpu_tuning="off", log_stats=False)
assert llm.engine.resolved.speedups == "plain torch"
llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
print(" ".join(m for m in {list(CPU_TUNING_MODULES)!r} if m in sys.modules))
"""
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == []
    tuned = f"""
import sys
sys.path.insert(0, {str(REPO / "tests")!r})
from tiny_models import build_tiny_model, tiny_model
from lifeofprompt import LLM
model, tokenizer = tiny_model()
LLM(model, tokenizer=tokenizer, num_kv_blocks=16, cpu_tuning="linear", log_stats=False)
print(" ".join(m for m in {list(CPU_TUNING_MODULES)!r} if m in sys.modules))
"""
    out = subprocess.run([sys.executable, "-c", tuned], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0 and "lifeofprompt.cpu.speedups" in out.stdout.split(), out.stderr[-3000:]

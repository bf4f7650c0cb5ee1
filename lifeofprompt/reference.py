"""transformers, the reference our own code is checked against (parity tests, notebooks, benchmarks).

Loaded from the very folder ``load_model`` reads, so both sides see identical weights.
"""

from __future__ import annotations

import torch

from .loader import default_device_and_dtype, smollm2_hf_dir, tinyllama_dir


def load_reference(name: str = "smollm2-135m", dtype=None, device=None):
    """transformers' ``LlamaForCausalLM`` for a model name or a local folder."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    device, dtype = default_device_and_dtype(device, dtype)
    folder = {"smollm2-135m": smollm2_hf_dir, "tinyllama-1.1b": tinyllama_dir}.get(name, lambda: Path(name))()
    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()


@torch.no_grad()
def hf_greedy(ref_model, token_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy ``generate`` with EOS ignored: neither a stop nor masked.

    (``min_new_tokens`` would keep generation going, but by forbidding EOS, so the tokens
    change wherever EOS was the argmax; an empty ``eos_token_id`` list just never stops.)
    """
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=[], pad_token_id=0)
    ids = torch.tensor([list(token_ids)], device=ref_model.device)
    return ref_model.generate(ids, generation_config=config)[0, ids.shape[1]:].tolist()

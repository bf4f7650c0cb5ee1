"""Our Llama forward against transformers, and the flat forward against the convenience form."""

from __future__ import annotations

import pytest
import torch

from lifeofprompt.lessons.agreement import FP32_TOLERANCE, assert_argmax_agrees
from lifeofprompt.lessons.reference import to_hf_config
from lifeofprompt.model.attention import NoCacheMetadata
from lifeofprompt.model.config import ModelConfig
from lifeofprompt.model.llama import LlamaForCausalLM

STORY_IDS = [[6004, 957, 1462, 314], [28195, 314, 253, 3953, 4018, 1194], [28120, 665]]

pytestmark = [pytest.mark.numerics, pytest.mark.usefixtures("one_thread")]


@torch.no_grad()
def test_embedded_model_matches_transformers(smollm2, smollm2_reference):
    model, _ = smollm2
    for ids in STORY_IDS:
        x = torch.tensor([ids])
        ours, theirs = model(x), smollm2_reference(x).logits
        assert ours.shape == theirs.shape == (1, len(ids), 49152)
        assert (ours - theirs).abs().max().item() <= 1e-3
        # every row's best token leads by 0.1 or more: far beyond the two computations' rounding
        assert_argmax_agrees(ours[0], theirs[0], FP32_TOLERANCE, min_decided=len(ids))


def tiny_config(tie: bool) -> ModelConfig:
    """Small enough to build in milliseconds, with grouped-query attention (4 query heads over 2 KV heads)."""
    return ModelConfig(
        name="tiny-gqa",
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=500.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
    )


@pytest.mark.parametrize("tie", [False, True])
@torch.no_grad()
def test_random_gqa_config_matches_transformers(tie):
    from transformers import LlamaForCausalLM as HFLlama

    config = tiny_config(tie)
    torch.manual_seed(0)
    reference = HFLlama(to_hf_config(config)).eval()
    with torch.no_grad():  # norms at 1 would hide a norm-weight mix-up
        for name, p in reference.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    ours = LlamaForCausalLM(config)
    ours.load_hf_state_dict(dict(reference.state_dict()))
    ours.eval()
    assert ModelConfig.from_hf(reference.config).rope_theta == 500.0
    ids = torch.randint(0, config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(1))
    diff = (ours(ids) - reference(ids).logits).abs().max().item()
    assert diff <= 1e-4, diff
    # and the forward really depends on the weights we loaded (a wrong mapping cannot pass)
    ours.layers[1].self_attn.qkv_proj.weight.mul_(1.5)
    assert (ours(ids) - reference(ids).logits).abs().max().item() > 1e-3


@torch.no_grad()
def test_flat_batch_equals_each_sequence_alone(smollm2):
    model, _ = smollm2
    flat = torch.tensor([t for s in STORY_IDS for t in s])
    positions = torch.tensor([i for s in STORY_IDS for i in range(len(s))])
    meta = NoCacheMetadata.for_lengths([len(s) for s in STORY_IDS])
    logits = model(flat, positions, meta)
    assert logits.shape == (12, 49152)
    start = 0
    for ids in STORY_IDS:
        alone = model(torch.tensor([ids]))[0]
        # fp32, logits up to ~20: products of 2 rows and of 12 sum in different orders (~1e-5 relative);
        # a row that saw another sequence's keys would be off by whole units
        assert (logits[start : start + len(ids)] - alone).abs().max().item() <= 3e-4
        start += len(ids)


@torch.no_grad()
def test_logits_indices_pick_rows(smollm2):
    model, _ = smollm2
    flat = torch.tensor([t for s in STORY_IDS for t in s])
    positions = torch.tensor([i for s in STORY_IDS for i in range(len(s))])
    full = model(flat, positions, NoCacheMetadata.for_lengths([4, 6, 2]))
    last = NoCacheMetadata.for_lengths([4, 6, 2], last_rows_only=True)
    assert last.logits_indices.tolist() == [3, 9, 11]
    picked = model(flat, positions, last)
    assert picked.shape == (3, 49152)
    assert (picked - full[[3, 9, 11]]).abs().max().item() <= 1e-4  # same rows; BLAS may block 3 rows differently
    # '...', ' in', "'s": the greedy next tokens (pinned, so checked where this CPU's logits decide them)
    assert_argmax_agrees([2026, 281, 506], picked, FP32_TOLERANCE, min_decided=3)
    chosen = NoCacheMetadata.for_lengths([4, 6, 2])
    chosen.logits_indices = torch.tensor([0, 5])
    assert (model(flat, positions, chosen) - full[[0, 5]]).abs().max().item() <= 1e-4


def test_the_rotary_table_stays_fp32_in_every_dtype():
    """``model.to(bf16)`` rounds the weights, not the angles: the table keeps its fp32 values (the fused
    Triton kernel requires fp32, and every shard of a split model must hold the same table)."""
    from lifeofprompt.model.layers import RotaryEmbedding

    rotary = RotaryEmbedding(64, 512, 10000.0)
    exact = rotary.cos.clone(), rotary.sin.clone()
    for dtype in (torch.bfloat16, torch.float16):
        moved = RotaryEmbedding(64, 512, 10000.0).to(dtype)
        assert moved.cos.dtype == moved.sin.dtype == torch.float32
        assert moved.cos.equal(exact[0]) and moved.sin.equal(exact[1])
    assert not exact[0].to(torch.bfloat16).float().equal(exact[0])  # what rounding would have done
    model = LlamaForCausalLM(tiny_config(tie=True)).to(torch.bfloat16)
    assert model.embed_tokens.weight.dtype == torch.bfloat16 and model.rotary.cos.dtype == torch.float32

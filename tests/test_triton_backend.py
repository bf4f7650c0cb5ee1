"""The whole model with the Triton backend (interpreter on the CPU) gives the torch backend's logits,
with and without the fused element-wise kernels.

Two ``ModelRunner``s over the embedded SmolLM2 (fp32), one per backend, run the same two
steps: first the prompts "hi my name is" and "hello there" whole plus the first half of
"today is a beautiful summer day" (a chunk), then a decode row for each finished prompt and
the chunk's second half after its cached prefix. Block size 4 and shuffled block tables make
every sequence cross blocks.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from lifeofprompt.engine.model_runner import ModelRunner
from lifeofprompt.engine.sampling_params import SamplingParams
from lifeofprompt.engine.sequence import Sequence
from lifeofprompt.model import layers
from lifeofprompt.model.layers import fused_kernels

if importlib.util.find_spec("triton") is None:  # find it without importing it: lifeofprompt.kernels
    pytest.skip("Triton is not installed", allow_module_level=True)  # must be first (interpreter mode)
from lifeofprompt.lessons.agreement import FP32_TOLERANCE, assert_argmax_agrees  # noqa: E402

pytestmark = [pytest.mark.numerics, pytest.mark.usefixtures("one_thread")]

BLOCK_TABLES = [[9, 2], [14, 5], [11]]


def make_seqs(story_ids):
    seqs = [Sequence(str(i), ids, SamplingParams(temperature=0)) for i, ids in enumerate(story_ids)]
    for seq, table in zip(seqs, BLOCK_TABLES):
        seq.block_table = list(table)
    return seqs


def step_logits(runner, seqs, num_tokens, fused=False):
    """Logits of every row of one step (not only the sampled ones), then mark the tokens computed."""
    input_ids, positions, meta = runner.prepare(seqs, num_tokens)
    meta.logits_indices = None
    # the GPU's layers call their fused kernels themselves (model/layers.py); here the interpreter runs them
    with torch.no_grad(), fused_kernels("on" if fused else "off"):
        logits = runner.model(input_ids, positions, meta)
    for seq, n in zip(seqs, num_tokens):
        seq.num_computed_tokens += n
    return logits


@pytest.mark.slow
def test_triton_backend_logits_match_torch(smollm2, story_ids, monkeypatch):
    model, _ = smollm2
    assert [len(ids) for ids in story_ids] == [4, 6, 2]
    # The torch runner runs the torch forward whatever the product path (a pinned ``rowwise`` would
    # otherwise send its steps through the one-call C step, another summation order throughout), so
    # the two runners differ in their attention alone.
    pool = dict(num_kv_blocks=16, block_size=4)
    runners = {name: ModelRunner.for_model(model, attention_backend=name, **pool) for name in ("torch", "triton")}
    # the GPU engine's full path: Triton attention and the fused element-wise kernels (the GPU's speed-ups)
    runners["fused"] = ModelRunner.for_model(model, attention_backend="triton", cpu_tuning="off", **pool)
    seqs = {name: make_seqs(story_ids) for name in runners}

    fused_calls = []  # each op's answer to "run the fused kernel?": yes only in the fused runner's steps
    ask = layers.use_fused
    monkeypatch.setattr(layers, "use_fused", lambda x: fused_calls.append(ask(x)) or fused_calls[-1])
    first = {}
    for name in runners:
        fused_calls.clear()
        first[name] = step_logits(runners[name], seqs[name], [4, 3, 2], name == "fused")
        assert fused_calls and all(fused_calls) == (name == "fused") == any(fused_calls), name
    assert first["triton"].shape == (9, model.config.vocab_size)
    torch.testing.assert_close(first["triton"], first["torch"], atol=1e-4, rtol=0)
    torch.testing.assert_close(first["fused"], first["torch"], atol=1e-4, rtol=0)

    # Greedy next tokens for the two finished prompts, then decode rows + the chunk's rest.
    for name in runners:
        for seq, row in ((seqs[name][0], 3), (seqs[name][2], 8)):
            seq.output_token_ids.append(int(first["torch"][row].argmax()))
    second = {name: step_logits(runners[name], seqs[name], [1, 3, 1], name == "fused") for name in runners}
    assert second["triton"].shape == (5, model.config.vocab_size)
    torch.testing.assert_close(second["triton"], second["torch"], atol=1e-4, rtol=0)
    torch.testing.assert_close(second["fused"], second["torch"], atol=1e-4, rtol=0)
    # the same next tokens wherever the torch backend decides them (measured: all 5 rows, by 0.16 or more)
    assert_argmax_agrees(second["triton"], second["torch"], FP32_TOLERANCE, min_decided=4)
    assert_argmax_agrees(second["fused"], second["torch"], FP32_TOLERANCE, min_decided=4)

    # Both caches hold the same keys and values in the same (shuffled) blocks.
    torch.testing.assert_close(runners["triton"].kv_cache.kv, runners["torch"].kv_cache.kv, atol=1e-4, rtol=0)
    torch.testing.assert_close(runners["fused"].kv_cache.kv, runners["torch"].kv_cache.kv, atol=1e-4, rtol=0)

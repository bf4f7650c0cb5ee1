"""Pipeline parallelism (contiguous layer stages, hidden states sent stage to stage) on the tiny model
with SmolLM2's head layout: P = 2 alone and T x P = 3 x 2 give the single-process engine's greedy tokens
through chunked prefill, prefix caching and preemption; each rank holds its stage's layers (and only
its heads of them) in its weights and its KV pool. These run one step at a time (``pipeline_overlap=False``:
the same batches as the single engine, so the same prefix-cache hits); test_pipeline_overlap.py runs
the overlapped default."""

from __future__ import annotations

import json

import pytest
from test_tensor_parallel import BLOCK_SIZE, ENGINE, PROMPTS, greedy
from tiny_models import TINY_SMOLLM2_LAYOUT, assert_parallel_agrees, tiny_model

from lifeofprompt.distributed.sizes import check_pipeline_parallel_size, stage_layers
from lifeofprompt.engine.llm import LLM
from lifeofprompt.errors import ParallelConfigError

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.ranks]


@pytest.fixture(scope="module")
def single(one_thread):
    model, tokenizer = tiny_model()
    llm = LLM(model, tokenizer=tokenizer, **ENGINE)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy())]


def test_stages_are_contiguous_and_cover_every_layer():
    assert [stage_layers(30, 4, s) for s in range(4)] == [(0, 8), (8, 16), (16, 23), (23, 30)]
    assert [stage_layers(2, 2, s) for s in range(2)] == [(0, 1), (1, 2)]
    with pytest.raises(ParallelConfigError, match="valid sizes: 1 to 2"):
        check_pipeline_parallel_size(TINY_SMOLLM2_LAYOUT, 3)


@pytest.mark.parametrize("tp, pp", [(1, 2), (3, 2)])
def test_stages_give_the_single_process_tokens(single, tp, pp):
    model, tokenizer = tiny_model()
    llm = LLM(
        model, tokenizer=tokenizer, tensor_parallel_size=tp, pipeline_parallel_size=pp, pipeline_overlap=False, **ENGINE
    )
    try:
        outputs = llm.generate(PROMPTS, greedy())
        engine = llm.engine
        assert engine.scheduler.num_preemptions > 0 and outputs[1].num_cached_tokens >= 2 * BLOCK_SIZE
        tokens = [o.outputs[0].token_ids for o in outputs]
        full, _ = tiny_model()
        assert_parallel_agrees(engine.model, full, PROMPTS, tokens, single)

        reports = engine.parallel.report(engine.model, engine.runner.kv_cache)
        assert [r["rank"] for r in reports] == list(range(tp * pp))
        full_bytes = sum(p.numel() * p.element_size() for p in full.parameters())
        kv_heads = 3 // tp
        embedding = full.embed_tokens.weight.numel() * 4  # the tied head's copy on the last stage
        for r in reports:
            shapes = r["weights"]["shapes"]
            assert r["stage"] == r["rank"] // tp and r["layers"] == [(0, 1), (1, 2)][r["stage"]]
            assert "layers.0.self_attn.qkv_proj.weight" in shapes and "layers.1.self_attn.qkv_proj.weight" not in shapes
            assert ("embed_tokens.weight" in shapes) == (r["stage"] == 0)
            assert ("lm_head.weight" in shapes) == (r["stage"] == 1)  # the tied head, copied to the last stage
            assert r["kv_shape"] == (1, 2, 12, BLOCK_SIZE, kv_heads, 16)
            # half the layers and the embedding (first stage) or its copy as the LM head (last), each 1/T of it
            assert r["weights"]["nbytes"] == pytest.approx(((full_bytes - embedding) / pp + embedding) / tp, rel=0.02)
        assert sum(r["weights"]["nbytes"] for r in reports) == pytest.approx(full_bytes + embedding, rel=0.01)
        assert len({str(r["block_tables"]) for r in reports}) == 1
    finally:
        llm.shutdown()


TORCHRUN_SCRIPT = """
import json, os, sys
sys.path.insert(0, {tests!r})
import torch
torch.set_num_threads(1)
from tiny_models import tiny_model
from lifeofprompt import LLM, SamplingParams
from test_tensor_parallel import ENGINE, PROMPTS, greedy
model, tokenizer = tiny_model()
llm = LLM(model, tokenizer=tokenizer, pipeline_parallel_size=2, pipeline_overlap=False,   # the single engine's batches
          **ENGINE)                                                                    # rank 1 serves here, then exits
tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy())]
print("TOKENS " + json.dumps(dict(rank=int(os.environ["RANK"]), tokens=tokens)), flush=True)
llm.shutdown()
"""


def test_two_torchrun_nodes_give_the_same_tokens(single, tmp_path):
    """Two ``torchrun --nnodes 2 --nproc-per-node 1`` launches of the same script, c10d rendezvous on
    127.0.0.1, P = 2: whichever becomes rank 0 drives, the other serves its stage and exits."""
    import socket
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "node.py"
    script.write_text(TORCHRUN_SCRIPT.format(tests=str(Path(__file__).resolve().parent)))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        "lifeofprompt-test",
        "--max-restarts",
        "0",
        str(script),
    ]
    nodes = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        results = [node.communicate(timeout=240) for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    assert [node.returncode for node in nodes] == [0, 0], [err[-3000:] for _, err in results]
    lines = [line for out, _ in results for line in out.splitlines() if line.startswith("TOKENS ")]
    assert len(lines) == 1  # only rank 0 comes back from LLM(...)
    found = json.loads(lines[0].removeprefix("TOKENS "))
    assert found["rank"] == 0 and found["tokens"] == single  # the same ops on the same weights: exactly equal

"""Prompt-lookup speculation on a tensor- and pipeline-parallel engine (one parallel engine per process)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lifeofprompt import LLM
from lifeofprompt.errors import SpeculativeConfigError

HERE = Path(__file__).resolve().parent
pytestmark = pytest.mark.ranks

SCRIPT = r"""
import json, sys, torch
sys.path.insert(0, {here!r})
torch.set_num_threads(1)
from tiny_models import tiny_model, assert_parallel_agrees
from lifeofprompt import LLM, SamplingParams

model, tok = tiny_model()
prompts = [tok.encode(t) for t in ("abcabcabcabcabc", "hello hello hello hello", "xyzxyzxyz")]
params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
spec = {{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}}
single = [o.outputs[0].token_ids for o in LLM(model, tokenizer=tok, log_stats=False, num_kv_blocks=128,
                                              max_num_seqs=4).generate(prompts, params, use_tqdm=False)]
llm = LLM(tiny_model()[0], tokenizer=tok, log_stats=False, num_kv_blocks=128, max_num_seqs=4,
          tensor_parallel_size={t}, pipeline_parallel_size={p}, pipeline_overlap={overlap}, speculative_config=spec)
assert (llm.engine.pipeline is not None) == ({p} > 1 and {overlap})
outs = llm.generate(prompts, params, use_tqdm=False)
tokens = [o.outputs[0].token_ids for o in outs]
verifies = sum(len(o.metrics.spec_steps) for o in outs)
accepted = llm.engine.spec_stats.num_accepted_tokens
assert_parallel_agrees(llm.engine.model, tiny_model()[0], prompts, tokens, single)
llm.shutdown()
in_flight = llm.engine.pipeline.max_in_flight if llm.engine.pipeline is not None else 1
print(json.dumps(dict(verifies=verifies, accepted=accepted, lengths=[len(t) for t in tokens], in_flight=in_flight)))
"""


@pytest.mark.parametrize("t,p,overlap", [(3, 1, True), (1, 2, True), (1, 2, False), (3, 2, True)])
def test_ngram_speculation_keeps_the_single_engines_tokens(t, p, overlap):
    """P = 2 with its steps overlapped (the default) and one step at a time; T x P = 3 x 2 overlapped."""
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(here=str(HERE), t=t, p=p, overlap=overlap)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["verifies"] > 0 and result["accepted"] > 0  # the drafter fired and was right sometimes
    assert result["lengths"] == [24, 24, 24]
    assert result["in_flight"] == (2 if p > 1 and overlap else 1)


def test_a_draft_model_with_parallel_sizes_is_a_typed_error():
    from tiny_models import tiny_model

    model, tok = tiny_model()
    with pytest.raises(SpeculativeConfigError) as info:
        LLM(
            model,
            tokenizer=tok,
            tensor_parallel_size=3,
            speculative_config={"model": model, "num_speculative_tokens": 2},
        )
    assert info.value.param == "model"

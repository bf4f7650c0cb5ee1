"""The CPU engine's optional bf16: the same model in half the bytes, close to fp32."""

import torch

from lifeofprompt import LLM, SamplingParams, load_model


def test_bf16_on_the_cpu_follows_fp32(smollm2, story_ids, one_thread):
    model32, tokenizer = smollm2
    model16, _ = load_model("smollm2-135m", dtype=torch.bfloat16, device="cpu")
    llm = LLM(model16, tokenizer=tokenizer, num_kv_blocks=64, log_stats=False)
    assert llm.engine.runner.kv_cache.kv.dtype == torch.bfloat16
    assert llm.engine.runner.prepacked_bytes == 0            # oneDNN prepacking is for fp32 (measured there)
    # teacher-forced: every prompt row's logits within bf16's precision of fp32's, the same argmax
    ids = torch.tensor([t for s in story_ids for t in s])
    positions = torch.tensor([i for s in story_ids for i in range(len(s))])
    from lifeofprompt.model.attention import NoCacheMetadata
    meta = NoCacheMetadata.for_lengths([len(s) for s in story_ids])
    with torch.no_grad():
        full, half = model32(ids, positions, meta), model16(ids, positions, meta)
    assert half.dtype == torch.float32 and half.shape == full.shape == (12, 49152)
    # bf16 keeps ~3 significant digits through 30 layers: errors of a few % of a row's largest logit
    error = (half - full).abs() / full.abs().amax(-1, keepdim=True)
    assert error.mean() < 0.02 and error.max() < 0.1, (error.mean(), error.max())
    assert torch.equal(half.argmax(-1), full.argmax(-1))
    # and the engine generates with it: the first greedy token of each story prompt as in fp32
    out = llm.generate(story_ids, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    firsts = [o.outputs[0].token_ids[0] for o in out]
    assert firsts == full[[3, 9, 11]].argmax(-1).tolist()

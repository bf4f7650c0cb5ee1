"""Writes ``engine_parity_smollm2.json``: transformers' greedy tokens for the parity prompts, with margins.

    .venv/bin/python tests/data/make_engine_parity.py

transformers' ``generate`` on the embedded SmolLM2-135M in fp32 on the CPU, one prompt at a
time, 64 new tokens, EOS ignored (``lifeofprompt.lessons.reference.hf_greedy``'s settings). Besides
the tokens it keeps, per step, the top-2 margin of the logits that chose the token
(``lifeofprompt.lessons.agreement.top2_margins``): ``tests/test_engine_parity.py`` compares the
engine's tokens only up to the first step where the two may legitimately differ (see
``lifeofprompt.lessons.agreement.assert_greedy_agrees``). Takes about a minute on one thread.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


def main() -> None:
    from test_engine_parity import NEW_TOKENS, PROMPTS
    from transformers import GenerationConfig

    from lifeofprompt import load_model
    from lifeofprompt.lessons.agreement import top2_margins
    from lifeofprompt.lessons.reference import load_reference

    torch.set_num_threads(1)
    _, tokenizer = load_model("smollm2-135m", dtype=torch.float32, device="cpu")
    reference = load_reference("smollm2-135m", dtype=torch.float32, device="cpu")
    config = GenerationConfig(
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        eos_token_id=[],
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    tokens, margins = {}, {}
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = torch.tensor([tokenizer.encode(prompt)])
            out = reference.generate(ids, generation_config=config)
            tokens[prompt] = out.sequences[0, ids.shape[1] :].tolist()
            margins[prompt] = [round(m, 5) for m in top2_margins(torch.cat(out.logits)).tolist()]
    data = {
        "model": "smollm2-135m fp32 (embedded GGUF, dequantized)",
        "source": "transformers generate, greedy, EOS ignored (lifeofprompt.lessons.reference.hf_greedy); "
        "equal to LLM.generate in one batch",
        "made_by": "python tests/data/make_engine_parity.py",
        "new_tokens": NEW_TOKENS,
        "tokens": tokens,
        "margins_note": "per step, transformers' best logit minus its second best "
        "(lifeofprompt.lessons.agreement.top2_margins)",
        "margins": margins,
    }
    (HERE / "engine_parity_smollm2.json").write_text(json.dumps(data, indent=1) + "\n")


if __name__ == "__main__":
    main()

"""What quantizing costs in accuracy: perplexity on a short fixed text, before and after (chapter 06).

Perplexity is exp(mean negative log-likelihood) of each token given the ones before it: how many
equally likely choices the model is, on average, torn between. A quantized model that predicts the
same text about as well has lost little. The text (``data/evaluation_text.txt``, ~350 words about a
harbour town) was written for this project, so no model has seen it in training and anyone may
ship it; it is one forward of about 450 tokens, seconds on a CPU.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

TEXT_PATH = Path(__file__).parent / "data" / "evaluation_text.txt"


def evaluation_text() -> str:
    return TEXT_PATH.read_text()


@torch.no_grad()
def perplexity(model, tokenizer, text: str | None = None) -> float:
    """``exp`` of the mean negative log-likelihood of every token of ``text`` after the first (one forward)."""
    ids = torch.tensor([tokenizer.encode(text or evaluation_text())], device=model.device)
    logits = model(ids)[0, :-1].float()
    nll = torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="mean")
    return math.exp(nll.item())

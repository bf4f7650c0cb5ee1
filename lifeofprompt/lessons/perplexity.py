"""What quantizing costs in accuracy: perplexity on a short fixed text, before and after (chapter 06).

Perplexity is exp(mean negative log-likelihood) of each token given the ones before it: how many
equally likely choices the model is, on average, torn between. A quantized model that predicts the
same text about as well has lost little. The text (``lifeofprompt/data/evaluation_text.txt``, ~350 words about a
harbour town) was written for this project, so no model has seen it in training and anyone may
ship it; it is one forward of about 450 tokens, seconds on a CPU. A second text written for the
project, ``lifeofprompt/data/long_evaluation_text.txt`` (~4,900 tokens: a year in a river village), is long
enough for a difference of a fraction of a percent to mean something: the accuracy rules of the
CPU's integer products and of a compressed KV cache are measured on it.
"""

from __future__ import annotations

import math

import torch

from ..texts import evaluation_text, long_evaluation_text  # noqa: F401 (the chapters import them from here)

LOGIT_ROWS = 512  # rows of logits made at a time: a long text's all at once would take gigabytes


@torch.no_grad()
def perplexity(model, tokenizer, text: str | None = None) -> float:
    """``exp`` of the mean negative log-likelihood of every token of ``text`` after the first: one forward
    to the last hidden states, then the LM head ``LOGIT_ROWS`` rows at a time."""
    from ..model.attention import NoCacheMetadata

    ids = torch.tensor(tokenizer.encode(text or evaluation_text()), device=model.device)
    positions = torch.arange(len(ids), device=model.device)
    hidden = model.hidden_states(ids, positions, NoCacheMetadata.for_lengths([len(ids)]))[:-1]
    total = 0.0
    for first in range(0, len(hidden), LOGIT_ROWS):
        logits = model.lm_head(hidden[first : first + LOGIT_ROWS]).float()
        total += torch.nn.functional.cross_entropy(logits, ids[first + 1 : first + 1 + LOGIT_ROWS], reduction="sum")
    return math.exp(total.item() / len(hidden))


def perplexity_through_the_pool(llm, text: str | None = None) -> float:
    """The same score, taken by the engine ``llm``: the prompt log-probabilities of its chunked prefill, so each
    chunk's attention reads the keys and values the earlier chunks left in the KV pool, in whatever form
    ``kv_cache_dtype`` stores them (``perplexity`` above runs without a cache and cannot see it). The chunks
    are the engine's step budget (``max_num_batched_tokens``)."""
    from ..engine.sampling_params import SamplingParams

    ids = llm.get_tokenizer().encode(text or evaluation_text())
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    scored = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].prompt_logprobs
    total = -sum(entry[token] for entry, token in zip(scored[1:], ids[1:], strict=True))
    return math.exp(total / (len(ids) - 1))

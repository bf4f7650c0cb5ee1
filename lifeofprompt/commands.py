"""What each ``python -m lifeofprompt`` subcommand does (the parser lives in ``cli.py``)."""

from __future__ import annotations

import time

from .cli import STORY_PROMPTS
from .errors import InvalidRequestError
from .loader import load_model


def _load(args):
    started = time.perf_counter()
    model, tokenizer = load_model(args.model, dtype=args.dtype, device=args.device)
    print(f"model: {model.source}")
    print(f"       {model.config.num_layers} layers, hidden {model.config.hidden_size}, "
          f"{model.config.num_heads} query heads over {model.config.num_kv_heads} KV heads, "
          f"vocab {model.config.vocab_size}; {model.dtype} on {model.device} "
          f"(loaded in {time.perf_counter() - started:.1f} s)")
    if model.is_random:
        print("       NOTE: random weights - the text below is meaningless; use it for speed and memory only")
    return model, tokenizer


def demo(args) -> int:
    """The story's three prompts: tokenized, completed greedily, with what happened on the way."""
    from .generate import generate_cached_batch

    if args.max_tokens < 1:
        raise InvalidRequestError("--max-tokens must be at least 1", param="max_tokens")
    model, tokenizer = _load(args)
    print("\n1. tokenization: text becomes integers")
    prompt_ids = []
    for text in STORY_PROMPTS:
        ids = tokenizer.encode(text)
        prompt_ids.append(ids)
        print(f"   {text!r:36} -> {len(ids)} tokens {ids}")
        print(f"   {'':36}    {tokenizer.convert_ids_to_tokens(ids)}")
    print(f"\n2. greedy completions, {args.max_tokens} new tokens each (one batched prefill, then one decode row per prompt per step)")
    started = time.perf_counter()
    completions = generate_cached_batch(model, prompt_ids, args.max_tokens)
    elapsed = time.perf_counter() - started
    for text, new in zip(STORY_PROMPTS, completions):
        print(f"   {text!r} -> {tokenizer.decode(new)!r}")
        print(f"   {'':{len(repr(text))}}    new ids {new}")
    print(f"\n   {len(STORY_PROMPTS) * args.max_tokens} tokens in {elapsed:.2f} s")
    return 0


def generate(args) -> int:
    """Complete one prompt and print the text."""
    from .generate import generate_cached

    if args.max_tokens < 1:
        raise InvalidRequestError("--max-tokens must be at least 1", param="max_tokens")
    model, tokenizer = _load(args)
    new = generate_cached(model, tokenizer.encode(args.prompt), args.max_tokens)
    print(args.prompt + tokenizer.decode(new))
    return 0


def serve(args) -> int:
    from .errors import MissingDependencyError
    raise MissingDependencyError("the server arrives with notebook 09 (lifeofprompt.server)")


def loadtest(args) -> int:
    from .errors import MissingDependencyError
    raise MissingDependencyError("the load tester arrives with notebook 09 (lifeofprompt.loadtest)")

"""What each ``python -m lifeofprompt`` subcommand does (the parser lives in ``cli.py``)."""

from __future__ import annotations

import time

from .errors import InvalidRequestError
from .model.loader import load_model
from .story import STORY_PROMPTS


def _load(args, say_dtype_reason: bool = True):
    started = time.perf_counter()
    model, tokenizer = load_model(args.model, dtype=args.dtype, device=args.device, quantization=_quantization(args))
    print(f"model: {model.source}")
    print(
        f"       {model.config.num_layers} layers, hidden {model.config.hidden_size}, "
        f"{model.config.num_heads} query heads over {model.config.num_kv_heads} KV heads, "
        f"vocab {model.config.vocab_size}; {model.dtype} on {model.device} "
        f"(loaded in {time.perf_counter() - started:.1f} s)"
    )
    if model.dtype_reason and say_dtype_reason:
        print(f"       dtype {model.dtype_reason}")
    if model.is_random:
        print("       NOTE: random weights - the text below is meaningless; use it for speed and memory only")
    return model, tokenizer


def _quantization(args):
    """``--quantization`` as the engine loads it (``EngineConfig.load_quantization``: "auto" pinned: none)."""
    from .engine.config import EngineConfig

    asked = getattr(args, "quantization", "auto")
    settings = engine_settings(args, model=args.model, quantization=asked)
    return EngineConfig.from_settings(**settings).load_quantization


def demo(args) -> int:
    """The story's three prompts through the engine: token ids, each scheduler step and its blocks, completions."""
    from .engine.llm_engine import LLMEngine
    from .engine.sampling_params import SamplingParams
    from .figures.schedule import format_steps

    if args.max_tokens < 1:
        raise InvalidRequestError("--max-tokens must be at least 1", param="max_tokens")
    model, tokenizer = _load(args, say_dtype_reason=False)  # the engine's start-up log says it
    engine = LLMEngine(model, **engine_settings(args, tokenizer=tokenizer, num_kv_blocks=64, log_stats=False))
    print("\n1. tokenization: text becomes integers")
    for text in STORY_PROMPTS:
        ids = tokenizer.encode(text)
        print(f"   {text!r:36} -> {len(ids)} tokens {ids}")
        print(f"   {'':36}    {tokenizer.convert_ids_to_tokens(ids)}")
    print("\n2. the engine: a pool of KV blocks, shared out by the scheduler")
    for line in engine.startup_log[1:]:
        print(f"   {line}")
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)  # greedy; a request ends at EOS
    for i, text in enumerate(STORY_PROMPTS):
        engine.add_request(f"prompt-{i}", text, params)
    print(
        f"\n3. the scheduler, step by step (greedy, up to {args.max_tokens} new tokens each); steps where nothing but "
        "one decode token per request happens are folded"
    )
    started = time.perf_counter()
    finished = {out.request_id: out for out in engine.run_until_done()}
    elapsed = time.perf_counter() - started
    print("   " + format_steps(engine.step_records, fold_quiet=True).replace("\n", "\n   "))
    print("\n4. completions")
    for i, text in enumerate(STORY_PROMPTS):
        out = finished[f"prompt-{i}"].outputs[0]
        print(f"   {text!r} -> {out.text!r} ({out.finish_reason})")
        print(f"   {'':{len(repr(text))}}    new ids {out.token_ids}")
    blocks = engine.block_manager
    total = sum(len(o.outputs[0].token_ids) for o in finished.values())
    print(
        f"\n   {total} tokens in {engine.scheduler.num_steps} steps, {elapsed:.2f} s; "
        f"every block back in the pool: {blocks.num_free_blocks} of {blocks.num_blocks} free"
    )
    return 0


def generate(args) -> int:
    """Complete one prompt through the engine (greedy unless --temperature > 0) and print the text."""
    from .engine.llm import LLM
    from .engine.sampling_params import SamplingParams

    if args.max_tokens < 1:
        raise InvalidRequestError("--max-tokens must be at least 1", param="max_tokens")
    params = SamplingParams(temperature=args.temperature, seed=args.seed, max_tokens=args.max_tokens)
    model, tokenizer = _load(args)
    llm = LLM(model, **engine_settings(args, tokenizer=tokenizer, log_stats=False))
    print(args.prompt + llm.generate(args.prompt, params, use_tqdm=False)[0].outputs[0].text)
    return 0


# The flags that set engine settings (``EngineConfig``'s names); a flag left unset keeps the setting's default.
ENGINE_FLAGS = (
    "dtype device cpu_tuning block_activations big_step_weights kv_cache_dtype block_size max_num_seqs "
    "max_num_batched_tokens num_kv_blocks max_waiting long_prefill_token_threshold speculative_config "
    "tensor_parallel_size pipeline_parallel_size pipeline_overlap distributed_executor_backend async_scheduling"
).split()


def engine_settings(args, **fixed) -> dict:
    """The engine settings the command line set, with ``fixed`` ones on top."""
    return {name: getattr(args, name) for name in ENGINE_FLAGS if getattr(args, name, None) is not None} | fixed


def _engine_for_serving(args):
    """An ``LLMEngine`` from the serve flags."""
    from .engine.llm_engine import LLMEngine

    return LLMEngine(args.model, **engine_settings(args, quantization=getattr(args, "quantization", "auto")))


def serve(args) -> int:
    """Load the model, build the engine, serve it over HTTP until Ctrl-C."""
    from .serving.auth import api_key_from
    from .serving.limits import ServerLimits
    from .serving.server import ServerConfig
    from .serving.server import serve as run_server

    limits = (
        ServerLimits() if args.max_request_bytes is None else ServerLimits(max_request_bytes=args.max_request_bytes)
    )
    config = ServerConfig(
        api_key=api_key_from(args.api_key),
        enable_docs=args.enable_docs,
        allowed_origins=args.allowed_origins,
        limits=limits,
        shutdown_timeout=args.shutdown_timeout,
    )
    engine = _engine_for_serving(args)
    name = args.served_model_name or args.model
    print(f"serving {name!r} on http://{args.host}:{args.port}/v1 (Ctrl-C or SIGTERM stops)")
    run_server(engine, host=args.host, port=args.port, model_name=name, config=config)
    return 0


def loadtest(args) -> int:
    """Run a load test against an OpenAI-compatible endpoint; print the summary, optionally write JSON."""
    import os

    from .loadtest.client import LoadTestConfig, parse_length, run_loadtest

    arrival = "poisson" if args.rate is not None else "closed_loop" if args.clients is not None else "all_at_once"
    config = LoadTestConfig(
        url=args.url,
        model=args.model,
        endpoint=args.endpoint,
        arrival=arrival,
        num_requests=args.num_requests,
        rate=args.rate,
        num_clients=args.clients,
        prompt_len=parse_length(args.prompt_len),
        output_len=parse_length(args.output_len),
        prompt_kind=args.prompt_kind or ("text" if args.endpoint == "chat" else "ids"),
        temperature=args.temperature,
        ignore_eos=not args.no_ignore_eos,
        seed=args.seed,
        max_duration=args.max_duration,
        request_timeout=args.request_timeout,
        api_key=args.api_key or os.environ.get("OPENAI_API_KEY"),
    )
    result = run_loadtest(config)
    if args.json == "-":
        print(result.to_json())
        return 0
    print(result.format())
    if args.json:
        with open(args.json, "w") as f:
            f.write(result.to_json())
        print(f"wrote {args.json}")
    return 0 if result.summary["completed"] else 1

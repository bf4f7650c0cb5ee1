"""``python -m lifeofprompt``: the life of a prompt from the command line.

python -m lifeofprompt demo                          the story's three prompts, end to end
python -m lifeofprompt generate "hi my name is" --max-tokens 32
python -m lifeofprompt serve --model smollm2-135m    an OpenAI-compatible server on 127.0.0.1
python -m lifeofprompt loadtest --url http://127.0.0.1:8000/v1 ...
"""

from __future__ import annotations

import argparse
import sys

from .engine.config import BIG_STEP_WEIGHTS, BLOCK_ACTIVATIONS, CPU_TUNINGS, EngineConfig
from .errors import LifeOfPromptError
from .model.kv_cache_formats import KV_CACHE_DTYPES
from .model.loader import DEFAULT_MODEL, MODEL_NAMES


def _model_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"a model name ({', '.join(MODEL_NAMES)}) or a local Hugging Face Llama folder "
        f"(default: {DEFAULT_MODEL}, embedded, works offline)",
    )
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when a GPU is present)")
    parser.add_argument(
        "--dtype",
        default=None,
        help="auto, float32, bfloat16 or float16 (default auto: bfloat16 on a GPU; on a CPU bfloat16 only where it "
        "computes bf16 natively and bf16 products measured faster there, else float32)",
    )
    parser.add_argument(
        "--quantization",
        default="auto",
        type=lambda v: None if v == "none" else v,
        help="none (floats), gguf (the embedded model's own Q4_1/Q8_0 blocks), q8_0 or q4_1 (a float checkpoint "
        "quantized at load); default auto: the GGUF's blocks where they measured faster on this CPU, else none",
    )
    parser.add_argument(
        "--cpu-tuning",
        default=None,
        dest="cpu_tuning",
        help="the CPU's speed-ups: auto (each timed at start-up, cached), off, or one path pinned: "
        f"{', '.join(CPU_TUNINGS[2:])} (default: auto, or $LIFEOFPROMPT_CPU_TUNING)",
    )
    parser.add_argument(
        "--block-activations",
        default=None,
        dest="block_activations",
        choices=BLOCK_ACTIVATIONS,
        help="how a CPU multiplies GGUF blocks: integer (the rows as two int8 digits, integer dot products), "
        "float, or auto (default: integer where timed faster here; float with a pinned --cpu-tuning)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        default=None,
        dest="kv_cache_dtype",
        choices=KV_CACHE_DTYPES,
        help="how the KV pool stores keys and values: auto (the activations' dtype), bfloat16, float16, q8_0 "
        "(int8 with an fp16 scale per 32 values) or fp8 (e4m3, a scale per layer from the shipped text)",
    )
    parser.add_argument(
        "--big-step-weights",
        default=None,
        dest="big_step_weights",
        choices=BIG_STEP_WEIGHTS,
        help="what a CPU's prompt chunks and large batches multiply GGUF blocks by: a bfloat16 or float32 copy of "
        "the layer matrices, the blocks, or auto (default: a copy where timed faster here and a quarter of the "
        "free memory holds it; the blocks with a pinned --cpu-tuning)",
    )


def _json_object(text: str) -> dict:
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError('a JSON object is wanted, like {"method": "ngram", ...}')
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m lifeofprompt",
        description="Follow a prompt through an LLM inference engine built from scratch: "
        "tokenizer, model, KV cache, paged blocks, scheduler.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Start with 'demo'. Every command runs offline on the embedded SmolLM2-135M-Instruct.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    demo = sub.add_parser("demo", help="the life of the story's three prompts: token ids, schedule, completions")
    _model_arg(demo)
    demo.add_argument("--max-tokens", type=int, default=24, help="new tokens per prompt (default: 24)")

    gen = sub.add_parser("generate", help="complete one prompt greedily")
    gen.add_argument("prompt", help="the text to complete")
    gen.add_argument("--max-tokens", type=int, default=32, help="new tokens to generate (default: 32)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--seed", type=int, default=None, help="seed for sampling when temperature > 0")
    _model_arg(gen)

    serve = sub.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server (loopback by default)",
        description="Serve /v1/completions, /v1/chat/completions, /v1/models, /tokenize, "
        "/detokenize, /health and /metrics (Prometheus) on one engine thread. "
        "Ctrl-C or SIGTERM stops it.",
    )
    _model_arg(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    serve.add_argument("--port", type=int, default=8000, help="TCP port (default: 8000)")
    serve.add_argument("--served-model-name", default=None, help="the name clients pass as 'model' (default: --model)")
    serve.add_argument("--max-num-seqs", type=int, default=None, help="requests decoded side by side at most")
    serve.add_argument("--max-num-batched-tokens", type=int, default=None, help="tokens per step (the shared budget)")
    serve.add_argument("--num-kv-blocks", type=int, default=None, help="KV cache blocks (default: sized from memory)")
    serve.add_argument(
        "--block-size", type=int, default=None, help=f"tokens per KV block (default: {EngineConfig.block_size})"
    )
    serve.add_argument(
        "--max-waiting",
        type=int,
        default=None,
        help="waiting-queue bound: beyond max-num-seqs running and this many waiting, requests get "
        "HTTP 503 with Retry-After (default: 4 x max-num-seqs)",
    )
    serve.add_argument(
        "--long-prefill-token-threshold",
        type=int,
        default=None,
        help="fair chunked prefill: while other requests wait or run, one prompt's chunk takes at "
        "most this many of a step's tokens (default: max-num-batched-tokens / 4; 0 turns it off)",
    )
    serve.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1/* (default: $LIFEOFPROMPT_API_KEY, else "
        "no key); /health and /metrics stay open",
    )
    serve.add_argument(
        "--max-request-bytes",
        type=int,
        default=None,
        help="request bodies larger than this get HTTP 413 before parsing (default: 4 MiB)",
    )
    serve.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM: queued requests are aborted at once, running ones get this many seconds "
        "to finish, then are aborted (finish_reason 'abort') (default: 30)",
    )
    serve.add_argument(
        "--enable-docs", action="store_true", help="serve /docs, /redoc and /openapi.json (default: off)"
    )
    serve.add_argument(
        "--allowed-origins",
        nargs="+",
        default=None,
        metavar="ORIGIN",
        help="turn CORS on for these browser origins (default: off)",
    )
    serve.add_argument(
        "--speculative-config",
        type=_json_object,
        default=None,
        dest="speculative_config",
        help='speculative decoding, as JSON (vLLM\'s), e.g. \'{"method": "ngram", '
        '"num_speculative_tokens": 4}\' or \'{"model": "smollm2-135m", "num_speculative_tokens": 3}\'',
    )
    serve.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=None,
        help="split each layer over this many processes (torch.distributed; SmolLM2: 1 or 3)",
    )
    serve.add_argument(
        "--pipeline-parallel-size",
        type=int,
        default=None,
        help="split the layers into this many stages, each on its own processes",
    )
    serve.add_argument(
        "--distributed-executor-backend",
        default=None,
        metavar="{uni,mp}",
        help="'uni': one process; 'mp': the process group even at tensor x pipeline size 1 (a world "
        "of one rank, to measure its cost) (default: one process unless the model is split)",
    )
    serve.add_argument(
        "--no-pipeline-overlap",
        action="store_const",
        const=False,
        default=None,
        dest="pipeline_overlap",
        help="with several stages, run one step at a time (default: up to one step per stage in flight)",
    )
    serve.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="schedule the next step while this one runs (default: on a GPU where it can, off on a CPU)",
    )

    load = sub.add_parser(
        "loadtest",
        help="load-test any OpenAI-compatible endpoint with random arrivals",
        description="Send streaming requests at Poisson times (--rate), from a closed loop of "
        "clients (--clients) or all at once (neither), and report time to first "
        "token, time per output token and end-to-end latency (p50/p90/p99).",
        epilog="example: python -m lifeofprompt loadtest --rate 2 --num-requests 40 --json out.json",
    )
    load.add_argument("--url", default="http://127.0.0.1:8000/v1", help="the OpenAI base URL (default: %(default)s)")
    load.add_argument("--model", default=None, help="model name to request (default: the first one /v1/models lists)")
    load.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    how = load.add_mutually_exclusive_group()
    how.add_argument("--rate", type=float, default=None, help="Poisson arrivals at this many requests per second")
    how.add_argument("--clients", type=int, default=None, help="a closed loop of this many clients")
    load.add_argument("--num-requests", type=int, default=50, help="requests to send (default: 50)")
    load.add_argument(
        "--prompt-len", default="32", help="prompt tokens: N, or LOW:HIGH sampled uniformly (default: 32)"
    )
    load.add_argument("--output-len", default="16", help="output tokens (max_tokens): N or LOW:HIGH (default: 16)")
    load.add_argument(
        "--prompt-kind",
        choices=("ids", "text"),
        default=None,
        help="random token ids (exact lengths; default for completions) or random words (default for chat)",
    )
    load.add_argument("--temperature", type=float, default=0.0)
    load.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos (servers that reject it)")
    load.add_argument("--seed", type=int, default=0, help="seeds arrivals, lengths and prompts (default: 0)")
    load.add_argument(
        "--max-duration",
        type=float,
        default=120.0,
        help="seconds after which nothing new is sent and requests in flight are cancelled (default: 120)",
    )
    load.add_argument("--request-timeout", type=float, default=120.0, help="seconds per request (default: 120)")
    load.add_argument(
        "--json", default=None, metavar="PATH", help="write every request and the summary as JSON ('-': stdout)"
    )
    load.add_argument("--api-key", default=None, help="bearer token (default: $OPENAI_API_KEY if set)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    if any(arg.split("=")[0] == "--cpu-linear" for arg in (sys.argv[1:] if argv is None else argv)):
        print("error: --cpu-linear is now --cpu-tuning", file=sys.stderr)  # a name never released: its new one
        return 2
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        from . import commands

        return getattr(commands, args.command)(args) or 0
    except LifeOfPromptError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

"""``python -m lifeofprompt``: the life of a prompt from the command line.

    python -m lifeofprompt demo                          the story's three prompts, end to end
    python -m lifeofprompt generate "hi my name is" --max-tokens 32
    python -m lifeofprompt serve --model smollm2-135m    an OpenAI-compatible server on 127.0.0.1
    python -m lifeofprompt loadtest --url http://127.0.0.1:8000/v1 ...
"""

from __future__ import annotations

import argparse
import sys

from .errors import LifeOfPromptError
from .loader import DEFAULT_MODEL, MODEL_NAMES

STORY_PROMPTS = ["hi my name is", "today is a beautiful summer day", "hello there"]


def _model_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help=f"a model name ({', '.join(MODEL_NAMES)}) or a local Hugging Face Llama folder "
                             f"(default: {DEFAULT_MODEL}, embedded, works offline)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when a GPU is present)")
    parser.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: bfloat16 on GPU, float32 on CPU)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m lifeofprompt",
        description="Follow a prompt through an LLM inference engine built from scratch: "
                    "tokenizer, model, KV cache, paged blocks, scheduler.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Start with 'demo'. Every command runs offline on the embedded SmolLM2-135M-Instruct.")
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

    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (loopback by default)")
    _model_arg(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)

    load = sub.add_parser("loadtest", help="load-test any OpenAI-compatible endpoint with random arrivals")
    load.add_argument("--url", default="http://127.0.0.1:8000/v1")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
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

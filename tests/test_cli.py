"""``python -m lifeofprompt`` as a newcomer runs it, in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run(*args, timeout=600):
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    return subprocess.run(
        [sys.executable, "-m", "lifeofprompt", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env=env,
    )


def test_help_lists_the_commands():
    out = run("--help")
    assert out.returncode == 0
    for word in ("demo", "generate", "serve", "loadtest"):
        assert word in out.stdout


def test_serve_help_lists_every_route(capsys):
    from lifeofprompt.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = capsys.readouterr().out
    for route in (
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/models",
        "/tokenize",
        "/detokenize",
        "/health",
        "/metrics",
    ):
        assert route in text, route


@pytest.mark.slow
@pytest.mark.numerics
def test_demo_prints_the_story_token_ids_and_completions():
    out = run("demo", "--max-tokens", "4", "--dtype", "float32")  # the default dtype is chosen per CPU
    assert out.returncode == 0, out.stderr[-2000:]
    for ids in ("[6004, 957, 1462, 314]", "[28195, 314, 253, 3953, 4018, 1194]", "[28120, 665]"):
        assert ids in out.stdout
    assert "4 tokens" in out.stdout and "6 tokens" in out.stdout and "2 tokens" in out.stdout
    assert "new ids [2026, 365, 10905, 6176]" in out.stdout  # greedy, fp32 on the CPU
    assert "RANDOM" not in out.stdout and "random weights" not in out.stdout


def in_process(capsys, *args):
    """``main(args)`` as the console script calls it: ``(exit code, stdout, stderr)``, argparse's exits included.
    The subprocess tests above and below start the real command; argument errors need no new interpreter."""
    from lifeofprompt.cli import main

    try:
        code = main(list(args))
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_generate_rejects_a_bad_max_tokens(capsys):
    code, _, err = in_process(capsys, "generate", "hi my name is", "--max-tokens", "0")
    assert code == 2 and "--max-tokens must be at least 1" in err
    code, _, err = in_process(capsys, "generate", "hi my name is", "--max-tokens", "lots")
    assert code == 2 and "invalid int value: 'lots'" in err


def test_the_old_cpu_linear_flag_says_its_new_name(capsys):
    code, _, err = in_process(capsys, "generate", "hi my name is", "--max-tokens", "0", "--cpu-linear", "linear")
    assert code == 2 and "error: --cpu-linear is now --cpu-tuning" in err
    code, _, err = in_process(capsys, "generate", "hi my name is", "--max-tokens", "0", "--cpu-tuning", "linear")
    assert code == 2 and "is now" not in err


@pytest.mark.slow
@pytest.mark.numerics
def test_generate_honours_temperature_and_seed(capsys):
    """Same seed, same sampled text; greedy gives its own, pinned continuation (decided: tests/test_pins.py)."""
    from lifeofprompt.cli import main

    runs = []
    fp32 = ["--dtype", "float32"]
    for argv in (
        ["generate", "hello there", "--max-tokens", "8", "--temperature", "0.8", "--seed", "3"] + fp32,
    ) * 2 + (["generate", "hello there", "--max-tokens", "8"] + fp32,):
        assert main(argv) == 0
        runs.append(capsys.readouterr().out.strip().splitlines()[-1])
    assert runs[0] == runs[1]
    assert runs[2] == "hello there's no need to do it."
    assert runs[0] != runs[2]


@pytest.mark.slow
def test_generate_on_the_gguf_blocks_says_so():
    out = run("generate", "hi my name is", "--max-tokens", "4", "--quantization", "gguf")
    assert out.returncode == 0, out.stderr
    assert "the GGUF's own blocks" in out.stdout


def test_the_quantization_flag_reads_as_the_engine_does():
    from lifeofprompt.cli import build_parser
    from lifeofprompt.commands import _quantization

    parse = build_parser().parse_args
    assert _quantization(parse(["generate", "hi", "--quantization", "none"])) is None
    assert _quantization(parse(["generate", "hi", "--quantization", "q4_1"])) == "q4_1"
    assert _quantization(parse(["generate", "hi", "--cpu-tuning", "linear"])) is None  # auto with a pinned path: floats
    assert _quantization(parse(["generate", "hi", "--cpu-tuning", "auto"])) == "auto"


@pytest.mark.parametrize(
    ("flag", "setting", "value", "wrong"),
    [
        ("--block-activations", "block_activations", "float", "int8"),
        ("--big-step-weights", "big_step_weights", "bfloat16", "fp16"),
    ],
)
def test_the_block_settings_flags_reach_the_engine_settings(flag, setting, value, wrong):
    from lifeofprompt.cli import build_parser
    from lifeofprompt.commands import engine_settings

    parse = build_parser().parse_args
    assert engine_settings(parse(["generate", "hi", flag, value]))[setting] == value
    assert setting not in engine_settings(parse(["generate", "hi"]))  # unset: the engine's default
    with pytest.raises(SystemExit):
        parse(["generate", "hi", flag, wrong])

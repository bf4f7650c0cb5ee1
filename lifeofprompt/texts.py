"""The texts the project ships: two evaluation texts written for it, so that no model has seen them in
training and anyone may ship them.

``evaluation_text``: ~350 words about a harbour town (~450 tokens), chapter 06's perplexity and the fp8 KV
cache's start-up calibration. ``long_evaluation_text``: ~4,900 tokens, a year in a river village, long
enough for a difference of a fraction of a percent to mean something (the accuracy rules).
"""

from __future__ import annotations

from pathlib import Path

DATA = Path(__file__).parent / "data"


def evaluation_text() -> str:
    return (DATA / "evaluation_text.txt").read_text()


def long_evaluation_text() -> str:
    return (DATA / "long_evaluation_text.txt").read_text()

"""The engine keeps a big step's freed memory for the next step (``cpu/allocator.py``).

What it buys is page faults: a 16 MiB tensor whose memory went back to the OS costs 4,096
first-touch faults to write; with the memory kept, making it again costs none.
"""

import resource
import sys

import pytest
import torch

from lifeofprompt.cpu import allocator

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")

MIB16 = 4 << 20  # float32 elements in 16 MiB


def step_like_round() -> None:
    """What a layer of a big prefill step does to the allocator: a few 16 MiB tensors made,
    written and freed together. Untuned glibc serves them from the heap once its threshold has
    grown, but returns the 48 MiB freed at the top of the heap to the OS each time (past its
    trim threshold of twice the largest freed block), so every round faults them in again."""
    tensors = [torch.empty(MIB16).fill_(1.0) for _ in range(3)]
    del tensors


def faults_of_step_like_rounds(rounds: int = 8) -> int:
    """Minor page faults of ``rounds`` step-like rounds, after three that may fault either way."""
    for _ in range(3):
        step_like_round()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(rounds):
        step_like_round()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_freed_step_memory_is_reused_without_page_faults():
    pages_per_tensor = MIB16 * 4 // 4096
    note = allocator.keep_freed_memory()
    if not note:
        pytest.skip("not glibc, or turned off")
    assert "kept" in note and allocator.keep_freed_memory() == note  # once per process
    # Untuned, this faulted 65,280 pages here (8 rounds x 3 tensors x 4,096 pages, less a few): every round
    # faults its three tensors in again. Kept, a round costs none; a busy machine may still take one tensor's
    # pages back once in a while (one 4,096-page refault was seen beside other processes), never every round.
    rounds = 8
    assert faults_of_step_like_rounds(rounds) < rounds * pages_per_tensor


def test_turned_off_by_the_environment(monkeypatch):
    monkeypatch.setattr(allocator, "_done", None)
    monkeypatch.setenv("LIFEOFPROMPT_KEEP_FREED_MEMORY", "0")
    assert allocator.keep_freed_memory() == ""


def test_the_cpu_engine_says_so_in_its_start_up_log(tiny_model):
    from lifeofprompt.engine.llm_engine import LLMEngine
    from lifeofprompt.engine.startup_log import startup_lines

    model, tokenizer = tiny_model
    engine = LLMEngine(model, tokenizer=tokenizer, num_kv_blocks=16, max_num_seqs=2, log_stats=False)
    note = allocator.keep_freed_memory()
    assert (note in engine.runner.speedups.placement) == bool(note)
    assert (note in startup_lines(engine)) == bool(note)

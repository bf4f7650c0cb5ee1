"""The chapters' toys, run against the package outside the notebooks, so a drift between a toy and the code it
teaches fails here even though the notebooks run separately (nbval).

Chapters 01, 04, 08, 11, 14 and 15 each write the core of their mechanism in a small visible cell (a toy) and check
it against the package or the real thing. The cells are found by a marker line (``# toy: ...``, ``# check: ...``)
and run in one namespace, in order, exactly as the notebook holds them. Each check must be able to fail: the
``broken`` tests change one rule of a toy and expect its check to fail.
"""

from __future__ import annotations

import importlib.util
import json
import random
import re
from pathlib import Path

import pytest

if importlib.util.find_spec("triton") is not None:
    # Before anything imports triton (transformers may): on a CPU this picks Triton's interpreter for 11's check.
    import lifeofprompt.kernels  # noqa: F401

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"

SCHEDULER = ("08_scheduler.ipynb", "# toy: scheduler step", "# toy: scheduler loop", "# check: scheduler step")
SPECULATION = (
    "14_speculative_decoding.ipynb",
    "# toy: speculative accept/reject/rollback",
    "# check: speculative accept/reject/rollback",
)
RING = ("15_many_devices.ipynb", "# toy: ring all-reduce", "# check: ring all-reduce")
PIPELINE = ("15_many_devices.ipynb", "# toy: pipeline loop", "# check: pipeline loop")


def cell_sources(notebook: str, *markers: str) -> list[str]:
    """The code cells holding each marker line, in the order asked."""
    cells = json.loads((NOTEBOOKS / notebook).read_text())["cells"]
    found = []
    for marker in markers:
        hits = [
            "".join(c["source"])
            for c in cells
            if c["cell_type"] == "code" and marker in (line.strip() for line in "".join(c["source"]).splitlines())
        ]
        assert len(hits) == 1, f"{notebook}: {len(hits)} code cells marked {marker!r} (want one)"
        found.append(hits[0])
    return found


def run_cells(sources: list[str], name: str, **names) -> dict:
    """Run the cells in one namespace, in order, as the notebook does; ``names`` stand for earlier cells' variables."""
    namespace: dict = {"__name__": name, **names}
    for i, source in enumerate(sources):
        exec(compile(source, f"<{name} cell {i}>", "exec"), namespace)
    return namespace


def broken(sources: list[str], old: str, new: str) -> list[str]:
    """The cells with one rule of the toy changed (``old`` must be in exactly one of them)."""
    assert sum(s.count(old) for s in sources) == 1, f"the toy no longer holds {old!r}: update this test's change"
    return [s.replace(old, new) for s in sources]


# ----------------------------------------------------------------------------- 01: the BPE merge loop
BPE = ("01_tokenization.ipynb", "# toy: bpe merge loop")


def merge_loop_agrees(sources, tokenizer, words) -> bool:
    namespace = run_cells(sources, "bpe", tokenizer=tokenizer)
    merge_loop, ranks, symbols = namespace["merge_loop"], namespace["ranks"], namespace["bytes_as_symbols"]
    return all(merge_loop(symbols(w), ranks) == tokenizer.convert_ids_to_tokens(tokenizer.encode(w)) for w in words)


def random_words(count: int, seed: int = 0) -> list[str]:
    """Single pre-tokenizer pieces: a space and lowercase letters, so the merge loop alone decides."""
    rng = random.Random(seed)
    return [
        " " + "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 12))) for _ in range(count)
    ]


def test_the_bpe_toy_tokenizes_random_words_as_the_tokenizer_does(smollm2):
    _, tokenizer = smollm2
    assert merge_loop_agrees(cell_sources(*BPE), tokenizer, random_words(300))


def test_the_bpe_toy_differs_when_it_merges_the_latest_learned_pair_first(smollm2):
    _, tokenizer = smollm2
    assert not merge_loop_agrees(broken(cell_sources(*BPE), "min(ranked)", "max(ranked)"), tokenizer, random_words(300))


# ----------------------------------------------------------------------------- 04: a KV cache
KV_CACHE = ("04_kv_cache.ipynb", "# toy: kv cache")


def cached_equals_recomputed(sources) -> bool:
    import torch

    namespace = run_cells(sources, "kv_cache", torch=torch)
    return all(torch.allclose(a, b, atol=1e-5) for a, b in zip(namespace["naive"], namespace["cached_toy"]))


def test_the_kv_cache_toy_gives_what_recomputing_gives():
    assert cached_equals_recomputed(cell_sources(*KV_CACHE))


def test_the_kv_cache_toy_differs_when_the_cache_holds_the_wrong_rows():
    sources = broken(
        cell_sources(*KV_CACHE), "torch.cat([K_cache, (x @ W_k)[None]])", "torch.cat([K_cache, (x @ W_q)[None]])"
    )
    assert not cached_equals_recomputed(sources)


# ----------------------------------------------------------------------------- 11: the kernel's tiled loop
TILED = ("11_kernels_and_graphs.ipynb", "# toy: tiled paged attention", "# check: tiled paged attention")


def tiled_toy_matches_the_reference(sources, seed: int) -> bool:
    """The toy, through the chapter's own check cell, on a random mixed batch (GQA, shuffled tables, prompt rows)
    against the torch reference, with tiles of 1, 4 and 16 keys."""
    import functools

    import torch

    from lifeofprompt.lessons.paged_cases import make_case
    from lifeofprompt.model.paged_attention import paged_attention

    toy, check = sources
    rng = random.Random(seed)
    query_lens = [rng.choice([1, rng.randint(2, 9)]) for _ in range(3)]
    case = make_case(
        query_lens, [rng.randint(0, 40) for _ in range(3)], 4, num_heads=6, num_kv_heads=2, head_dim=8, seed=seed
    )
    expected = paged_attention(*case.attention_args())
    agree = []
    for tile in (1, 4, 16):
        namespace = run_cells([toy], "tiled", torch=torch)
        namespace["toy_tiled_attention"] = functools.partial(namespace["toy_tiled_attention"], tile=tile)
        namespace = run_cells([check], "tiled", **namespace, case=case, ours=expected)  # the check's rows, per head
        agree.append(torch.allclose(torch.stack(namespace["rows"]), expected, atol=1e-5))
    return all(agree)


@pytest.mark.parametrize("seed", range(5))
def test_the_tiled_toy_gives_the_references_attention(seed):
    assert tiled_toy_matches_the_reference(cell_sources(*TILED), seed)


def test_the_tiled_toy_differs_when_it_forgets_to_rescale():
    sources = broken(cell_sources(*TILED), "acc * shrink + weights @ v", "acc + weights @ v")
    assert not all(tiled_toy_matches_the_reference(sources, seed) for seed in range(5))


# ----------------------------------------------------------------------------- 07: a scheduler step


def test_the_scheduler_toy_takes_the_packages_steps():
    ns = run_cells(cell_sources(*SCHEDULER), "scheduler")
    steps = ns["toy_run"](ns["REQUESTS"], num_blocks=5)
    # what the Markdown before the toy tells the reader to find in its output
    assert ("C", 3) in steps[0][0] and ("C", 6) in steps[1][0]  # C's prompt in two chunks
    assert [name for name, _ in steps[2][0]] == ["A", "C", "D"]  # three seats: E waits
    assert steps[3][1] == ["D"] and ("D", 4) in steps[4][0]  # D preempted, then recomputes its 4 tokens


def test_the_scheduler_toy_agrees_on_random_requests_and_limits():
    ns = run_cells(cell_sources(*SCHEDULER), "scheduler")
    rng = random.Random(0)
    for _ in range(40):
        ns["BLOCK_SIZE"], ns["BUDGET"], ns["MAX_NUM_SEQS"] = rng.choice([2, 4]), rng.randint(4, 16), rng.randint(1, 4)
        num_blocks = rng.randint(3, 10)
        limit = num_blocks * ns["BLOCK_SIZE"]
        requests = []
        for i in range(rng.randint(1, 6)):
            prompt = rng.randint(1, limit - 2)
            requests.append((f"r{i}", prompt, rng.randint(1, limit - prompt)))
        assert ns["toy_run"](requests, num_blocks) == ns["package_run"](requests, num_blocks), requests


@pytest.mark.parametrize(
    "old, new",
    [
        ("victim = running.pop()", "victim = running.pop(0)"),  # preempt the oldest instead of the newest
        ("while not preempted and waiting", "while waiting"),  # admit even in a step that preempted
        ('n = min(r["tokens"], budget)', 'n = r["tokens"]'),  # admit a whole prompt past the budget
    ],
    ids=["oldest-preempted", "admits-after-preemption", "no-chunks"],
)
def test_the_scheduler_check_fails_on_a_broken_toy(old, new):
    with pytest.raises(AssertionError):
        run_cells(broken(cell_sources(*SCHEDULER), old, new), "scheduler")


# ----------------------------------------------------------------------------- 10: speculative accept/reject


def test_the_speculation_toy_gives_the_rejection_samplers_tokens(capsys):
    run_cells(cell_sources(*SPECULATION), "speculation")
    printed = capsys.readouterr().out
    # what the Markdown before the toy tells the reader to find: all four kept plus a bonus, and none kept
    assert "4 of 4 accepted" in printed and re.search(r"kept \[\d+\]: 0 of [1-9]", printed), printed


@pytest.mark.parametrize(
    "old, new",
    [
        ("min(1.0, p[i, x] / q[i, x])", "min(1.0, p[i, x])"),  # accept with p(x), ignoring the drafter
        ("(p[i] - q[i]).clamp(min=0)", "p[i]"),  # correct from p instead of the residual
    ],
    ids=["acceptance-without-q", "correction-from-p"],
)
def test_the_speculation_check_fails_on_a_broken_toy(old, new):
    with pytest.raises(AssertionError):
        run_cells(broken(cell_sources(*SPECULATION), old, new), "speculation")


# ----------------------------------------------------------------------------- 11: ring all-reduce, pipeline


def test_the_ring_toy_sums_like_np_sum():
    ns = run_cells(cell_sources(*RING), "ring")
    assert ns["hops"] == 6


def test_the_ring_check_fails_on_a_broken_toy():
    old = "chunks[(r + 1) % N][(r - h) % N] += messages[r]"
    with pytest.raises(AssertionError):  # the receiver overwrites instead of adding
        run_cells(broken(cell_sources(*RING), old, old.replace("+=", "=")), "ring")


def test_the_pipeline_toy_follows_pipeline_schedule():
    ns = run_cells(cell_sources(*PIPELINE), "pipeline")
    assert ns["tick"] == ns["M"] + ns["P"] - 1


def test_the_pipeline_check_fails_on_a_broken_toy():
    with pytest.raises(AssertionError):  # micro-batches enter the pipe last first
        run_cells(broken(cell_sources(*PIPELINE), "queue.pop(0)", "queue.pop()"), "pipeline")

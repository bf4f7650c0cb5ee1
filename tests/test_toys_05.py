"""Chapter 05's toys, run against the package outside the notebook (as tests/test_notebook_toys.py does for 07, 10
and 11): the bytes one token leaves in the cache, the land worked by hand, and the decode floor and arithmetic
intensity counted by hand. Each toy and its check are read from the notebook by their marker lines and run in one
namespace, in order; the ``broken`` tests change one rule of a toy and expect its check to fail.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from test_notebook_toys import broken
from test_notebook_toys import cell_sources as notebook_cells
from test_notebook_toys import run_cells as run_notebook_cells

from lifeofprompt.engine.memory import kv_bytes_per_token
from lifeofprompt.lessons.memory_arithmetic import LLAMA_3_1_8B
from lifeofprompt.lessons.story_model import SMOLLM2_135M
from lifeofprompt.model.config import TINYLLAMA_1_1B

NOTEBOOK = "05_memory_and_roofline.ipynb"

KV = ("# toy: KV bytes per token", "# check: KV bytes per token")
LAND = ("# toy: the land by hand", "# check: the land by hand")
ROOFLINE = ("# toy: decode floor and intensity", "# check: decode floor and intensity")

# The machine profile the roofline toy reads: fixed numbers, so the test measures nothing.
PROFILE = SimpleNamespace(name="test machine", read_bandwidth=30e9, matmul_flops=80e9)


def cell_sources(*markers: str) -> list[str]:
    return notebook_cells(NOTEBOOK, *markers)


def run_cells(sources: list[str]) -> dict:
    return run_notebook_cells(sources, "toys05", torch=torch, dataclasses=dataclasses, profile=PROFILE)


# ----------------------------------------------------------------------------- bytes per token


def test_the_kv_toy_agrees_with_the_package_on_any_shape_and_dtype():
    ns = run_cells(cell_sources(*KV))
    assert ns["toy_bytes"] == 22_528  # what the Markdown says TinyLlama costs
    for base in (TINYLLAMA_1_1B, SMOLLM2_135M, LLAMA_3_1_8B):
        for kv_heads in (1, 2, base.num_kv_heads, base.num_heads):
            config = dataclasses.replace(base, num_kv_heads=kv_heads)
            for dtype in (torch.bfloat16, torch.float32, torch.float16):
                toy = sum(k.nbytes + v.nbytes for k, v in ns["one_token_cache"](config, dtype))
                assert toy == kv_bytes_per_token(config, dtype)


@pytest.mark.parametrize(
    "old, new",
    [
        ("for _ in range(config.num_layers)]", "for _ in range(config.num_layers - 1)]"),  # a layer forgotten
        ("dtype=dtype))  # value", "dtype=dtype)[:1])  # value"),  # values for one head only
    ],
)
def test_the_kv_check_fails_on_a_broken_toy(old, new):
    with pytest.raises(AssertionError):
        run_cells(broken(cell_sources(*KV), old, new))


# ----------------------------------------------------------------------------- the land


def test_the_land_toy_finds_the_packages_blocks():
    ns = run_cells(cell_sources(KV[0], *LAND))
    assert (ns["gpu_blocks"], ns["requests"]) == (36_387, 142)  # the figures the chapter quotes


@pytest.mark.parametrize(
    "old, new",
    [
        ("usable = int(total * 0.9)", "usable = int(total * 0.92)"),  # another utilization than plan_memory's
        ("kv_pool = usable - weights - activations", "kv_pool = usable - weights"),  # the workspace forgotten
        ("per_block = 16 * toy_bytes", "per_block = 32 * toy_bytes"),  # blocks of another size
    ],
)
def test_the_land_check_fails_on_a_broken_toy(old, new):
    with pytest.raises(AssertionError):
        run_cells(broken(cell_sources(KV[0], *LAND), old, new))


# ----------------------------------------------------------------------------- the roofline


def test_the_roofline_toy_agrees_with_the_package():
    ns = run_cells(cell_sources(KV[0], *ROOFLINE))
    assert ns["floor_s"] == pytest.approx(4 * SMOLLM2_135M.num_parameters() / PROFILE.read_bandwidth)
    assert ns["decode_intensity"] == pytest.approx(0.5)  # two operations per four-byte weight
    assert 40 < ns["prefill_intensity"] < 64  # about a hundred times decode's


@pytest.mark.parametrize(
    "old, new",
    [
        ("weight_bytes = 4 * params", "weight_bytes = 2 * params"),  # bf16 bytes for fp32 weights
        ("return 2 * (params - table) * rows + 2 * table", "return 2 * params * rows"),  # LM head on every row
        ("return 2 * (params - table) * rows + 2 * table", "return (params - table) * rows + table"),  # one op a weight
    ],
)
def test_the_roofline_check_fails_on_a_broken_toy(old, new):
    with pytest.raises(AssertionError):
        run_cells(broken(cell_sources(KV[0], *ROOFLINE), old, new))

"""Shared fixtures: the embedded model and its transformers reference, loaded once per session."""

from __future__ import annotations

import os

# Tests pin one CPU matrix-product path, so their tokens never depend on a start-up timing
# (lifeofprompt/cpu/linear_calibration.py); scripts/portability.sh runs them with each path forced.
os.environ.setdefault("LIFEOFPROMPT_CPU_TUNING", "linear")
# Under pytest-xdist (scripts/test.sh runs two workers) the workers share the cores: each worker, and what it starts
# (notebook kernels, subprocesses), takes its share of torch's threads instead of all of them.
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // WORKERS)))

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import settings  # noqa: E402

from lifeofprompt.story import STORY_PROMPTS  # noqa: E402

if WORKERS > 1:
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # in case a plugin imported torch first

settings.register_profile("long", max_examples=1000)  # tests/hypothesis_counts.py: each property's count × 10

# Triton's mode is fixed when it is first imported, and transformers can import it (through the kernel hub
# package) before any test reaches lifeofprompt.kernels: fix it first, as lifeofprompt.kernels would.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


SHARED_MODELS = []  # the session's models, which many tests run


@pytest.fixture(scope="session")
def smollm2():
    """``(model, tokenizer)`` for the embedded SmolLM2-135M-Instruct, fp32 on the CPU."""
    from lifeofprompt import load_model

    torch.set_num_threads(max(1, torch.get_num_threads()))
    model, tokenizer = load_model("smollm2-135m", dtype=torch.float32, device="cpu")
    SHARED_MODELS.append(model)
    return model, tokenizer


@pytest.fixture(autouse=True)
def the_shared_models_run_their_torch_layers():
    """A runner started on a shared model gives it the C step it chose (``model.cpu_step``); the next test
    gets the model back with its torch layers, as loaded, whatever the last one started on it."""
    yield
    for model in SHARED_MODELS:
        model.cpu_step = None


@pytest.fixture(scope="session")
def smollm2_reference():
    """transformers' LlamaForCausalLM on the same weights."""
    from lifeofprompt.lessons.reference import load_reference

    return load_reference("smollm2-135m", dtype=torch.float32, device="cpu")


@pytest.fixture(scope="session")
def story_ids(smollm2):
    _, tokenizer = smollm2
    return [tokenizer.encode(p) for p in STORY_PROMPTS]


@pytest.fixture(scope="module")
def one_thread():
    """Small forwards: one torch thread is faster than two fighting over a shared 2-core machine.

    ``LIFEOFPROMPT_TEST_THREADS`` asks for another count (scripts/portability.sh runs the
    numerics tests at 1 and 2 threads, since the thread count changes how BLAS splits a product).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(int(os.environ.get("LIFEOFPROMPT_TEST_THREADS", "1")))
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def poison_allocations(monkeypatch):
    """Every tensor a kernel wrapper gets from ``torch.empty``/``empty_like`` starts as NaN: unwritten outputs fail."""
    empty, empty_like = torch.empty, torch.empty_like

    def nan_filled(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: nan_filled(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: nan_filled(empty_like(*a, **k)))


def pytest_collection_modifyitems(config, items):
    """Browser tests run last: Playwright's sync API keeps an event loop running in the main thread
    until the session ends, and ``asyncio.run`` refuses to start beside it (the server and
    load-test tests use it)."""
    items.sort(key=lambda item: item.nodeid.startswith("tests/browser/"))


@pytest.fixture(scope="session")
def tiny_model():
    """``(model, tokenizer)``: see ``build_tiny_model``."""
    from tiny_models import build_tiny_model

    model, tokenizer = build_tiny_model()
    SHARED_MODELS.append(model)
    return model, tokenizer

"""One bad request never hurts another: a failure that belongs to one request ends that request
alone, with a typed error, and every other request of the batch finishes with the very tokens it
would have had without it (greedy and seeded alike).

The poisons are the ways a request has failed a whole step before: a seed that no generator
takes, a sampler that raises on one row (after the batch's seeded rows drew their noise), a
detokenizer that raises.
"""

from __future__ import annotations

import pytest
import torch

from lifeofprompt.engine import sampler as sampler_module
from lifeofprompt.engine.llm_engine import LLMEngine
from lifeofprompt.engine.sampler import Sampler
from lifeofprompt.engine.sampling_params import MAX_SEED, SamplingParams
from lifeofprompt.errors import InvalidRequestError, RequestFailedError

PROMPTS = {"greedy": "hello there", "seeded": "once upon a time", "also_seeded": "the cat sat", "victim": "poison me"}
PARAMS = {
    "greedy": SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
    "seeded": SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True),
    "also_seeded": SamplingParams(temperature=0.8, top_k=20, seed=11, max_tokens=12, ignore_eos=True),
    "victim": SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True),
}


def make_engine(tiny_model):
    model, tokenizer = tiny_model
    return LLMEngine(
        model, tokenizer=tokenizer, num_kv_blocks=64, max_num_seqs=8, log_stats=False, check_invariants=True
    )


def run(engine, names, poison=None, poison_at_step: int = 3):
    """Add the named requests, step until done; ``poison(engine)`` runs before step ``poison_at_step``."""
    for name in names:
        engine.add_request(name, PROMPTS[name], PARAMS[name])
    finals, step = {}, 0
    while engine.has_unfinished_requests():
        if poison is not None and step == poison_at_step:
            poison(engine)
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        step += 1
        assert step < 200
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.requests
    return finals


@pytest.fixture(scope="module")
def clean(tiny_model):
    finals = run(make_engine(tiny_model), ["greedy", "seeded", "also_seeded"])
    return {name: out.outputs[0].token_ids for name, out in finals.items()}


def bad_seed(engine):
    """A seed that slipped past validation: ``manual_seed`` raises for it (it failed every request once)."""
    seq = engine.requests["victim"].completions[0].seq
    seq.sampling_params.seed = 2**64  # each answer has its own copy of the params
    seq.generator = None  # made again, from that seed, at its next sample


def sampler_error(monkeypatch):
    """The noise is drawn for the whole batch (the seeded rows' generators advance), then one row's
    sampling raises: the batch is redone row by row from the generators' saved states."""
    real = sampler_module.exponential_noise

    def noise(shape, generators, device):
        out = real(shape, generators, device)
        if any(getattr(g, "poisoned", False) for g in generators):
            raise RuntimeError("simulated sampler failure on one row")
        return out

    monkeypatch.setattr(sampler_module, "exponential_noise", noise)

    def poison(engine):
        seq = engine.requests["victim"].completions[0].seq
        seq.generator = PoisonedGenerator().manual_seed(3)

    return poison


class PoisonedGenerator(torch.Generator):
    poisoned = True


def detokenizer_error(engine):
    completion = engine.requests["victim"].completions[0]

    def add(token_id):
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "simulated detokenizer failure")

    completion.detokenizer.add = add


@pytest.mark.parametrize(
    "how, error_type, status",
    [
        ("bad_seed", InvalidRequestError, 400),
        ("sampler_error", RequestFailedError, 500),
        ("detokenizer_error", RequestFailedError, 500),
    ],
)
def test_one_poisoned_request_fails_alone(tiny_model, clean, monkeypatch, how, error_type, status):
    poison = {"bad_seed": bad_seed, "detokenizer_error": detokenizer_error}.get(how) or sampler_error(monkeypatch)
    engine = make_engine(tiny_model)
    finals = run(engine, ["greedy", "seeded", "victim", "also_seeded"], poison)
    victim = finals.pop("victim")
    assert isinstance(victim.error, error_type) and victim.error.http_status == status
    assert victim.outputs[0].finish_reason == "error"
    assert len(victim.outputs[0].token_ids) < 12, "the victim stopped when it failed"
    assert all(out.error is None for out in finals.values())
    assert {name: out.outputs[0].token_ids for name, out in finals.items()} == clean


def test_the_engine_serves_on_after_a_failure(tiny_model, clean):
    engine = make_engine(tiny_model)
    run(engine, ["greedy", "victim"], detokenizer_error)
    again = run(engine, ["greedy", "seeded", "also_seeded"])
    assert {name: out.outputs[0].token_ids for name, out in again.items()} == clean


def test_the_seed_range_is_checked_up_front():
    """Every seed a request will use, seed ... seed + n - 1, must seed a torch generator."""
    for seed in (2**64, -(2**63) - 1):
        with pytest.raises(InvalidRequestError) as bad:
            SamplingParams(seed=seed)
        assert bad.value.param == "seed"
    with pytest.raises(InvalidRequestError):
        SamplingParams(seed=MAX_SEED - 1, n=3)  # its third answer would use 2**64
    with pytest.raises(InvalidRequestError):
        SamplingParams(seed=True)
    for seed in (MAX_SEED, -(2**63), 0):
        torch.Generator().manual_seed(SamplingParams(seed=seed).seed)


def test_row_by_row_resampling_keeps_the_batch_tokens():
    """The sampler's fallback gives every good row the token the batched call gives it."""
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.0, seed=1),
        SamplingParams(temperature=0.7, top_p=0.9, seed=2, logprobs=2),
        SamplingParams(temperature=1.0, seed=3),
    ]
    gens = lambda: [None] + [torch.Generator().manual_seed(s) for s in (1, 2, 3)]  # noqa: E731
    batched = Sampler()(logits, params, gens())
    rows = Sampler().sample_row_by_row(logits, params, gens())
    assert rows.token_ids.tolist() == batched.token_ids.tolist() and not rows.failed
    assert torch.allclose(rows.top_logprobs, batched.top_logprobs)

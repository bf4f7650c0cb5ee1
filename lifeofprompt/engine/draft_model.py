"""A draft model: a smaller model with the same tokenizer guesses the next k tokens, in the same engine.

The draft keeps its own KV pool, with exactly as many blocks as the target's, and the two are
indexed by the *same* block table: a request's token ``j`` has its target K/V and its draft K/V at
the same slot of the two pools. So the block manager needs no change. Allocation, rollback,
preemption and freeing act on both at once, and a prefix-cache hit covers both, because every
forward of the target (prefill chunks, decodes, verifies) is mirrored by the draft over the same
rows (``mirror``). The memory is split by the two models' bytes per block (``kv_bytes_per_block``).

A step with a draft model runs in this order:

1. at the end of the previous step, each decoding request asks for k drafts (``placeholders``);
2. the scheduler gives each one 1 + k' slots (k' <= k: its budget share, or 0);
3. ``fill`` runs the draft k' times, one row per request per run, in the slots the verify will
   use next. It keeps the drafter's ``q`` rows for the rejection rule when sampling;
4. the target's verify (one forward) and the draft's mirror of it write both pools, and the
   rollback keeps what was accepted in both.

The draft's own passes run eagerly, and so does every step when a draft model is used: a CUDA
graph replay of the target's decode would skip the draft's mirror.
"""

from __future__ import annotations

import torch

from ..errors import OutOfMemoryError, SpeculativeConfigError
from ..model.attention import PagedCacheMetadata, PagedKVCache
from . import rejection_sampler
from .memory import kv_bytes_per_block
from .sequence import Sequence
from .speculative import SpeculativeConfig

PLACEHOLDER = -1  # a draft token still to be drafted (its slot is what the scheduler plans for)


def check_same_tokenizer(target_tokenizer, draft_tokenizer, target_vocab: int, draft_vocab: int) -> None:
    """A draft proposes token ids; they mean the same text only with the same vocabulary."""
    if target_vocab != draft_vocab:
        raise SpeculativeConfigError(
            f"the draft's vocabulary has {draft_vocab} tokens, the model's {target_vocab}: "
            "a draft needs the same tokenizer",
            param="model",
        )
    if draft_tokenizer is None or draft_tokenizer is target_tokenizer:
        return
    vocab = getattr(target_tokenizer, "get_vocab", None)
    other = getattr(draft_tokenizer, "get_vocab", None)
    probe = "def f(x):\n    return x + 1  # héllo"
    same = (
        (vocab() == other())
        if vocab and other
        else list(target_tokenizer.encode(probe, add_special_tokens=False))
        == list(draft_tokenizer.encode(probe, add_special_tokens=False))
    )
    if not same:
        raise SpeculativeConfigError(
            "the draft's tokenizer differs from the model's: a draft needs the same tokenizer", param="model"
        )


def load_draft(config: SpeculativeConfig, target, target_tokenizer):
    """The draft model (loaded by name or path, or given), on the target's device and dtype, checked."""
    model, tokenizer = config.model, config.draft_tokenizer
    if isinstance(model, str):
        from ..model.loader import load_model

        try:
            model, tokenizer = load_model(model, dtype=target.dtype, device=target.device)
        except torch.cuda.OutOfMemoryError as exc:
            raise OutOfMemoryError(
                f"speculative_config['model']: the draft {config.model!r} does not fit in memory "
                f"beside the model ({exc})"
            ) from None
    if not hasattr(model, "config") or not hasattr(model, "hidden_states"):
        raise SpeculativeConfigError(
            f"a draft model is a name, a path or a loaded LlamaForCausalLM, got {type(model).__name__}", param="model"
        )
    if model.device != target.device or model.dtype != target.dtype:
        model = model.to(device=target.device, dtype=target.dtype)
    check_same_tokenizer(target_tokenizer, tokenizer, target.config.vocab_size, model.config.vocab_size)
    return model.eval()


class DraftModelProposer:
    """Runs the draft: its mirror of every target forward, and its k one-row passes before a verify."""

    def __init__(self, config: SpeculativeConfig, model, resolved, speedups):
        self.k = config.k
        self.model = model
        self.block_size = resolved.block_size
        self.backend = resolved.attention_backend
        self.kv_dtype = resolved.kv_cache_dtype  # the target's form (an fp8 pool: runner.calibrate_kv_cache)
        self.kv_cache = PagedKVCache.for_model(
            model.config, resolved.num_kv_blocks, self.block_size, model.dtype, model.device, self.kv_dtype
        )
        self.num_forwards = 0
        self.speedups = speedups  # its own (the target's chose them: ``Speedups.for_draft``)

    def kv_bytes_per_block(self) -> int:
        return kv_bytes_per_block(self.model.config, self.model.dtype, self.block_size, self.kv_dtype)

    # ---------------------------------------------------------------- the mirror
    @torch.no_grad()
    def mirror(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: PagedCacheMetadata) -> None:
        """The target's step over the draft's pool: same rows, same slots, no logits (only its K/V matter)."""
        self.num_forwards += 1
        own = meta.over_pool(self.kv_cache, self.backend)  # by name: the draft never attends in C
        self.model.hidden_states(input_ids, positions, own)

    # ---------------------------------------------------------------- drafting
    def placeholders(self, seq: Sequence, max_draft: int) -> list[int]:
        """What a decoding request asks the scheduler for: k slots to be drafted into (fewer near its end)."""
        return [PLACEHOLDER] * min(self.k, max_draft)

    @torch.no_grad()
    def fill(self, seqs: list[Sequence]) -> None:
        """Draft the scheduled number of tokens for each sequence, in the slots its verify will use.

        Pass ``j`` runs one row per sequence still drafting: its last token (``j = 0``) or its
        draft ``j`` at position ``len - 1 + j``, attending to the draft's K/V of everything before.
        Greedy requests take the draft's argmax; sampling ones draw from the draft's filtered
        distribution ``q`` with their own generator, and keep ``q`` for the rejection rule.
        """
        drafts = {s.seq_id: [] for s in seqs}
        probs = {s.seq_id: [] for s in seqs}
        for j in range(max((len(s.spec_token_ids) for s in seqs), default=0)):
            active = [s for s in seqs if len(s.spec_token_ids) > j]
            logits = self._one_row_each(active, [drafts[s.seq_id] for s in active])
            for s, row in zip(active, logits):
                token, q = self._choose(s, row)
                drafts[s.seq_id].append(token)
                if q is not None:
                    probs[s.seq_id].append(q)
        for s in seqs:
            q = torch.stack(probs[s.seq_id]) if probs[s.seq_id] else None
            s.set_spec(drafts[s.seq_id], q)

    def _one_row_each(self, seqs: list[Sequence], drafted: list[list[int]]) -> torch.Tensor:
        """One forward of the draft: per sequence, the row after its tokens and its drafts so far."""
        ids, positions, slots = [], [], []
        for s, d in zip(seqs, drafted):
            pos = len(s) - 1 + len(d)
            ids.append(d[-1] if d else s.last_token)
            positions.append(pos)
            slots.append(s.block_table[pos // self.block_size] * self.block_size + pos % self.block_size)
        width = max(len(s.block_table) for s in seqs)
        tables = torch.tensor([s.block_table + [-1] * (width - len(s.block_table)) for s in seqs], dtype=torch.int32)
        device = self.model.device
        slot_mapping = torch.tensor(slots, dtype=torch.long)
        meta = PagedCacheMetadata.for_batch(
            [1] * len(seqs), [p + 1 for p in positions], tables, slot_mapping, self.kv_cache, self.backend, device
        )
        self.num_forwards += 1
        return self.model(
            torch.tensor(ids, device=device),
            torch.tensor(positions, device=device),
            meta,
        )

    @staticmethod
    def _choose(seq: Sequence, logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        params = seq.sampling_params
        if params.temperature == 0:
            return int(logits.argmax()), None
        q = rejection_sampler.filtered_probs(logits[None], params)[0]
        return rejection_sampler.draw(q, seq.random_stream(logits.device)), q

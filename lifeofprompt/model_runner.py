"""``ModelRunner``: turns one scheduled step into a flat batch, runs the model, samples.

The scheduler decides *which* tokens run (``num_scheduled_tokens`` per sequence, starting at
``seq.num_computed_tokens``); the runner decides *how*: token ids and positions in one flat
tensor, each new token's cache slot from the sequence's block table, the block tables and
lengths as tensors, and logits only for sequences whose step reaches their last known token
(a prompt chunk in the middle of a prompt samples nothing).
"""

from __future__ import annotations

import torch

from .attention import PagedCacheMetadata, PagedKVCache
from .sequence import Sequence


class ModelRunner:
    def __init__(self, model, num_blocks: int, block_size: int = 16, backend: str = "torch"):
        self.model = model
        self.block_size = block_size
        self.backend = backend
        self.kv_cache = PagedKVCache.for_model(model.config, num_blocks, block_size, dtype=model.dtype, device=model.device)

    def prepare(self, seqs: list[Sequence], num_scheduled_tokens: list[int]):
        """Flat ``input_ids``, ``positions`` and the paged metadata of one step."""
        ids, positions, slots, query_lens, seq_lens, logits_rows = [], [], [], [], [], []
        for seq, n in zip(seqs, num_scheduled_tokens):
            start = seq.num_computed_tokens
            tokens = seq.token_ids
            ids.extend(tokens[start:start + n])
            for pos in range(start, start + n):
                positions.append(pos)
                slots.append(seq.block_table[pos // self.block_size] * self.block_size + pos % self.block_size)
            query_lens.append(n)
            seq_lens.append(start + n)
            if start + n == len(tokens):
                logits_rows.append(len(ids) - 1)
        device = self.model.device
        width = max(len(s.block_table) for s in seqs)
        block_tables = torch.tensor([s.block_table + [-1] * (width - len(s.block_table)) for s in seqs],
                                    dtype=torch.int32, device=device)
        fields = PagedCacheMetadata.describe_batch(query_lens, seq_lens, device)
        fields["logits_indices"] = torch.tensor(logits_rows, dtype=torch.long, device=device)
        meta = PagedCacheMetadata(**fields, cache=self.kv_cache, block_tables=block_tables,
                                  slot_mapping=torch.tensor(slots, dtype=torch.long, device=device), backend=self.backend)
        return (torch.tensor(ids, dtype=torch.long, device=device),
                torch.tensor(positions, dtype=torch.long, device=device), meta)

    @torch.no_grad()
    def execute(self, seqs: list[Sequence], num_scheduled_tokens: list[int]) -> list[int | None]:
        """Run one step; the sampled token for each sequence that reached its end, else None."""
        input_ids, positions, meta = self.prepare(seqs, num_scheduled_tokens)
        logits = self.model(input_ids, positions, meta)
        sampling = [s for s, n in zip(seqs, num_scheduled_tokens) if s.num_computed_tokens + n == len(s)]
        sampled = iter(self.sample(logits, sampling))
        return [next(sampled) if s.num_computed_tokens + n == len(s) else None
                for s, n in zip(seqs, num_scheduled_tokens)]

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """Greedy where temperature is 0, else a draw from softmax(logits / temperature)."""
        tokens = []
        for row, seq in zip(logits, seqs):
            params = seq.sampling_params
            if params.temperature == 0:
                tokens.append(int(row.argmax()))
                continue
            generator = getattr(seq, "generator", None)
            if generator is None and params.seed is not None:
                generator = seq.generator = torch.Generator(device=row.device).manual_seed(params.seed)
            probs = torch.softmax(row.float() / params.temperature, dim=-1)
            tokens.append(int(torch.multinomial(probs, 1, generator=generator)))
        return tokens

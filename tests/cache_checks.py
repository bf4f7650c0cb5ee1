"""A check the property tests share: nothing in the prefix cache that no sequence really computed."""

from __future__ import annotations

from lifeofprompt.engine.block_manager import hash_block


def check_cached_blocks_were_verified(bm, verified: list[list[int]]) -> None:
    """Every block in the prefix cache is one of the chained full blocks of some sequence's verified tokens."""
    known = set()
    for tokens in verified:
        parent = None
        for i in range(len(tokens) // bm.block_size):
            parent = hash_block(parent, tokens[i * bm.block_size : (i + 1) * bm.block_size])
            known.add(parent)
    for h, block_id in bm.hash_to_block.items():
        assert h in known, f"cached block {block_id} {bm.blocks[block_id].token_ids} holds tokens no sequence verified"

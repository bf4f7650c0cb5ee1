"""Tensor and pipeline parallelism through ``torch.distributed``. Public face: ``group.ParallelGroup``, ``sizes.ShardPlan``.

``sizes``: the splits a model allows; ``sharded_model``: one rank's Llama; ``step``: each forward's inputs sent out
(``pipeline``: down the stages), counted by ``collectives``; ``group``: rank 0, ``worker``: the rest, ``rank_graphs``: CUDA graphs.
"""

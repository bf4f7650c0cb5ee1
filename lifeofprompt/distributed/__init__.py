"""Tensor and pipeline parallelism through ``torch.distributed``. Public face: ``group.ParallelGroup``, ``sizes.ShardPlan``.

``sizes`` says which splits a model allows, ``sharded_model`` is the Llama built from one rank's shapes, ``step`` broadcasts
each forward's inputs (``pipeline``: down the stages), ``collectives`` counts them; ``group`` is rank 0's side, ``worker`` the others;
``rank_graphs`` lets every rank capture and replay its own CUDA graphs of the decode step (one stage).
"""

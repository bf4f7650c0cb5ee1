"""Tensor and pipeline parallelism through ``torch.distributed``: ``group.ParallelGroup`` (rank 0), ``worker`` (the
rest), ``sizes``, ``sharded_model`` (one rank's Llama), ``step`` and ``pipeline`` (each forward's inputs sent out),
``collectives`` (counted), ``rank_graphs`` (CUDA graphs per rank).
"""

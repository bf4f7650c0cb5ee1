"""The engine: requests in, tokens out. Public face: ``LLM``, ``LLMEngine``, ``SamplingParams``, ``RequestOutput``.

Inside, one step: the ``scheduler`` picks tokens, the ``block_manager`` gives them KV slots (sized by ``memory``),
the ``model_runner`` batches, runs the model and samples (``sampler``).
"""

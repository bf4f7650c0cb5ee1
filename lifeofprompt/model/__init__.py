"""The model: the Llama decoder in plain torch (``llama``), its weights and tokenizer (``loader``).

Public face: ``load_model``, ``ModelConfig``, ``LlamaForCausalLM``; ``attention`` tells the layers where keys and
values live, ``paged_attention`` is the torch reference of the Triton kernels (``lifeofprompt.kernels``).
"""

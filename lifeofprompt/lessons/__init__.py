"""What the notebooks compute on the way, and the engine never needs: toy attention, naive and cached decoding
(``generate``), the transformers ``reference`` and when two paths must agree (``agreement``), ``flops`` and the
``roofline``, ``static_batching``, the ``simulator``, paging traces, serving studies, ``speculation`` and ``parallelism``.
"""

"""What the notebooks compute on the way, and the engine never needs: toy attention, ``generate``, the ``reference``
and ``agreement``, ``flops``, the ``roofline``, ``static_batching``, the ``simulator``, paging traces, serving
studies, ``speculation`` and ``parallelism``.
"""

"""Serving: an OpenAI-compatible HTTP server around ``LLMEngine`` (``server.ServerThread``, ``server.serve``).

And the client side: ``loadtest.run_loadtest`` with its ``arrivals`` and latency ``metrics`` (TTFT, TPOT).
"""

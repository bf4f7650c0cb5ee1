"""Serving: an OpenAI-compatible HTTP server around ``LLMEngine`` (``server.ServerThread``, ``server.serve``).

Latency from timestamps (``metrics``), which the load tester (``lifeofprompt.loadtest``) reads too.
"""

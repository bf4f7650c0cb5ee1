"""Serving: an OpenAI-compatible HTTP server around ``LLMEngine`` (``server.serve``); the chapters and tests run it
in a thread (``lessons.server_thread``).

Latency from timestamps (``metrics``), which the load tester (``lifeofprompt.loadtest``) reads too.
"""

"""The load tester: a client for any OpenAI-compatible server (``client.run_loadtest``).

When its requests arrive: ``arrivals`` (also the simulator's and the chapters' loads).
"""

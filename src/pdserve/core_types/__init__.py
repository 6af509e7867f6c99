"""The step vocabulary every process shares: typed messages, sampling parameters,
scheduler/runner outputs, KV transfer parameters, cache specs, stats snapshots, and the
grammar of a structured-output spec (``grammar.py``: xgrammar, imported on first use).

The bottom floor above ``config``: nothing here imports another pdserve package
(torch is not imported either, so the API process can use these types cheaply).
"""

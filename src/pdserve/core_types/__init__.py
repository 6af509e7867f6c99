"""The step vocabulary every process shares: typed messages, sampling parameters,
scheduler/runner outputs, KV transfer parameters, cache specs and stats snapshots.

The bottom floor above ``config``: nothing here imports another pdserve package
(torch is not imported either, so the API process can use these types cheaply).
"""

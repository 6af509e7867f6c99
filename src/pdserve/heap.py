"""Keep Python's cyclic garbage collector off the heap built at start-up.

A long-lived process (the engine core, the API server, the proxy) ends its start-up
holding hundreds of thousands of objects that live as long as it does: modules, the
model's modules and parameters, the tokenizer, the KV block pool. A collection of
the oldest generation walks all of them and stops the process while it does, and the
first one lands in whichever request happens to allocate past the threshold (the
first request after start-up paid it: ``benchmarks/RESULTS.md``, session 4).
``gc.freeze()`` moves everything alive now to a permanent generation that
collections skip; objects allocated later are collected as usual.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> None:
    """Collect once, then exclude every surviving object from later collections."""
    gc.collect()
    gc.freeze()

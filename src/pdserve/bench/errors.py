"""Errors raised by the benchmark client for bad user input or an unusable server."""

from __future__ import annotations


class BenchError(Exception):
    """A user-facing problem (bad flag combination, missing tokenizer, server not ready).

    ``main`` prints the message without a traceback and exits non-zero; programmatic
    callers get the exception.
    """

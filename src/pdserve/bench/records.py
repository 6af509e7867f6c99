"""Per-request input and measured output records (plain data, no I/O).

All times are ``time.perf_counter()`` seconds. For a successful request:
``ttft > 0``, ``latency >= ttft`` and ``ttft + sum(itl) == latency`` up to float
rounding; ``start_time`` is taken right before the POST, inside the concurrency
slot, so client-side queueing is only in ``client_queue_time``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class RequestInput:
    """Everything one streaming request needs; ``extra_body`` is merged into the JSON."""

    prompt: str
    api_url: str
    prompt_len: int
    output_len: int
    model: str
    ignore_eos: bool = False
    extra_body: dict[str, Any] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)
    request_id: str | None = None


@dataclass
class RequestOutput:
    """What the client observed for one request.

    ``success`` is False for a non-200 status, a transport/parse exception, or a
    stream with no chunk carrying ``choices``; ``error`` then says why. ``itl`` holds
    one gap per choices-carrying chunk after the first (per chunk, not per token).
    ``output_tokens`` is ``usage.completion_tokens`` or None when not reported;
    ``prompt_len`` is overwritten by ``usage.prompt_tokens`` when reported.
    """

    success: bool = False
    generated_text: str = ""
    latency: float = 0.0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int | None = None
    prompt_len: int = 0
    error: str = ""
    start_time: float = 0.0
    client_queue_time: float = 0.0

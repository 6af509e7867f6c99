"""``--speculative-config``: speculative decoding, with vLLM's keys.

- ``method``: ``mtp`` (the model's own MTP layers; ``num_speculative_tokens`` may exceed
  ``num_nextn_predict_layers``, the layers are reused in turn) or ``ngram`` (prompt
  lookup over the request's own tokens, any model).
- ``num_speculative_tokens``: drafts per step (k), 1..16.
- ``prompt_lookup_min`` / ``prompt_lookup_max`` (ngram): the n-gram lengths tried,
  longest first; when only one is given the other takes its value; default 5.
- ``rejection_sample_method``: ``probabilistic`` (default: exact for any sampling
  parameters), ``strict`` (a draft counts only when it equals the target's own sample at
  its position), or ``synthetic`` (for performance runs only: each draft is accepted with
  probability ``synthetic_acceptance_rate`` whatever the target says, so random weights
  can be timed at a chosen acceptance; the output is not the model's).
- ``pad_first_decode_step`` (pdserve's own key, default true): on a P/D decode instance,
  a request's first step after its KV arrived (the last prompt token, recomputed) is
  padded with k placeholder drafts that are never accepted, so it joins the uniform
  (batch, 1+k) verify batch and its CUDA graph instead of making the step a mixed one.
  No padding where the step's token budget or the request's length room is short of 1+k.
- ``draft_policy`` (pdserve's own key): ``adaptive`` (default) or ``fixed``. Adaptive: each
  step the engine verifies ``j`` in ``0..k`` drafts per request, the ``j`` with the most
  tokens per second for the batch from the step costs it timed on its CUDA graphs and
  the acceptance per draft position it measures live
  (:mod:`pdserve.spec_decode.draft_policy`); ``j = 0`` runs the step as plain decode
  with no drafting, so speculation is never chosen where it costs more than it gives.
  An engine without CUDA graphs (no costs timed) and the expert-parallel data-parallel
  ranks (which must agree on every step's shape) keep ``k``. Fixed: always ``k``.

Anything else is refused with the list of the keys pdserve understands.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdserve.config.json_arg import parse_json_arg

SPEC_METHODS = ("mtp", "ngram")
REJECTION_METHODS = ("probabilistic", "strict", "synthetic")
DRAFT_POLICIES = ("adaptive", "fixed")
MAX_SPEC_TOKENS = 16
_KEYS = (
    "method",
    "num_speculative_tokens",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "rejection_sample_method",
    "synthetic_acceptance_rate",
    "pad_first_decode_step",
    "draft_policy",
)


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 5
    prompt_lookup_max: int = 5
    rejection_sample_method: str = "probabilistic"
    synthetic_acceptance_rate: float | None = None
    pad_first_decode_step: bool = True
    draft_policy: str = "adaptive"

    def __post_init__(self) -> None:
        flag = "--speculative-config"
        if self.method not in SPEC_METHODS:
            raise ValueError(
                f"{flag}: method {self.method!r} is not supported "
                f"(supported: {', '.join(SPEC_METHODS)})"
            )
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPEC_TOKENS:
            raise ValueError(
                f"{flag}: num_speculative_tokens must be an integer in 1..{MAX_SPEC_TOKENS}"
            )
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
            raise ValueError(f"{flag}: need 1 <= prompt_lookup_min <= prompt_lookup_max")
        if self.rejection_sample_method not in REJECTION_METHODS:
            raise ValueError(
                f"{flag}: rejection_sample_method must be one of {', '.join(REJECTION_METHODS)}"
            )
        if not isinstance(self.pad_first_decode_step, bool):
            raise ValueError(f"{flag}: pad_first_decode_step must be true or false")
        if self.draft_policy not in DRAFT_POLICIES:
            raise ValueError(f"{flag}: draft_policy must be one of {', '.join(DRAFT_POLICIES)}")
        rate = self.synthetic_acceptance_rate
        if self.rejection_sample_method == "synthetic":
            if not isinstance(rate, int | float) or not 0.0 <= rate <= 1.0:
                raise ValueError(f"{flag}: synthetic needs synthetic_acceptance_rate in [0, 1]")
        elif rate is not None:
            raise ValueError(
                f"{flag}: synthetic_acceptance_rate applies to rejection_sample_method synthetic"
            )

    @classmethod
    def from_json(cls, value: str | dict | SpeculativeConfig | None) -> SpeculativeConfig | None:
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        obj = parse_json_arg(value, "--speculative-config")
        unknown = set(obj) - set(_KEYS)
        if unknown:
            raise ValueError(
                f"--speculative-config: key(s) {', '.join(sorted(unknown))} are not supported "
                f"(supported: {', '.join(_KEYS)})"
            )
        for req in ("method", "num_speculative_tokens"):
            if req not in obj:
                raise ValueError(f"--speculative-config needs {req!r}")
        lo, hi = obj.pop("prompt_lookup_min", None), obj.pop("prompt_lookup_max", None)
        if lo is None and hi is None:
            lo = hi = 5
        lo = hi if lo is None else lo
        hi = lo if hi is None else hi
        return cls(**obj, prompt_lookup_min=lo, prompt_lookup_max=hi)

    def describe(self) -> dict[str, Any]:
        """What the P/D compatibility handshake compares."""
        return {"method": self.method}  # prefill and decode may draft different k

"""The drafter a ``--speculative-config`` asks for, built over the runner's model."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pdserve.config.speculative import SpeculativeConfig
from pdserve.forward_context import KVCaches
from pdserve.spec_decode.mtp import MTPProposer
from pdserve.spec_decode.ngram import NgramProposer
from pdserve.spec_decode.proposer import Proposer


def build_proposer(
    spec: SpeculativeConfig,
    model: Any,
    backends: dict[str, Any],
    kv_caches: Callable[[], KVCaches],
    max_num_reqs: int,
    max_model_len: int,
    device: torch.device,
    architecture: str,
) -> Proposer:
    """``ngram``: prompt lookup; ``mtp``: the model's own MTP layers (refused, naming
    the architecture, for a model without them)."""
    if spec.method == "ngram":
        return NgramProposer(
            spec.num_speculative_tokens,
            spec.prompt_lookup_min,
            spec.prompt_lookup_max,
            max_num_reqs,
            max_model_len,
            device,
        )
    dc = getattr(model, "dc", None)
    if not getattr(model, "mtp_layers", None) or dc is None:
        raise ValueError(
            f"--speculative-config: method mtp needs a model with MTP layers "
            f"({architecture} has none)"
        )
    return MTPProposer(
        model,
        spec.num_speculative_tokens,
        backends,
        kv_caches,
        max_model_len,
        share_topk=bool(dc.index_share_for_mtp_iteration),
    )

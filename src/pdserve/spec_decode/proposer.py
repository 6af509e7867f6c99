"""The one interface every drafter implements (n-gram, MTP, and the tests' drafters).

Lifecycle: the runner calls :meth:`Proposer.propose` once per step, right after the
step's tokens were sampled, while everything is still on the device; what it returns
becomes the next step's drafts: the runner keeps them in its request state on the
device, where the next step reads the drafts the scheduler sends as -1 (under async
scheduling it has not seen them); they also reach the scheduler when the step lands.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from pdserve.layers.attention import CommonAttentionMetadata


@dataclass
class DraftBatch:
    """One step's requests as a drafter sees them (row ``i`` = request ``i`` of the batch).

    ``sampled[i, :num_sampled[i]]`` are the tokens request ``i`` accepted this step; its
    last one sits at position ``next_positions[i]`` (its KV is computed by the next
    step). ``hidden`` holds the final hidden state of every token this step computed
    (``query_start_loc`` delimits each request's rows), for drafters that read them
    (MTP). ``token_table`` and ``rows`` give the host's view of each request's tokens
    known before this step (the prompt at least). Requests in ``~samples`` reached no
    end this step (a prompt chunk): their drafts are ignored.
    """

    req_ids: list[str]
    rows: np.ndarray
    samples: np.ndarray  # [B] bool
    token_table: np.ndarray
    num_prompt_tokens: np.ndarray  # [B]
    num_known: np.ndarray  # [B] tokens of each row the host table holds
    max_context: int  # an upper bound on next_positions + 1 over the batch
    sampled: torch.Tensor  # [B, k+1] int64, -1 padded
    num_sampled: torch.Tensor  # [B] int64
    next_positions: torch.Tensor  # [B] int64
    hidden: torch.Tensor  # [T, hidden]
    query_start_loc: torch.Tensor  # [B+1]
    # the step itself, for drafters that run the model over it (MTP)
    input_ids: torch.Tensor | None = None  # [T] as the step computed them
    positions: torch.Tensor | None = None  # [T]
    common: CommonAttentionMetadata | None = None
    first_token: torch.Tensor | None = None  # [B] token index of each request's first row
    num_rows: torch.Tensor | None = None  # [B] its logits rows (drafts + 1)
    last_next_ids: torch.Tensor | None = None  # [B] the token after its last one, -1: unknown
    block_tables: torch.Tensor | None = None  # [B, max blocks], lookahead blocks included
    sample_mask: torch.Tensor | None = None  # [B] bool on the device: ``samples``
    # drafts the next step is expected to verify (the adaptive policy's choice for this
    # one): MTP proposes that many and -1 past them, so a step that verifies j < k does
    # not pay for k; None: num_speculative_tokens. The n-gram drafter, whose drafts cost
    # nothing to speak of, always proposes all of them.
    num_drafts: int | None = None


def drafts_to_propose(query_len: int | None, adaptive: bool) -> int | None:
    """``DraftBatch.num_drafts`` of a step computing ``query_len`` tokens per request
    (None: not uniform): under the adaptive policy as many drafts as the step verifies,
    since the next step most likely verifies as many (one that wants more verifies -1
    placeholders past them); else None, all of them."""
    return query_len - 1 if adaptive and query_len is not None and query_len > 1 else None


class Proposer(Protocol):
    """Drafts ``num_speculative_tokens`` tokens per request."""

    num_speculative_tokens: int

    def propose(self, batch: DraftBatch) -> torch.Tensor:
        """[B, num_speculative_tokens] int64 on the batch's device; -1 where there is no
        draft (the verify step computes it as a placeholder and never accepts it)."""
        ...

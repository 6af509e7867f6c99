"""The counts presence, frequency and repetition penalties read, per logits row.

A row's counts are of the output tokens before the token it samples. The host knows a
request's tokens up to its ``num_tokens``; under async scheduling the step in flight
adds tokens the host has not seen yet, and they are read on the device: its last
accepted token is this step's first input id (patched in by
:meth:`~pdserve.runner.step_inputs.StepPreparer.prepare`), and the drafts it accepted
before that (when it verified drafts) are in its accepted tokens. A verify's row ``j``
also counts this step's drafts ``0 .. j-1``, which are its input ids after the first:
row ``j`` judges the token that would follow them. So each verified position is
penalised as the engine without speculation penalises that position.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import torch

from pdserve.layers.sampler import Penalties
from pdserve.runner.input_batch import InputBatch
from pdserve.runner.input_buffers import InputBuffers, upload


class InFlight(Protocol):
    """What these counts read of the step in flight (``step_inputs.InFlight``)."""

    tokens: torch.Tensor  # [B, k+1] accepted tokens
    num: torch.Tensor | None  # [B] accepted counts
    index: np.ndarray  # row -> its batch index in that step, -1: sampled none
    num_rows: np.ndarray | None  # row -> tokens it verified
    row_gens: np.ndarray  # row -> its generation when that step was prepared


def penalties(
    b: InputBatch,
    buf: InputBuffers,
    prev: InFlight | None,
    rrows: np.ndarray,
    params: list[Any],
    lreq: np.ndarray,
    nsched: np.ndarray,
    ndraft: np.ndarray,
    offset: np.ndarray,
) -> Penalties | None:
    """Output-token counts and prompt-token marks [P, V] of the logits rows with
    penalties (``rrows[r]``: row ``r``'s batch row, ``lreq[r]`` its request, ``offset[r]``
    its position among the request's rows); None when no row has any."""
    sel = np.flatnonzero(b.has_penalties[rrows])
    if not len(sel):
        return None
    dev = buf.input_ids.dev.device
    vocab = b.vocab_size
    prow, req = rrows[sel], lreq[sel]
    computed, plen = b.num_computed[prow], b.num_prompt_tokens[prow]
    upto = computed + nsched[req] - ndraft[req] + offset[sel]  # its token's position
    host_end = np.maximum(np.minimum(b.num_tokens[prow], upto), plen)
    k = np.arange(len(sel))
    out_ids = np.concatenate(
        [b.token_ids[r, p:e] for r, p, e in zip(prow, plen, host_end, strict=True)]
    ).astype(np.int64)
    prompt_ids = np.concatenate(
        [b.token_ids[r, :p] for r, p in zip(prow, plen, strict=True)]
    ).astype(np.int64)

    counts = torch.zeros((len(sel), vocab), dtype=torch.float32, device=dev)
    out_rows = upload(np.repeat(k, host_end - plen), dev)
    counts.index_put_(
        (out_rows, upload(out_ids, dev)), torch.ones(len(out_ids), device=dev), accumulate=True
    )
    # this step's input ids: the token in flight (async) and the drafts before the row
    miss = np.maximum(upto - np.maximum(host_end, computed), 0)
    if miss.any():
        cu = np.cumsum(nsched) - nsched
        first = cu[req] + np.maximum(host_end, computed) - computed
        off = np.arange(int(miss.sum())) - np.repeat(np.cumsum(miss) - miss, miss)
        flat = np.repeat(first, miss) + off
        toks = buf.input_ids.dev.index_select(0, upload(flat, dev)).to(torch.int64)
        counts.index_put_(
            (upload(np.repeat(k, miss), dev), toks),
            torch.ones(len(flat), device=dev),
            accumulate=True,
        )
    _add_accepted_in_flight(counts, b, prev, prow, dev)
    prompt = torch.zeros((len(sel), vocab), dtype=torch.bool, device=dev)
    prompt[upload(np.repeat(k, plen), dev), upload(prompt_ids, dev)] = True
    ps = [params[i] for i in sel]
    return Penalties(
        upload(sel, dev),
        counts,
        prompt,
        upload(np.array([p.presence_penalty for p in ps], dtype=np.float32), dev),
        upload(np.array([p.frequency_penalty for p in ps], dtype=np.float32), dev),
        upload(np.array([p.repetition_penalty for p in ps], dtype=np.float32), dev),
    )


def _add_accepted_in_flight(
    counts: torch.Tensor,
    b: InputBatch,
    prev: InFlight | None,
    prow: np.ndarray,
    dev: torch.device,
) -> None:
    """Count the drafts the step in flight accepted for these rows (all its accepted
    tokens but the last, which is this step's first input id, counted already)."""
    if prev is None or prev.num is None or prev.num_rows is None:
        return
    src = np.where(prev.row_gens[prow] == b.row_gen[prow], prev.index[prow], -1)
    hit = np.flatnonzero((src >= 0) & (prev.num_rows[prow] > 1))
    if not len(hit):
        return
    at = upload(src[hit], dev)
    toks = prev.tokens.index_select(0, at)  # [H, k+1], -1 past the count
    accepted = prev.num.index_select(0, at) - 1
    width = torch.arange(toks.shape[1], device=dev)
    weight = (width[None, :] < accepted[:, None]).to(torch.float32)
    rows = upload(hit, dev)[:, None].expand_as(toks)
    counts.index_put_((rows, toks.clamp(min=0)), weight, accumulate=True)

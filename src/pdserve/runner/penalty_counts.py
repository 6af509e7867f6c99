"""The counts presence, frequency and repetition penalties read, per logits row.

A row's counts are of the output tokens before the token it samples. The host knows a
request's tokens up to its ``num_tokens`` (those of the steps that landed); the rest
are read on the device: the last token accepted is this step's first input id (filled
from the :class:`~pdserve.runner.request_state.RequestState`), and the drafts accepted
before it by a step that has not landed are that state's ``sampled`` tokens. A verify's row ``j``
also counts this step's drafts ``0 .. j-1``, which are its input ids after the first:
row ``j`` judges the token that would follow them. So each verified position is
penalised as the engine without speculation penalises that position.
"""

from __future__ import annotations

import numpy as np
import torch

from pdserve.layers.sampler import Penalties
from pdserve.runner.input_batch import InputBatch
from pdserve.runner.input_buffers import InputBuffers, upload
from pdserve.runner.request_state import RequestState


def penalties(
    b: InputBatch,
    buf: InputBuffers,
    state: RequestState,
    rrows: np.ndarray,
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
    unlanded = state.unlanded_outputs(upload(prow, dev), upload(b.num_tokens[prow], dev))
    if unlanded is not None:
        toks, weight = unlanded
        rows = torch.arange(len(sel), device=dev)[:, None].expand_as(toks)
        counts.index_put_((rows, toks), weight, accumulate=True)
    prompt = torch.zeros((len(sel), vocab), dtype=torch.bool, device=dev)
    prompt[upload(np.repeat(k, plen), dev), upload(prompt_ids, dev)] = True
    ps = [b.params[r] for r in prow]
    return Penalties(
        upload(sel, dev),
        counts,
        prompt,
        upload(np.array([p.presence_penalty for p in ps], dtype=np.float32), dev),
        upload(np.array([p.frequency_penalty for p in ps], dtype=np.float32), dev),
        upload(np.array([p.repetition_penalty for p in ps], dtype=np.float32), dev),
    )

"""Triton attention backend (``--attention-backend triton``).

Cache layout: the default ``[2, num_blocks, block_size, num_kv_heads, head_dim]``
(K then V), identical to :class:`TorchReferenceBackend`, so either backend reads
a cache the other wrote.

Forward, per layer:

1. write this step's K/V with :func:`write_kv_cache` (first ``num_actual_tokens``
   tokens, through ``slot_mapping``); given the step's ``rope`` with the fused kernels
   on, :func:`rope_write_kv` rotates q and k and writes K/V in one launch;
2. a *uniform* batch (every request has ``uniform_query_len`` tokens, see
   :meth:`TritonAttentionBackend.build_metadata`) goes to the split-K paged decode
   kernel :func:`decode_attention`; every other batch (prompts, chunks, mixed
   prefill + decode) to the varlen paged kernel :func:`prefill_attention`. A
   batch that is one prompt with no cached prefix uses torch's fused SDPA on
   this step's K/V instead (host-int test, no loop; faster there, see
   ``benchmarks/RESULTS.md``;
   ``sdpa_prefill=False`` turns it off).
3. output rows past ``num_actual_tokens`` are zeros.

An fp8 cache's static scales (``k_scale``, ``v_scale``): the write divides by them;
the kernels that read the cache get ``scale * k_scale`` as their softmax scale and
their output is multiplied by ``v_scale`` (one elementwise op, only when it is not
1.0); the SDPA path attends over this step's unquantized K/V and applies neither.

Metadata: :class:`CommonAttentionMetadata` as the runner builds it (a plain one is
accepted too and wrapped on the fly). Only host ints pick the path and the
launch shapes; the kernels read ``query_start_loc``, ``seq_lens``,
``block_tables`` and ``slot_mapping`` from the device, so nothing syncs.

CUDA-graph contract (uniform decode batches):

- capture with metadata whose host ints describe the *padded* batch:
  ``num_reqs`` = padded batch, ``num_actual_tokens`` = ``num_reqs * q_len`` =
  padded tokens, ``max_query_len`` = ``q_len``; padded requests either have
  ``seq_lens`` 0 (they read nothing and output zeros) or live on the null block
  (the runner's dummies: ``q_len`` tokens of block 0, block-table row 0), and
  their tokens write ``slot_mapping`` 0. Replays change only the contents of
  the device tensors, never their addresses.
- the split count depends on (``num_reqs``, KV heads, SM count, context bound);
  the context bound is ``max_model_len`` once known (constructor or
  :meth:`prepare_for_capture`), else the step's host ``max_seq_len``. Set it
  before capturing so the captured split count suits every later context.
- call :meth:`prepare_for_capture` (or :meth:`prepare_workspace`) before capturing: it allocates the split-K
  workspace for every batch up to ``max_batch`` and freezes it, so captured
  graphs keep a valid pointer. A frozen workspace is never reallocated; an
  eager batch that needs more gets a temporary buffer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pdserve.kernels._utils import num_sms
from pdserve.kernels.decode_attention import (
    choose_num_splits,
    decode_attention,
    decode_workspace_numel,
)
from pdserve.kernels.kv_cache_write import rope_write_kv, write_kv_cache
from pdserve.kernels.prefill_attention import prefill_attention, sdpa_prefill
from pdserve.layers.attention.backend import CommonAttentionMetadata, GQABackend
from pdserve.layers.rotary import RopeInputs

MAX_UNIFORM_QUERY_LEN = 8


@dataclass
class TritonAttentionMetadata:
    """The common metadata plus the host facts the Triton backend dispatches on.

    ``uniform_query_len`` is ``q`` when every request computes exactly ``q``
    tokens (``1 <= q <= MAX_UNIFORM_QUERY_LEN``), else None.
    """

    common: CommonAttentionMetadata
    uniform_query_len: int | None


def uniform_query_len_of(common: CommonAttentionMetadata) -> int | None:
    """``max_query_len`` if all requests have that many query tokens, from host ints only.

    ``num_actual_tokens == num_reqs * max_query_len`` holds only when every
    request has ``max_query_len`` tokens (none has more). Query lengths above
    ``MAX_UNIFORM_QUERY_LEN`` are prompts, better served by the prefill kernel.
    """
    q = common.max_query_len
    ok = common.num_reqs > 0 and 1 <= q <= MAX_UNIFORM_QUERY_LEN
    return q if ok and common.num_actual_tokens == common.num_reqs * q else None


def _normalize(device: torch.device) -> torch.device:
    """``cuda`` -> ``cuda:<current>`` so workspace lookups agree with tensors' devices."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


class TritonAttentionBackend(GQABackend):
    name = "triton"
    supports_cuda_graphs = True

    def __init__(self, max_model_len: int | None = None, sdpa_prefill: bool = True) -> None:
        self.max_model_len = max_model_len
        self.sdpa_prefill = sdpa_prefill
        self._workspace: dict[torch.device, torch.Tensor] = {}
        self._retired: list[torch.Tensor] = []
        self._frozen = False

    def build_metadata(self, common: CommonAttentionMetadata) -> TritonAttentionMetadata:
        return TritonAttentionMetadata(common, uniform_query_len_of(common))

    # -- split-K workspace ------------------------------------------------------------------
    def _num_splits(
        self, num_reqs: int, num_kv_heads: int, max_seq_len: int, dev: torch.device
    ) -> int:
        bound = self.max_model_len if self.max_model_len is not None else max_seq_len
        return choose_num_splits(num_reqs, num_kv_heads, bound, num_sms(dev))

    def _get_workspace(self, numel: int, device: torch.device) -> torch.Tensor | None:
        if numel == 0:
            return None
        device = _normalize(device)
        buf = self._workspace.get(device)
        if buf is not None and buf.numel() >= numel:
            return buf[:numel]
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "the Triton decode workspace is too small for this captured batch; "
                "call TritonAttentionBackend.prepare_workspace(...) before capturing"
            )
        fresh = torch.empty(numel, dtype=torch.float32, device=device)
        if not self._frozen:  # grow; a frozen buffer stays (graphs hold its address)
            self._workspace[device] = fresh
        return fresh

    def prepare_for_capture(
        self,
        max_batch: int,
        query_len: int,
        layers: Sequence[nn.Module],
        device: torch.device,
        max_model_len: int,
    ) -> None:
        """Size the decode workspace for the group's layers (all have the same heads)."""
        a: Any = layers[0]
        self.prepare_workspace(
            max_batch, query_len, a.num_heads, a.num_kv_heads, a.head_dim, device, max_model_len
        )

    def prepare_workspace(
        self,
        max_batch: int,
        query_len: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device,
        max_model_len: int | None = None,
    ) -> None:
        """Size the decode workspace for every batch of 1..``max_batch`` requests of
        ``query_len`` tokens, then freeze it. Call it once per captured query length,
        all before the first capture. ``max_model_len`` fixes the split heuristic's
        context bound. A buffer replaced here is kept alive, never freed, in case a
        graph already holds its address."""
        if max_model_len is not None:
            self.max_model_len = max_model_len
        device = _normalize(device)
        need = 0
        for b in range(1, max_batch + 1):
            s = self._num_splits(b, num_kv_heads, self.max_model_len or 1 << 20, device)
            need = max(need, decode_workspace_numel(b * query_len, num_heads, head_dim, s))
        buf = self._workspace.get(device)
        if need > 0 and (buf is None or buf.numel() < need):
            if buf is not None:
                self._retired.append(buf)
            self._workspace[device] = torch.empty(need, dtype=torch.float32, device=device)
        self._frozen = True

    # -- forward ----------------------------------------------------------------------------
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: TritonAttentionMetadata | CommonAttentionMetadata,
        scale: float,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        rope: RopeInputs | None = None,
    ) -> torch.Tensor:
        md = (
            metadata
            if isinstance(metadata, TritonAttentionMetadata)
            else self.build_metadata(metadata)
        )
        c = md.common
        t = c.num_actual_tokens
        if rope is not None and rope.fused:  # kernels on: rotate and write in one launch
            r = rope.rope
            rope_write_kv(
                q, k, v, rope.positions, r.cos_cache, r.sin_cache, kv_cache,
                c.slot_mapping[:t], k_scale, v_scale,
            )  # fmt: skip
        else:
            if rope is not None:
                q, k = rope.rotate(q, k)
            write_kv_cache(k, v, kv_cache, c.slot_mapping[:t], k_scale, v_scale)
        ql = md.uniform_query_len
        lone_prompt = (ql is None and self.sdpa_prefill and c.num_reqs == 1
                       and c.max_seq_len == c.max_query_len == t)  # fmt: skip
        if lone_prompt:  # SDPA on this step's K/V: neither cache scale applies
            o = sdpa_prefill(q[:t], k[:t], v[:t], scale)
            if q.shape[0] == t:  # no padding rows: the output as it comes (its kernels
                # write [t, H, D] rows: no copy, 1.3 ms of an 8K llama-8b-shape prefill)
                return o.contiguous()
            out = torch.empty_like(q)
            out[:t] = o
            out[t:].zero_()  # graph padding: defined zeros
            return out
        out = torch.empty_like(q)
        if ql is not None:
            hkv = kv_cache.shape[-2]
            splits = self._num_splits(c.num_reqs, hkv, c.max_seq_len, q.device)
            numel = decode_workspace_numel(c.num_reqs * ql, q.shape[1], q.shape[2], splits)
            ws = self._get_workspace(numel, q.device)
            qk = scale * k_scale
            decode_attention(
                q, kv_cache, c.seq_lens, c.block_tables, qk, ql, c.num_reqs, splits, out, ws
            )
        else:
            prefill_attention(
                q,
                kv_cache,
                c.query_start_loc,
                c.seq_lens,
                c.block_tables,
                scale * k_scale,
                c.num_reqs,
                t,
                c.max_query_len,
                out,
            )
        if v_scale != 1.0:
            out[:t].mul_(v_scale)
        if q.shape[0] > t:  # graph padding: defined zeros, never stale memory
            out[t:].zero_()
        return out

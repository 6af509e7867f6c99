"""The runner's static input buffers: host staging (pinned on CUDA) and device pairs.

Every tensor a step's forward reads lives here at a fixed address, so CUDA graphs
captured over these buffers replay on new contents. Batch prep writes the host half
with numpy and uploads the used prefix with non-blocking copies; graph capture and
warm-up read and pad the device half. Nothing here knows about requests.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from pdserve.layers.attention import CommonAttentionMetadata


def upload(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """``a`` on ``device`` without making the host wait for the stream. A copy from
    pageable memory is staged by the driver and can wait for the work already queued
    (the step in flight, or a forward launched before deferred masks), which would undo
    async scheduling; from pinned memory it is a queued DMA (torch's caching host
    allocator keeps the pinned block until the copy has run)."""
    t = torch.from_numpy(np.ascontiguousarray(a))
    if device.type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


ALIGN_BYTES = 16  # where each packed segment starts (see BufferPair.upload_packed)
PACKED_SEGMENTS = 12  # InputBuffers.packed: six per-request arrays, six index arrays
PACK_SLACK = PACKED_SEGMENTS * ALIGN_BYTES // 8  # int64 elements the segments may pad
VIEW_CACHE = 256  # packed layouts whose views are kept


class BufferPair:
    """A host tensor and its device twin of the same shape."""

    def __init__(
        self, shape: int | tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> None:
        pin = device.type == "cuda"
        self.host = torch.zeros(shape, dtype=dtype, pin_memory=pin)
        self.dev = torch.zeros(shape, dtype=dtype, device=device)
        self.np: np.ndarray = self.host.numpy()
        self._views: dict[tuple[int, ...], list[torch.Tensor]] = {}  # upload_packed's

    def upload(self, n: int) -> torch.Tensor:
        """Copy the first ``n`` rows to the device (asynchronously); return the device view."""
        self.dev[:n].copy_(self.host[:n], non_blocking=True)
        return self.dev[:n]

    def upload_packed(self, parts: Sequence[np.ndarray]) -> list[torch.Tensor]:
        """Write ``parts`` one after another into the (1-D) host buffer, each from an
        ``ALIGN_BYTES`` boundary, upload them in one copy and return their device views.
        Triton specialises a pointer argument on whether it is 16-byte aligned, so a
        view at an odd int64 offset (an odd batch) would compile a kernel anew under
        traffic; aligned views keep the kernels the warm-up compiled."""
        a = max(1, ALIGN_BYTES // self.host.element_size())
        sizes: list[int] = []
        n = 0
        for p in parts:
            m = len(p)
            self.np[n : n + m] = p
            sizes += (m, -m % a)  # the segment, then its padding to the next boundary
            n += m + sizes[-1]
        self.upload(n)
        # the views of a layout are made once: steps of one batch repeat it, and a split
        # costs the host more than the copy
        key = tuple(sizes)
        views = self._views.get(key)
        if views is None:
            if len(self._views) >= VIEW_CACHE:
                self._views.clear()
            views = self._views[key] = list(self.dev[:n].split(sizes)[::2])
        return views


class InputBuffers:
    """Sized for ``max_num_tokens`` tokens of ``max_num_reqs`` requests, each with up to
    ``max_blocks`` blocks and ``num_spec`` drafts."""

    def __init__(
        self,
        max_num_tokens: int,
        max_num_reqs: int,
        max_blocks: int,
        block_size: int,
        max_model_len: int,
        num_spec: int,
        device: torch.device,
    ) -> None:
        t, r = max_num_tokens, max_num_reqs
        self.device = device
        self.max_num_tokens = t
        self.max_num_reqs = r
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.num_spec = num_spec
        i64, i32 = torch.int64, torch.int32
        self.input_ids = BufferPair(t, i64, device)
        self.positions = BufferPair(t, i64, device)
        self.slots = BufferPair(t, i64, device)
        self.req_idx = BufferPair(t, i64, device)
        self.q_idx = BufferPair(t, i64, device)
        self.query_start_loc = BufferPair(r + 1, i32, device)
        self.seq_lens = BufferPair(r, i32, device)
        self.block_tables = BufferPair((r, max_blocks), i32, device)
        self.logits_idx = BufferPair(t, i64, device)
        # draft ids of each request this step (-1: none or a placeholder; on the host -1
        # is one the device holds, -2 none)
        self.drafts = BufferPair((r, max(num_spec, 1)), i64, device)
        self.samples = BufferPair(r, torch.bool, device)  # per request: it samples this step
        # one upload of the step's small arrays (see StepPreparer.prepare): six per
        # request, then the request state's reset and read indices (two per new request,
        # four per token at most)
        self.packed = BufferPair(8 * r + 4 * t + PACK_SLACK, i64, device)

    def common_metadata(
        self, num_reqs: int, num_tokens: int, max_query_len: int, max_seq_len: int
    ) -> CommonAttentionMetadata:
        """Metadata viewing the device buffers' first ``num_reqs`` / ``num_tokens`` rows."""
        return CommonAttentionMetadata(
            num_reqs=num_reqs,
            num_actual_tokens=num_tokens,
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            block_size=self.block_size,
            query_start_loc=self.query_start_loc.dev[: num_reqs + 1],
            seq_lens=self.seq_lens.dev[:num_reqs],
            block_tables=self.block_tables.dev[:num_reqs],
            slot_mapping=self.slots.dev[:num_tokens],
            token_req_idx=self.req_idx.dev[:num_tokens],
            token_q_idx=self.q_idx.dev[:num_tokens],
        )

    def fill_padding(self, num_reqs: int, num_tokens: int, padded: int, q_len: int) -> None:
        """Write dummy requests ``num_reqs..padded`` of ``q_len`` tokens each (host, then
        device). Dummies live on the null block (block 0): their tokens write slot 0,
        their block-table rows are 0 and their context is ``q_len`` tokens of that block,
        so they read only memory nothing real uses; their outputs are dropped."""
        pt = padded * q_len
        if padded > num_reqs:
            extra = padded - num_reqs
            qsl = self.query_start_loc.np
            qsl[num_reqs + 1 : padded + 1] = num_tokens + q_len * np.arange(1, extra + 1)
            self.seq_lens.np[num_reqs:padded] = q_len
            nblk = -(-q_len // self.block_size)
            self.block_tables.np[num_reqs:padded, :nblk] = 0
            self.drafts.np[num_reqs:padded] = -1
            for pair, lo, hi in (
                (self.query_start_loc, num_reqs + 1, padded + 1),
                (self.seq_lens, num_reqs, padded),
                (self.drafts, num_reqs, padded),
            ):
                pair.dev[lo:hi].copy_(pair.host[lo:hi], non_blocking=True)
            bt = self.block_tables
            bt.dev[num_reqs:padded, :nblk].copy_(bt.host[num_reqs:padded, :nblk], non_blocking=True)
        if pt > num_tokens:
            for pair in (self.input_ids, self.slots):
                pair.np[num_tokens:pt] = 0
            self.positions.np[num_tokens:pt] = np.tile(np.arange(q_len), (pt - num_tokens) // q_len)
            self.req_idx.np[num_tokens:pt] = np.repeat(np.arange(num_reqs, padded), q_len)
            self.q_idx.np[num_tokens:pt] = self.positions.np[num_tokens:pt]
            for pair in (self.input_ids, self.slots, self.positions, self.req_idx, self.q_idx):
                pair.dev[num_tokens:pt].copy_(pair.host[num_tokens:pt], non_blocking=True)

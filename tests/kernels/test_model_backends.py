"""The tiny Llama gives the same logits with the Triton and the torch attention backend
over a prefill, a mixed step and uniform decode steps that reuse the cache."""

from __future__ import annotations

from pathlib import Path

import torch

from _attn_helper import model_caches
from pdserve.forward_context import set_forward_context
from pdserve.layers.attention.backend import AttentionBackend, CommonAttentionMetadata
from pdserve.layers.attention.torch_ref import TorchReferenceBackend
from pdserve.layers.attention.triton_backend import TritonAttentionBackend
from pdserve.models import load_model

BLOCK = 16


def _metadata(
    computed: list[int], new: list[int], bt: torch.Tensor, dev: torch.device
) -> CommonAttentionMetadata:
    seq = [c + n for c, n in zip(computed, new, strict=True)]
    qsl, slots, req_idx, q_idx = [0], [], [], []
    for b, (c, n) in enumerate(zip(computed, new, strict=True)):
        qsl.append(qsl[-1] + n)
        for i in range(n):
            pos = c + i
            slots.append(int(bt[b, pos // BLOCK]) * BLOCK + pos % BLOCK)
            req_idx.append(b)
            q_idx.append(i)

    def t(x: list[int], dt: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.tensor(x, dtype=dt, device=dev)

    return CommonAttentionMetadata(
        num_reqs=len(new),
        num_actual_tokens=qsl[-1],
        max_query_len=max(new),
        max_seq_len=max(seq),
        block_size=BLOCK,
        query_start_loc=t(qsl, torch.int32),
        seq_lens=t(seq, torch.int32),
        block_tables=bt,
        slot_mapping=t(slots),
        token_req_idx=t(req_idx),
        token_q_idx=t(q_idx),
    )


def test_tiny_llama_backends_agree(tiny_llama: Path, device: torch.device) -> None:
    model, cfg = load_model(tiny_llama, "float32", device)
    bt = (1 + torch.randperm(12, generator=torch.Generator().manual_seed(0))).view(3, 4)
    bt = bt.to(torch.int32).to(device)
    g = torch.Generator().manual_seed(1)
    backends: list[AttentionBackend] = [TorchReferenceBackend(), TritonAttentionBackend()]
    caches = {id(be): model_caches(model, 13, BLOCK) for be in backends}
    computed = [0, 0, 0]
    # prompts, then a mixed step (one chunk + two decodes), then two uniform decode steps
    for new in ([9, 20, 3], [1, 12, 1], [1, 1, 1], [1, 1, 1]):
        ids = torch.randint(0, cfg.vocab_size, (sum(new),), generator=g).to(device)
        pos = torch.cat([torch.arange(c, c + n) for c, n in zip(computed, new, strict=True)])
        md = _metadata(computed, new, bt, device)
        logits = []
        for be in backends:
            ctx = set_forward_context({"attn": be}, {"attn": be.build_metadata(md)}, caches[id(be)])
            with torch.no_grad(), ctx:
                logits.append(model.compute_logits(model(ids, pos.to(device))))
        torch.testing.assert_close(logits[1], logits[0], atol=1e-4, rtol=1e-4)
        computed = [c + n for c, n in zip(computed, new, strict=True)]

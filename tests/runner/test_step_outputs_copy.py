"""copy_out's host views: contiguous whatever the step's width, so a device-to-host copy
into them is a plain asynchronous memcpy (a strided destination made the copy wait for
the device: every MTP step narrower than 1 + k drafts ran synchronously, issue 27)."""

from __future__ import annotations

import torch

from pdserve.runner.step_outputs import HostOutputs, copy_out


def test_views_are_contiguous_and_hold_the_values_at_every_width() -> None:
    host = HostOutputs(max_reqs=8, width=4, pin=False)  # k = 3 drafts
    for w in (1, 2, 4):
        tokens = torch.arange(5 * w).view(5, w)
        lp = -torch.rand(5, w)
        drafts = torch.arange(15).view(5, 3) + 100
        top = (torch.arange(5 * w * 2).view(5, w, 2), torch.rand(5, w, 2))
        c = copy_out(host, tokens, torch.full((5,), w), lp, drafts, top, None, 64)
        assert c.logprobs is not None and c.drafts is not None and c.top is not None
        views = (c.tokens, c.logprobs, c.drafts, *c.top)
        assert all(v.is_contiguous() for v in views)
        for v, src in zip(views, (tokens, lp, drafts, *top), strict=True):
            assert v.shape == src.shape and torch.equal(v, src)
            slots = (host.tokens, host.logprobs, host.drafts, host.top_ids, host.top_lps)
            assert v.data_ptr() in {b.data_ptr() for b in slots}  # the slot's own memory

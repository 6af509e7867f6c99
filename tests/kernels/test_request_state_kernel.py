"""The one-launch ``post_update`` equals :class:`RequestState`'s torch op chain: plain
decode, verify steps with and without drafts proposed, rows that sampled nothing (their
writes go to the scratch row), and every column the state keeps."""

from __future__ import annotations

import pytest
import torch

from pdserve.runner.request_state import RequestState

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
R, S = 8, 3  # rows, speculative tokens


def _state(drafting: bool, seed: int, device: torch.device, fused: bool) -> RequestState:
    st = RequestState(R, S, device, drafting)
    st.fused = fused
    g = torch.Generator().manual_seed(seed)
    for t in (st.last_token, st.sampled, st.num_sampled, st.drafts, st.num_computed):
        t.copy_(torch.randint(0, 50, t.shape, generator=g))
    return st


def _case(kind: str, seed: int) -> dict[str, torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed)
    rows = torch.tensor([5, 0, 3, 7, 2])
    n = rows.shape[0]
    samples = torch.tensor([True, False, True, True, True])
    nsched = torch.randint(1, 5, (n,), generator=g)
    if kind == "plain":
        tokens = torch.randint(0, 100, (n, 1), generator=g)
        return dict(rows=rows, nsched=nsched, num_rows=None, samples=samples, tokens=tokens,
                    num=None, drafts=None)  # fmt: skip
    w = S + 1
    num = torch.randint(1, w + 1, (n,), generator=g)
    tokens = torch.randint(0, 100, (n, w), generator=g)
    tokens[torch.arange(w)[None, :] >= num[:, None]] = -1
    num_rows = torch.maximum(num, torch.randint(1, w + 1, (n,), generator=g))
    drafts = torch.randint(0, 100, (n, S + 1), generator=g) if kind == "drafts" else None
    return dict(rows=rows, nsched=nsched, num_rows=num_rows, samples=samples, tokens=tokens,
                num=num, drafts=drafts)  # fmt: skip


@pytest.mark.parametrize(("kind", "drafting"), [("plain", False), ("plain", True),
                                                ("verify", True), ("drafts", True)])  # fmt: skip
def test_one_launch_post_update_equals_the_torch_ops(kind: str, drafting: bool) -> None:
    case = _case(kind, 3)
    want = _state(drafting, 1, torch.device("cpu"), fused=False)  # the torch op chain
    want.post_update(**case)  # type: ignore[arg-type]
    got = _state(drafting, 1, DEV, fused=True)  # kernels.request_state.post_update
    got.post_update(**{k: (v.to(DEV) if v is not None else None) for k, v in case.items()})  # type: ignore[arg-type]
    for name in ("last_token", "sampled", "num_sampled", "drafts", "num_computed"):
        # the scratch row (R) is written by every row that sampled nothing: unread
        t, ref = getattr(got, name).cpu()[:R], getattr(want, name)[:R]
        assert torch.equal(t, ref), (name, t, ref)

"""The one-launch ``post_update`` equals :class:`RequestState`'s torch op chain: plain
decode, verify steps with and without drafts proposed, rows that sampled nothing (their
writes go to the scratch row), and every column the state keeps."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pdserve.runner.input_buffers import InputBuffers
from pdserve.runner.request_state import RequestState, draft_slots

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


@pytest.mark.parametrize("kind", ["plain", "verify", "drafts"])
def test_one_launch_post_update_equals_the_torch_ops(kind: str) -> None:
    case = _case(kind, 3)
    want = _state(True, 1, torch.device("cpu"), fused=False)  # the torch op chain
    want.post_update(**case)  # type: ignore[arg-type]
    got = _state(True, 1, DEV, fused=True)  # kernels.request_state.post_update
    got.post_update(**{k: (v.to(DEV) if v is not None else None) for k, v in case.items()})  # type: ignore[arg-type]
    for name in ("last_token", "sampled", "num_sampled", "drafts", "num_computed"):
        # the scratch row (R) is written by every row that sampled nothing: unread
        t, ref = getattr(got, name).cpu()[:R], getattr(want, name)[:R]
        assert torch.equal(t, ref), (name, t, ref)


def _placed(device: torch.device, fused: bool, drafting: bool) -> dict[str, list]:
    """Rows 5 and 2 verify drafts the host does not know (-1; row 2 has one slot it
    does not use, -2), row 7 decodes one token; the state as a verify step left it."""
    st = _state(drafting, 4, device, fused)
    st.last_token[:R] = torch.arange(100, 100 + R)
    st.drafts[:R] = torch.arange(R * S).view(R, S) + 200
    st.drafts[2, 0] = -1  # row 2 proposed no first draft: its slot is fed token 0
    st.num_computed[:R] = torch.tensor([3, 9, 17, 0, 4, 6, 2, 11])
    buf = InputBuffers(32, 4, R, 4, 32, S, device)
    nsched, ndraft = np.array([3, 2, 1]), np.array([2, 1, 0])
    req_idx, q_idx = np.array([0, 0, 0, 1, 1, 2]), np.array([0, 1, 2, 0, 1, 0])
    _, at, flat = draft_slots(q_idx, req_idx, nsched, ndraft, S)
    buf.req_idx.dev[:6] = torch.from_numpy(req_idx)
    buf.q_idx.dev[:6] = torch.from_numpy(q_idx)
    buf.block_tables.dev[:3, :8] = torch.arange(24, dtype=torch.int32).view(3, 8) + 40
    drafts = buf.drafts.dev[:3]
    drafts[:] = torch.tensor([[-1, -1, -2], [-1, -2, -2], [-2, -2, -2]])
    last = [0, 3, 5]  # each request's first token: its last sampled one
    st.place(
        buf, torch.tensor([5, 2, 7], device=device), torch.from_numpy(nsched).to(device), 6,
        torch.tensor(last, device=device), torch.tensor([0, 1, 2], device=device), drafts,
        torch.from_numpy(at).to(device), torch.from_numpy(flat).to(device),
    )  # fmt: skip
    out = {"ids": buf.input_ids.dev[:6], "drafts": drafts}
    if drafting:
        out |= {"pos": buf.positions.dev[:6], "seq": buf.seq_lens.dev[:3],
                "slots": buf.slots.dev[:6]}  # fmt: skip
    return {k: v.cpu().tolist() for k, v in out.items()}


@pytest.mark.parametrize("drafting", [True, False])
def test_fused_place_equals_the_torch_ops(drafting: bool) -> None:
    want = _placed(torch.device("cpu"), False, drafting)
    got = _placed(DEV, True, drafting)
    assert got == want
    assert want["ids"][:5] == [105, 215, 216, 102, 0] and want["drafts"][2] == [-1, -1, -1]

"""The request state on the device: ``post_update`` records a step per row, ``place``
fills the next step's inputs from it (last tokens, drafts, positions moved back by the
rejected drafts), a reset row keeps nothing of its previous owner, and the unlanded
outputs the penalties count are the accepted drafts the host has not seen."""

from __future__ import annotations

import torch

from pdserve.runner.input_buffers import InputBuffers
from pdserve.runner.request_state import RequestState, draft_slots

DEV = torch.device("cpu")
i64 = torch.int64


def _t(*x: int) -> torch.Tensor:
    return torch.tensor(x, dtype=i64)


def _verify_step(state: RequestState) -> None:
    """Rows 0 and 1 verify 2 drafts each (3 tokens); row 0 accepts both, row 1 none;
    row 2 is a prompt chunk of 4 tokens that samples nothing."""
    state.reset(_t(0, 1, 2), _t(5, 7, 0))
    state.post_update(
        rows=_t(0, 1, 2),
        nsched=_t(3, 3, 4),
        num_rows=_t(3, 3, 1),
        samples=torch.tensor([True, True, False]),
        tokens=torch.tensor([[10, 11, 12], [20, -1, -1], [99, -1, -1]]),
        num=_t(3, 1, 1),
        drafts=torch.tensor([[30, 31], [40, -1], [98, 98]]),
    )


def test_post_update_records_each_row() -> None:
    state = RequestState(4, 2, DEV, drafting=True)
    _verify_step(state)
    assert state.last_token[:2].tolist() == [12, 20]
    assert state.num_computed[:3].tolist() == [8, 8, 4]  # 5+3, 7+3-2 rejected, 0+4
    assert state.num_sampled[:3].tolist() == [3, 1, 0]
    assert state.drafts[:3].tolist() == [[30, 31], [40, -1], [-1, -1]]  # row 2 sampled none
    state.reset(_t(1), _t(2))  # row 1 handed to a new request
    assert state.num_computed[1] == 2 and state.num_sampled[1] == 0
    assert state.drafts[1].tolist() == [-1, -1]
    assert state.num_computed[0] == 8 and state.last_token[0] == 12  # others untouched


def test_place_reads_the_state_into_the_next_step() -> None:
    state = RequestState(4, 2, DEV, drafting=True)
    _verify_step(state)
    buf = InputBuffers(32, 4, 8, 4, 32, 2, DEV)
    # next step: rows 0 and 1 verify 2 drafts the host does not know (-1); the host
    # placed them at its own counts (row 1 two positions ahead: its rejected drafts)
    nsched, ndraft = torch.tensor([3, 3]).numpy(), torch.tensor([2, 2]).numpy()
    req_idx = torch.tensor([0, 0, 0, 1, 1, 1]).numpy()
    q_idx = torch.tensor([0, 1, 2, 0, 1, 2]).numpy()
    _, at, flat = draft_slots(q_idx, req_idx, nsched, ndraft, 2)
    buf.req_idx.dev[:6] = torch.from_numpy(req_idx)
    buf.q_idx.dev[:6] = torch.from_numpy(q_idx)
    buf.block_tables.dev[:2, :4] = torch.tensor([[3, 4, 5, 6], [7, 8, 9, 10]])
    drafts = buf.drafts.dev[:2]
    drafts[:] = -1
    state.place(
        buf, _t(0, 1), _t(3, 3), 6, _t(0, 3), _t(0, 1), drafts,
        torch.from_numpy(at), torch.from_numpy(flat),
    )  # fmt: skip
    assert buf.input_ids.dev[:6].tolist() == [12, 30, 31, 20, 40, 0]  # -1: a placeholder 0
    assert drafts.tolist() == [[30, 31], [40, -1]]
    assert buf.positions.dev[:6].tolist() == [8, 9, 10, 8, 9, 10]
    assert buf.seq_lens.dev[:2].tolist() == [11, 11]
    assert buf.slots.dev[:6].tolist() == [
        5 * 4 + 0,
        5 * 4 + 1,
        5 * 4 + 2,
        9 * 4,
        9 * 4 + 1,
        9 * 4 + 2,
    ]


def test_unlanded_outputs_are_the_accepted_drafts_the_host_lacks() -> None:
    state = RequestState(4, 2, DEV, drafting=True)
    _verify_step(state)
    # row 0 accepted 10, 11 (drafts) and 12 at positions 6, 7, 8 (12: the next input)
    got = state.unlanded_outputs(_t(0, 1), host_count=_t(6, 8))
    assert got is not None
    toks, weight = got
    assert (toks * weight.to(i64)).tolist() == [[10, 11, 0], [0, 0, 0]]
    assert weight.sum().item() == 2
    landed = state.unlanded_outputs(_t(0), host_count=_t(9))
    assert landed is not None and landed[1].sum().item() == 0
    assert RequestState(4, 0, DEV, drafting=False).unlanded_outputs(_t(0), _t(0)) is None

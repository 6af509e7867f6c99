"""benchmarks/_mla_probe.py on the CPU: the spy keeps the operands of the chosen call as
they were before it ran (clones, so the call's own writes do not show), puts the method
back, and the lone timing reports the call's pairs and FLOPs."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import _mla_probe  # noqa: E402


class Backend:
    def __init__(self) -> None:
        self.calls = 0

    def _prefill(self, q_lat, q_pe, cache, rows, ncand, scale, t, out):
        self.calls += 1
        out[:t] = q_lat[:t] * scale  # writes its output, as the kernel does
        q_lat.add_(1.0)  # (a write to an operand: the capture must not see it)


def test_capture_keeps_the_chosen_calls_operands_and_restores_the_method() -> None:
    be = Backend()
    orig = Backend._prefill
    q_lat, q_pe = torch.zeros(5, 4, 8), torch.zeros(5, 4, 2)
    ncand = torch.tensor([1, 2, 3, 3, 3])
    cache, rows, out = torch.zeros(2, 4, 10), torch.zeros(5, 3), torch.zeros(5, 4, 8)
    args = (q_lat, q_pe, cache, rows, ncand, 0.5, 4, out)

    def run() -> None:  # three layers
        for _ in range(3):
            be._prefill(*args)

    got = _mla_probe.capture(Backend, run, call=1)
    assert Backend._prefill is orig and be.calls == 3
    assert got is not None and got[0] is be
    assert torch.equal(got[1][0], torch.ones(5, 4, 8))  # as call 1 saw it (after call 0's write)
    assert got[1][0].data_ptr() != q_lat.data_ptr() and got[1][5:7] == (0.5, 4)
    assert _mla_probe.capture(Backend, run, call=3) is None  # only three calls
    r = _mla_probe.time_alone(*got)
    assert r["ms"] > 0 and r["pairs"] == 1 + 2 + 3 + 3  # the first t = 4 tokens
    assert r["flop"] == 2 * 9 * 4 * (2 * 8 + 2)

"""A landed step's device time (``StepPipeline._device_time``): from its start event, or
the previous step's end if that was later, to its end."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pdserve.runner.step_pipeline import StepPipeline


class FakeEvent:
    """A CUDA event at a fixed device time (ms)."""

    def __init__(self, at_ms: float) -> None:
        self.at = at_ms

    def elapsed_time(self, end: FakeEvent) -> float:
        return end.at - self.at


def test_device_time_counts_only_the_steps_own_time() -> None:
    pipe = SimpleNamespace(_last_done=None)
    timed = StepPipeline._device_time
    # alone: start to end
    assert timed(pipe, FakeEvent(0.0), FakeEvent(10.0)) == pytest.approx(0.010)  # type: ignore[arg-type]
    # launched while that one ran: it starts on the device when that one ends
    assert timed(pipe, FakeEvent(5.0), FakeEvent(18.0)) == pytest.approx(0.008)  # type: ignore[arg-type]
    # launched after an idle gap: from its own start
    assert timed(pipe, FakeEvent(100.0), FakeEvent(107.0)) == pytest.approx(0.007)  # type: ignore[arg-type]
    assert pipe._last_done.at == 107.0

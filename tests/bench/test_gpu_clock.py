"""benchmarks/_gpu_clock.py: the sampler's summary from stand-in NVML readings (the
median and extremes of the clock and power it read), and on a CPU device it samples
nothing and says why."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import _gpu_clock  # noqa: E402


class _FakeNvml:
    def __init__(self) -> None:
        self.reads = 0

    def sm_mhz(self) -> int:
        self.reads += 1
        return 1980 if self.reads % 2 else 1700

    def power_w(self) -> float:
        return 650.0


def test_summary_of_sampled_readings() -> None:
    clk = _gpu_clock.ClockSampler(torch.device("cpu"), period=0.001)
    clk._nvml = _FakeNvml()  # type: ignore[assignment]  # the thread reads through it
    with clk:
        deadline = time.monotonic() + 5
        while len(clk.samples) < 4 and time.monotonic() < deadline:
            time.sleep(0.002)
    s = clk.summary()
    assert s["samples"] >= 4 and s["sm_mhz_min"] == 1700 and s["sm_mhz_max"] == 1980
    assert 1700 <= s["sm_mhz_median"] <= 1980 and s["power_w_median"] == s["power_w_max"] == 650.0


def test_cpu_device_samples_nothing() -> None:
    with _gpu_clock.ClockSampler(torch.device("cpu")) as clk:
        pass
    assert clk.samples == [] and clk.summary() == {"nvml": "no NVML for a cpu device"}

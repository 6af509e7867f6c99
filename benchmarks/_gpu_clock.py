"""The GPU's SM clock and power draw while a piece of work runs, read from NVML (the
driver's library, through ctypes: no Python package needed) by a sampling thread.

Issue 26's sparse MLA kernel ran 11% slower a layer inside the model's 16K prefill than
alone on the same operands (RESULTS.md runs 65, 71, 79). Kernels ran one after another
(their sum equals the span) and the alone timing starts from a flushed L2, so neither
overlap nor cache contents explain it; a clock held lower under the prefill's sustained
tensor-core load would. :class:`ClockSampler` records what the clock was in each.

    with ClockSampler(torch.device("cuda")) as clk:
        work()
    clk.summary()  # {"sm_mhz_median": ..., "sm_mhz_min": ..., "power_w_median": ..., ...}

Where NVML does not load (no driver: the CPU tests) the summary is ``{"nvml": "..."}``
saying why, and nothing is sampled.
"""

from __future__ import annotations

import ctypes
import statistics
import threading
import time
from typing import Any

import torch

_NVML_CLOCK_SM = 1


class _Nvml:
    """The few NVML calls used here, for one GPU found by its UUID."""

    def __init__(self, uuid: str) -> None:
        self.lib = ctypes.CDLL("libnvidia-ml.so.1")
        self._check(self.lib.nvmlInit_v2(), "nvmlInit")
        self.handle = ctypes.c_void_p()
        uid = uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
        self._check(
            self.lib.nvmlDeviceGetHandleByUUID(uid.encode(), ctypes.byref(self.handle)),
            "nvmlDeviceGetHandleByUUID",
        )

    @staticmethod
    def _check(rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"{what} returned NVML error {rc}")

    def sm_mhz(self) -> int:
        v = ctypes.c_uint()
        self._check(
            self.lib.nvmlDeviceGetClockInfo(self.handle, _NVML_CLOCK_SM, ctypes.byref(v)),
            "nvmlDeviceGetClockInfo",
        )
        return int(v.value)

    def power_w(self) -> float:
        v = ctypes.c_uint()
        self._check(
            self.lib.nvmlDeviceGetPowerUsage(self.handle, ctypes.byref(v)), "nvmlDeviceGetPowerUsage"
        )
        return v.value / 1000.0  # milliwatts


class ClockSampler:
    """Samples the SM clock (MHz) and power (W) of ``device`` every ``period`` seconds
    between ``__enter__`` and ``__exit__``."""

    def __init__(self, device: torch.device, period: float = 0.002) -> None:
        self.period = period
        self.samples: list[tuple[float, int, float]] = []  # (seconds, MHz, W)
        self.why = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._nvml: _Nvml | None = None
        if device.type != "cuda":
            self.why = f"no NVML for a {device.type} device"
            return
        try:
            self._nvml = _Nvml(str(torch.cuda.get_device_properties(device).uuid))
        except (OSError, RuntimeError, AttributeError) as e:
            self.why = f"NVML unavailable: {e}"

    def __enter__(self) -> ClockSampler:
        if self._nvml is not None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        assert self._nvml is not None
        t0 = time.perf_counter()
        while not self._stop.is_set():
            try:
                self.samples.append(
                    (time.perf_counter() - t0, self._nvml.sm_mhz(), self._nvml.power_w())
                )
            except RuntimeError as e:
                self.why = str(e)
                return
            time.sleep(self.period)

    def summary(self) -> dict[str, Any]:
        """Median and lowest SM clock, median and highest power over the samples."""
        if not self.samples:
            return {"nvml": self.why or "no samples"}
        mhz = [s[1] for s in self.samples]
        watts = [s[2] for s in self.samples]
        return {
            "samples": len(self.samples),
            "sm_mhz_median": statistics.median(mhz),
            "sm_mhz_min": min(mhz),
            "sm_mhz_max": max(mhz),
            "power_w_median": statistics.median(watts),
            "power_w_max": max(watts),
        }


def sustained_matmul(device: torch.device, seconds: float, m: int) -> dict[str, Any]:
    """bf16 ``m``^3 matmuls back to back for ``seconds``, as long as a long prefill keeps
    the tensor cores busy: FLOP/s over the second half (a card held at its power cap has
    lowered its clock by then), with the clock and power while they ran. The matmul rate
    measured in short bursts (``gpu_suite.measure_limits``) runs at the boost clock; this
    is the rate the same card sustains under the power draw of the work it is compared
    with."""
    a = torch.randn(m, m, dtype=torch.bfloat16, device=device)
    b = torch.randn(m, m, dtype=torch.bfloat16, device=device)
    cuda = device.type == "cuda"
    batch = 20 if cuda else 2
    samples: list[tuple[float, float]] = []  # (seconds since the start, FLOP/s)
    with ClockSampler(device) as clock:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            if cuda:
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                for _ in range(batch):
                    a @ b
                e.record()
                e.synchronize()
                dt = s.elapsed_time(e) * 1e-3
            else:
                t1 = time.perf_counter()
                for _ in range(batch):
                    a @ b
                dt = time.perf_counter() - t1
            samples.append((time.perf_counter() - t0, batch * 2 * m**3 / dt))
    late = [f for t, f in samples if t >= seconds / 2] or [samples[-1][1]]
    return {"flops": statistics.median(late), "seconds": seconds, "m": m,
            "samples": len(samples), "clock": clock.summary()}  # fmt: skip

"""The observer of a host without NVML: no GPUs, no readings, empty windows."""
from __future__ import annotations

import time

from services.measurer.observers.inventory import GpuInfo
from services.measurer.observers.base import DeviceSample, Observer, WindowStats


class NullObserver(Observer):
    def __init__(self, reason: str = "no NVML", interval_ms: int = 50):
        super().__init__(interval_ms)
        self.reason = reason  # why this host is observed by nothing (shown in logs and lane info)
        self._t0: float | None = None
        self._uuid: str | None = None

    def inventory(self) -> list[GpuInfo]:
        return []

    def sample(self, uuid: str) -> DeviceSample | None:
        return None

    def start_window(self, uuid: str, interval_ms: int | None = None) -> None:
        if self._t0 is not None:
            raise RuntimeError(f"a window on {self._uuid} is already open; stop it first")
        self._t0, self._uuid = time.monotonic(), uuid

    def stop_window(self) -> WindowStats:
        if self._t0 is None:
            raise RuntimeError("no window is open")
        duration = time.monotonic() - self._t0
        uuid, self._t0, self._uuid = self._uuid, None, None
        return WindowStats.from_samples(uuid, [], duration)

    def close(self) -> None:
        self._t0 = self._uuid = None

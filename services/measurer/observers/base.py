"""What an observer is: the GPUs of this host, one reading of a GPU, and a window of readings taken in
the background while something runs (Kernel Tuner's observer idea). Pure Python, no NVML here."""
from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass, field

from services.measurer.observers.inventory import GpuInfo

DEFAULT_INTERVAL_MS = 50


@dataclass(frozen=True)
class DeviceSample:
    """One reading of one GPU. A field is None when the GPU does not report it."""

    uuid: str
    name: str
    sm_clock_mhz: int | None = None
    mem_clock_mhz: int | None = None
    utilization_gpu_pct: int | None = None
    memory_used_mb: int | None = None
    memory_total_mb: int | None = None
    temperature_c: int | None = None
    power_w: float | None = None
    timestamp: float = field(default_factory=time.time)

    def to_dict(self) -> dict:
        return asdict(self)


def _mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


@dataclass(frozen=True)
class WindowStats:
    """The readings of one window and their summary. busy_fraction = mean(utilization) / 100; every
    summary is None when no reading had the field (no GPU, NullObserver)."""

    uuid: str | None
    samples: list[DeviceSample]
    busy_fraction: float | None
    mean_sm_clock_mhz: float | None
    max_temperature_c: int | None
    duration_s: float = 0.0
    errors: int = 0  # readings that failed during the window

    @classmethod
    def from_samples(cls, uuid: str | None, samples: list[DeviceSample], duration_s: float = 0.0,
                     errors: int = 0) -> "WindowStats":
        util = _mean([s.utilization_gpu_pct for s in samples])
        temps = [s.temperature_c for s in samples if s.temperature_c is not None]
        return cls(
            uuid=uuid,
            samples=list(samples),
            busy_fraction=None if util is None else util / 100.0,
            mean_sm_clock_mhz=_mean([s.sm_clock_mhz for s in samples]),
            max_temperature_c=max(temps) if temps else None,
            duration_s=duration_s,
            errors=errors,
        )

    def summary(self) -> dict:
        """The window without its samples: what a measurement result carries."""
        return {
            "uuid": self.uuid,
            "n_samples": len(self.samples),
            "busy_fraction": self.busy_fraction,
            "mean_sm_clock_mhz": self.mean_sm_clock_mhz,
            "max_temperature_c": self.max_temperature_c,
            "duration_s": self.duration_s,
            "errors": self.errors,
        }

    def to_dict(self) -> dict:
        return {**self.summary(), "samples": [s.to_dict() for s in self.samples]}


class _Window:
    """Samples one GPU every interval in a daemon thread, from start until stop."""

    def __init__(self, observer: "Observer", uuid: str, interval_s: float):
        self.observer, self.uuid, self.interval_s = observer, uuid, interval_s
        self.samples: list[DeviceSample] = []
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"observer-window-{uuid}", daemon=True)
        self._t0 = time.monotonic()
        self._thread.start()

    def _take(self) -> None:
        try:
            s = self.observer.sample(self.uuid)
        except Exception:  # a failed reading must not end the window, nor the measurement it watches
            self.errors += 1
            return
        if s is not None:
            self.samples.append(s)

    def _loop(self) -> None:
        while True:
            self._take()
            if self._stop.wait(self.interval_s):
                return

    def stop(self) -> WindowStats:
        self._stop.set()
        self._thread.join()
        self._take()  # a last reading covers the end of the window (NVML averages over its past period)
        return WindowStats.from_samples(self.uuid, self.samples, time.monotonic() - self._t0, self.errors)


class Observer:
    """Hardware observer of this host's GPUs. Subclasses give ``inventory`` and ``sample``; windows come
    from here. One window at a time per observer (a lane measures one candidate at a time)."""

    def __init__(self, interval_ms: int = DEFAULT_INTERVAL_MS):
        if interval_ms <= 0:
            raise ValueError(f"sampling interval must be positive, not {interval_ms} ms")
        self.interval_ms = interval_ms
        self._window: _Window | None = None

    def inventory(self) -> list[GpuInfo]:
        raise NotImplementedError

    def sample(self, uuid: str) -> DeviceSample | None:
        raise NotImplementedError

    def start_window(self, uuid: str, interval_ms: int | None = None) -> None:
        if self._window is not None:
            raise RuntimeError(f"a window on {self._window.uuid} is already open; stop it first")
        interval = (interval_ms or self.interval_ms) / 1000.0
        self._window = _Window(self, uuid, interval)

    def stop_window(self) -> WindowStats:
        if self._window is None:
            raise RuntimeError("no window is open")
        window, self._window = self._window, None
        return window.stop()

    def close(self) -> None:
        if self._window is not None:
            self.stop_window()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

"""Hardware observers: the GPUs of this host and what they do while a lane measures.

``make_observer()`` gives an NvmlObserver where NVML works and a NullObserver elsewhere."""
from services.measurer.observers.inventory import GpuInfo
from services.measurer.observers.base import DEFAULT_INTERVAL_MS, DeviceSample, Observer, WindowStats
from services.measurer.observers.null import NullObserver
from services.measurer.observers.nvml import NvmlObserver, make_observer

__all__ = [
    "DEFAULT_INTERVAL_MS",
    "DeviceSample",
    "GpuInfo",
    "NullObserver",
    "NvmlObserver",
    "Observer",
    "WindowStats",
    "make_observer",
]

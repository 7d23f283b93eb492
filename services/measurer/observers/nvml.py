"""The observer of NVIDIA GPUs through NVML (package nvidia-ml-py, module ``pynvml``).

The module is a constructor argument, so tests pass a recorded fake. Every reading that a GPU may not
support (clocks, utilization, temperature, power, compute capability, SM count) is guarded: it becomes
None instead of failing the sample. Indices are NVML's (PCI order); lanes name GPUs by UUID.
"""
from __future__ import annotations

import importlib
import logging
from typing import Any, Callable

from services.measurer.observers.inventory import GpuInfo
from services.measurer.observers.base import DEFAULT_INTERVAL_MS, DeviceSample, Observer
from services.measurer.observers.null import NullObserver
from shared.errors import LaneError
from shared.ids import gpu_hex as _hex

log = logging.getLogger(__name__)

MIB = 1 << 20

# FP32 cores per SM by compute capability: NVML reports cores, not SMs, on a whole (non-MIG) GPU.
_CORES_PER_SM = {
    (6, 0): 64, (6, 1): 128, (6, 2): 128,
    (7, 0): 64, (7, 2): 64, (7, 5): 64,
    (8, 0): 64, (8, 6): 128, (8, 7): 128, (8, 9): 128,
    (9, 0): 128,
    (10, 0): 128, (10, 3): 128, (12, 0): 128, (12, 1): 128,
}


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, (bytes, bytearray)) else str(value)


def _guard(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception:  # NVMLError_NotSupported and friends, or a binding without the function
        return None


class NvmlObserver(Observer):
    def __init__(self, nvml: Any = None, *, init: bool = True, interval_ms: int = DEFAULT_INTERVAL_MS):
        super().__init__(interval_ms)
        self.nvml = nvml if nvml is not None else importlib.import_module("pynvml")
        if init:
            self.nvml.nvmlInit()
        self._initialized = init
        self._handles: dict[str, tuple[Any, str, str]] = {}  # asked uuid -> (handle, full uuid, name)

    # -- constants, with NVML's values when the binding lacks the names
    def _const(self, name: str, default: int) -> int:
        return getattr(self.nvml, name, default)

    # -- inventory
    def inventory(self) -> list[GpuInfo]:
        nv = self.nvml
        gpus = []
        for i in range(int(nv.nvmlDeviceGetCount())):
            h = nv.nvmlDeviceGetHandleByIndex(i)
            uuid, name = _text(nv.nvmlDeviceGetUUID(h)), _text(nv.nvmlDeviceGetName(h))
            self._handles.setdefault(uuid, (h, uuid, name))
            cc = _guard(lambda: tuple(int(x) for x in nv.nvmlDeviceGetCudaComputeCapability(h)))
            gpus.append(
                GpuInfo(
                    index=i,
                    uuid=uuid,
                    name=name,
                    memory_total_mb=int(nv.nvmlDeviceGetMemoryInfo(h).total // MIB),
                    sm_count=self._sm_count(h, cc),
                    compute_capability=cc if cc and len(cc) == 2 else None,
                )
            )
        return gpus

    def _sm_count(self, handle: Any, cc: tuple[int, ...] | None) -> int | None:
        nv = self.nvml
        attrs = _guard(lambda: nv.nvmlDeviceGetAttributes(handle))  # MIG handles, some drivers whole GPUs
        count = getattr(attrs, "multiprocessorCount", None) if attrs is not None else None
        if isinstance(count, int) and count > 0:
            return count
        cores = _guard(lambda: nv.nvmlDeviceGetNumGpuCores(handle))
        per_sm = _CORES_PER_SM.get(tuple(cc)) if cc else None
        if isinstance(cores, int) and cores > 0 and per_sm and cores % per_sm == 0:
            return cores // per_sm
        return None

    # -- samples
    def _handle(self, uuid: str) -> tuple[Any, str, str]:
        hit = self._handles.get(uuid)
        if hit is not None:
            return hit
        nv = self.nvml
        h = None
        try:
            try:
                h = nv.nvmlDeviceGetHandleByUUID(uuid)
            except TypeError:  # older bindings want bytes
                h = nv.nvmlDeviceGetHandleByUUID(uuid.encode())
        except Exception:
            h = None
        if h is not None:
            full, name = _text(nv.nvmlDeviceGetUUID(h)), _text(nv.nvmlDeviceGetName(h))
        else:  # a prefix, e.g. the 8 hex digits of a lane's queue name
            want = _hex(uuid)
            found = [g for g in self.inventory() if want and _hex(g.uuid).startswith(want)]
            if len(found) != 1:
                raise LaneError(f"NVML has {'no' if not found else 'more than one'} GPU {uuid!r}")
            h, full, name = self._handles[found[0].uuid]
        self._handles[uuid] = (h, full, name)
        return self._handles[uuid]

    def sample(self, uuid: str) -> DeviceSample:
        nv = self.nvml
        h, full, name = self._handle(uuid)
        util = _guard(lambda: nv.nvmlDeviceGetUtilizationRates(h))
        mem = _guard(lambda: nv.nvmlDeviceGetMemoryInfo(h))
        power_mw = _guard(lambda: nv.nvmlDeviceGetPowerUsage(h))
        return DeviceSample(
            uuid=full,
            name=name,
            sm_clock_mhz=_guard(lambda: int(nv.nvmlDeviceGetClockInfo(h, self._const("NVML_CLOCK_SM", 1)))),
            mem_clock_mhz=_guard(lambda: int(nv.nvmlDeviceGetClockInfo(h, self._const("NVML_CLOCK_MEM", 2)))),
            utilization_gpu_pct=None if util is None else int(util.gpu),
            memory_used_mb=None if mem is None else int(mem.used // MIB),
            memory_total_mb=None if mem is None else int(mem.total // MIB),
            temperature_c=_guard(
                lambda: int(nv.nvmlDeviceGetTemperature(h, self._const("NVML_TEMPERATURE_GPU", 0)))
            ),
            power_w=None if power_mw is None else power_mw / 1000.0,
        )

    def close(self) -> None:
        super().close()
        if self._initialized:
            self._initialized = False
            _guard(self.nvml.nvmlShutdown)


def make_observer(nvml: Any = None, interval_ms: int = DEFAULT_INTERVAL_MS) -> Observer:
    """An NvmlObserver when pynvml imports and nvmlInit works, else a NullObserver saying why."""
    try:
        module = nvml if nvml is not None else importlib.import_module("pynvml")
    except ImportError as e:
        log.info("no GPU observer: pynvml does not import (%s)", e)
        return NullObserver(reason=f"pynvml does not import: {e}", interval_ms=interval_ms)
    try:
        return NvmlObserver(module, interval_ms=interval_ms)
    except Exception as e:  # NVMLError_LibraryNotFound, NVMLError_DriverNotLoaded, ...
        log.info("no GPU observer: nvmlInit failed (%s)", e)
        return NullObserver(reason=f"nvmlInit failed: {e}", interval_ms=interval_ms)

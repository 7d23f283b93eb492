"""Observers without a GPU: NvmlObserver against a fake pynvml module holding values recorded from an
H200, windows summarised from a sequence of utilizations, NullObserver, and make_observer's fallback."""
from __future__ import annotations

import sys
import time
import types

import pytest

from services.measurer.observers.inventory import GpuInfo
from services.measurer.observers import (
    DeviceSample,
    NullObserver,
    NvmlObserver,
    Observer,
    WindowStats,
    make_observer,
)
from shared.errors import LaneError

UUID = "GPU-3f2a1c9b-5d7e-4a10-9c21-6b8e0f4d2a17"
MIB = 1 << 20


class NVMLError(Exception):
    pass


class NVMLError_NotSupported(NVMLError):
    pass


def fake_pynvml(utilizations=(37,), init_error=None, attributes=False, power=True, name_bytes=False):
    """A pynvml stand-in answering as one H200 did (nvidia-smi -q, driver 580): SM 1980 MHz,
    memory 3201 MHz, 37 % busy, 1024 of 143771 MiB used, 41 C, 120 W, compute capability 9.0,
    16896 CUDA cores. Utilization readings follow ``utilizations``, then repeat the last one."""
    nv = types.ModuleType("pynvml")
    nv.NVMLError = NVMLError
    nv.NVML_CLOCK_SM, nv.NVML_CLOCK_MEM, nv.NVML_TEMPERATURE_GPU = 1, 2, 0
    nv.calls = []
    util = list(utilizations)
    handle = object()

    def record(fn):
        def wrapper(*args):
            nv.calls.append((fn.__name__, args))
            return fn(*args)

        wrapper.__name__ = fn.__name__
        setattr(nv, fn.__name__, wrapper)
        return wrapper

    @record
    def nvmlInit():
        if init_error is not None:
            raise init_error

    @record
    def nvmlShutdown():
        pass

    @record
    def nvmlDeviceGetCount():
        return 1

    @record
    def nvmlDeviceGetHandleByIndex(i):
        if i != 0:
            raise NVMLError("Invalid Argument")
        return handle

    @record
    def nvmlDeviceGetHandleByUUID(uuid):
        if uuid != UUID:
            raise NVMLError("Not Found")
        return handle

    @record
    def nvmlDeviceGetUUID(h):
        assert h is handle
        return UUID.encode() if name_bytes else UUID

    @record
    def nvmlDeviceGetName(h):
        return b"NVIDIA H200" if name_bytes else "NVIDIA H200"

    @record
    def nvmlDeviceGetMemoryInfo(h):
        return types.SimpleNamespace(total=143771 * MIB, used=1024 * MIB, free=(143771 - 1024) * MIB)

    @record
    def nvmlDeviceGetClockInfo(h, clock):
        return {1: 1980, 2: 3201}[clock]

    @record
    def nvmlDeviceGetUtilizationRates(h):
        value = util.pop(0) if len(util) > 1 else util[0]
        return types.SimpleNamespace(gpu=value, memory=12)

    @record
    def nvmlDeviceGetTemperature(h, sensor):
        assert sensor == 0
        return 41

    @record
    def nvmlDeviceGetPowerUsage(h):
        if not power:
            raise NVMLError_NotSupported("Not Supported")
        return 120_000  # milliwatts

    @record
    def nvmlDeviceGetCudaComputeCapability(h):
        return (9, 0)

    @record
    def nvmlDeviceGetNumGpuCores(h):
        return 16896

    @record
    def nvmlDeviceGetAttributes(h):
        if not attributes:
            raise NVMLError_NotSupported("Not Supported")  # whole GPUs on many drivers
        return types.SimpleNamespace(multiprocessorCount=132)

    return nv


def called(nv, name):
    return [args for fn, args in nv.calls if fn == name]


def test_inventory_of_a_recorded_h200():
    nv = fake_pynvml()
    obs = NvmlObserver(nv)
    assert called(nv, "nvmlInit") == [()]
    gpus = obs.inventory()
    assert gpus == [GpuInfo(0, UUID, "NVIDIA H200", 143771, 132, (9, 0))]
    assert gpus[0].uuid8 == "3f2a1c9b"
    assert gpus[0].to_dict()["compute_capability"] == [9, 0]
    # SM count from the device attributes where the driver gives them
    assert NvmlObserver(fake_pynvml(attributes=True)).inventory()[0].sm_count == 132
    obs.close()
    assert called(nv, "nvmlShutdown") == [()]


def test_sample_fields():
    nv = fake_pynvml(name_bytes=True)  # older bindings return bytes
    obs = NvmlObserver(nv)
    before = time.time()
    s = obs.sample(UUID)
    assert isinstance(s, DeviceSample)
    d = s.to_dict()
    assert before <= d.pop("timestamp") <= time.time()
    assert d == {
        "uuid": UUID, "name": "NVIDIA H200", "sm_clock_mhz": 1980, "mem_clock_mhz": 3201,
        "utilization_gpu_pct": 37, "memory_used_mb": 1024, "memory_total_mb": 143771,
        "temperature_c": 41, "power_w": 120.0,
    }
    assert sorted(c for _, c in called(nv, "nvmlDeviceGetClockInfo")) == [1, 2]
    assert called(nv, "nvmlDeviceGetHandleByUUID") == [(UUID,)]
    obs.sample(UUID)
    assert len(called(nv, "nvmlDeviceGetHandleByUUID")) == 1  # the handle is kept


def test_sample_by_lane_prefix_and_unsupported_power():
    obs = NvmlObserver(fake_pynvml(power=False))
    s = obs.sample("3f2a1c9b")  # the GPU part of a lane queue name
    assert s.uuid == UUID and s.power_w is None and s.sm_clock_mhz == 1980
    with pytest.raises(LaneError, match="no GPU 'deadbeef'"):
        obs.sample("deadbeef")


def test_window_busy_fraction_from_a_sequence_of_utilizations():
    seq = [10, 30, 50, 70, 90]
    obs = NvmlObserver(fake_pynvml(utilizations=seq), interval_ms=10)
    obs.start_window(UUID)
    with pytest.raises(RuntimeError, match="already open"):
        obs.start_window(UUID)
    time.sleep(0.3)
    stats = obs.stop_window()
    utils = [s.utilization_gpu_pct for s in stats.samples]
    assert len(utils) >= 5 and utils[:5] == seq and all(u == 90 for u in utils[5:])
    assert stats.busy_fraction == pytest.approx(sum(utils) / len(utils) / 100)
    assert stats.mean_sm_clock_mhz == 1980 and stats.max_temperature_c == 41
    assert stats.uuid == UUID and stats.duration_s >= 0.3 and stats.errors == 0
    assert stats.summary()["n_samples"] == len(utils)
    with pytest.raises(RuntimeError, match="no window"):
        obs.stop_window()

    # a short window still has its first and its last reading
    obs = NvmlObserver(fake_pynvml(utilizations=[20, 60]), interval_ms=10_000)
    obs.start_window(UUID)
    stats = obs.stop_window()
    assert [s.utilization_gpu_pct for s in stats.samples] == [20, 60]
    assert stats.busy_fraction == pytest.approx(0.4)


def test_window_stats_from_samples():
    samples = [DeviceSample(UUID, "NVIDIA H200", sm_clock_mhz=c, utilization_gpu_pct=u, temperature_c=t)
               for c, u, t in [(1980, 0, 40), (1755, 50, 44), (1980, 100, 42), (None, None, None)]]
    stats = WindowStats.from_samples(UUID, samples, 0.2)
    assert stats.busy_fraction == pytest.approx(0.5)
    assert stats.mean_sm_clock_mhz == pytest.approx((1980 + 1755 + 1980) / 3)
    assert stats.max_temperature_c == 44
    assert len(stats.to_dict()["samples"]) == 4
    empty = WindowStats.from_samples(UUID, [])
    assert (empty.busy_fraction, empty.mean_sm_clock_mhz, empty.max_temperature_c) == (None, None, None)


def test_failed_readings_do_not_end_a_window():
    class Flaky(Observer):
        n = 0

        def sample(self, uuid):
            self.n += 1
            if self.n % 2:
                raise RuntimeError("GPU is lost")
            return DeviceSample(uuid, "x", utilization_gpu_pct=80)

    obs = Flaky(interval_ms=5)
    obs.start_window("GPU-x")
    time.sleep(0.1)
    stats = obs.stop_window()
    assert stats.errors >= 1 and stats.samples and stats.busy_fraction == pytest.approx(0.8)


def test_null_observer():
    obs = NullObserver()
    assert obs.inventory() == []
    assert obs.sample(UUID) is None
    obs.start_window(UUID)
    stats = obs.stop_window()
    assert stats.samples == [] and stats.busy_fraction is None and stats.max_temperature_c is None
    assert stats.uuid == UUID
    with pytest.raises(RuntimeError):
        obs.stop_window()
    obs.close()


def test_make_observer_uses_nvml_when_it_works():
    nv = fake_pynvml()
    obs = make_observer(nv)
    assert isinstance(obs, NvmlObserver) and obs.inventory()[0].name == "NVIDIA H200"


def test_make_observer_falls_back_when_init_fails():
    obs = make_observer(fake_pynvml(init_error=NVMLError("Driver Not Loaded")))
    assert isinstance(obs, NullObserver) and "Driver Not Loaded" in obs.reason
    assert obs.inventory() == []


def test_make_observer_falls_back_when_pynvml_does_not_import(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` now raises ImportError
    obs = make_observer()
    assert isinstance(obs, NullObserver) and "does not import" in obs.reason


def test_make_observer_picks_up_an_installed_pynvml(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml())
    assert isinstance(make_observer(), NvmlObserver)

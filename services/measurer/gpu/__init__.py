"""The measurer's GPU side, one module per concept: the MPS daemon (daemon), the plan of a host's GPU
lanes (plan), what a CUDA error means and the hung-kernel watchdog (faults), and the supervisor's
recovery policy (recovery). The GPU inventory type lives beside the NVML observers
(services.measurer.observers.inventory).

This package's namespace is the measurer's public GPU API: what the client's local stack and supervisor
use (the import contracts in pyproject.toml allow sharetune this module, not the ones below it)."""
from __future__ import annotations

from services.measurer.gpu.daemon import MpsDaemon
from services.measurer.gpu.plan import plan_gpu_lanes
from services.measurer.gpu.recovery import (
    GpuAttempt,
    LaneExit,
    Verdict,
    end_processes,
    give_up_gpu,
    judge_recovery,
    measured_by_fault,
    plan_gpu_reset,
    plan_recovery,
    read_process_table,
)

__all__ = ["GpuAttempt", "LaneExit", "MpsDaemon", "Verdict", "end_processes", "give_up_gpu", "judge_recovery",
           "measured_by_fault", "plan_gpu_lanes", "plan_gpu_reset", "plan_recovery", "read_process_table"]

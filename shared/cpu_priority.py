"""A batch role's CPU priority (CommonSettings.batch_priority): builders, tuner clients, planner and updater give
way to the lanes, whose timing loops launch kernels from the CPU (docs/benchmarks.md, "Timing on a busy host")."""
from __future__ import annotations

import logging
import os

log = logging.getLogger("sharetune.cpu_priority")

PRIORITIES = ("idle", "low", "normal")


def yield_cpu(priority: str) -> str:
    """Lower this process's CPU priority for a batch role (CommonSettings.batch_priority: idle, low, normal);
    what it got. Set before exec or before any thread starts: the worker, its threads and the processes it
    starts keep it. Lowering needs no privilege; where the OS refuses, the process runs on as it was."""
    try:
        if priority == "idle" and hasattr(os, "SCHED_IDLE"):
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            return "idle"
        if priority in ("idle", "low"):
            os.setpriority(os.PRIO_PROCESS, 0, 19)
            return "low"
    except OSError as err:
        log.warning("could not lower this worker's CPU priority to %s: %s", priority, err)
    return "normal"


def current(pid: int = 0) -> str:
    """A process's priority (this one's: 0) as yield_cpu names it."""
    if hasattr(os, "SCHED_IDLE") and os.sched_getscheduler(pid) == os.SCHED_IDLE:
        return "idle"
    return "low" if os.getpriority(os.PRIO_PROCESS, pid) >= 19 else "normal"

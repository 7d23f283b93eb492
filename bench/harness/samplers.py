"""Load over a window: a GPU's busy fraction (BusySampler) and where the host's CPU went, by the stack's roles
(CpuSampler)."""
from __future__ import annotations

import re
import time


class BusySampler:
    """GPU busy fraction over a window (NVML utilisation, through the project's observer; `interval_ms` None:
    the observer's own sampling interval)."""

    def __init__(self, uuid: str | None, interval_ms: int | None = 250):
        self.uuid, self.obs, self.samples = uuid, None, []
        if uuid:
            from services.measurer.observers import make_observer

            self.obs = make_observer()
            self.obs.start_window(uuid, interval_ms=interval_ms)

    def stop(self) -> float | None:
        if self.obs is None:
            return None
        stats = self.obs.stop_window()
        self.obs.close()
        self.samples = stats.samples  # the readings, for a timeline
        return None if stats.busy_fraction is None else round(stats.busy_fraction, 4)


def cpu_by_role(procs: dict, role_of) -> dict[str, float]:
    """CPU seconds so far of each role (`role_of(process name)`) of a stack's processes, each with its live
    children and those it has reaped (build pools, a lane's timing child)."""
    import psutil

    out: dict[str, float] = {}
    for name, popen in list(procs.items()):
        try:
            root = psutil.Process(popen.pid)
            tree = [root] + root.children(recursive=True)
        except psutil.Error:
            continue
        for p in tree:
            try:
                t = p.cpu_times()
            except psutil.Error:
                continue
            role = role_of(name)
            out[role] = out.get(role, 0.0) + t.user + t.system + t.children_user + t.children_system
    return out


class CpuSampler:
    """Where the host's CPU went over a window: its busy fraction and the CPU seconds of each role of the
    stack (tuner, builder, lane, updater, planner...), each process with its children (build pools, a
    lane's timing child). A process that a supervisor restarted part-way counts from its start."""

    def __init__(self, procs: dict):
        import psutil

        self.procs = procs
        self.t0, self.host0, self.roles0 = time.time(), psutil.cpu_times(), self._roles()

    def _roles(self) -> dict[str, float]:
        # tuner0, builder-cuda.sm_90-3 -> tuner, builder
        return cpu_by_role(self.procs, lambda name: re.match(r"[a-z]*", name).group(0) or name)

    def stop(self) -> dict:
        import psutil

        host1, roles1 = psutil.cpu_times(), self._roles()
        idle = lambda t: t.idle + getattr(t, "iowait", 0.0)  # noqa: E731
        total = sum(host1) - sum(self.host0)
        cpu_s = {k: round(v - self.roles0.get(k, 0.0), 1) for k, v in sorted(roles1.items())}
        return {"host_cpu_busy_frac": round(1 - (idle(host1) - idle(self.host0)) / total, 4) if total > 0 else None,
                "cpu_s_by_role": cpu_s, "cpu_window_s": round(time.time() - self.t0, 1)}


class RunSamplers:
    """A run's samplers, started together at submit: each GPU's busy fraction (`uuids`; none: a sampler that reads
    nothing), the stack's CPU by role and its timeline."""

    def __init__(self, stack, uuids: list[str]):
        from bench.harness.timeline import Timeline
        from shared import store

        self.gpu = [BusySampler(u) for u in uuids] or [BusySampler(None)]
        self.cpu = CpuSampler(stack.procs)
        self.timeline = Timeline(stack.procs, store.connect(stack.redis_url))

    def stop(self) -> tuple[list[dict], list, dict]:
        """(the timeline's rows, each GPU's busy fraction, the CPU's figures)."""
        return self.timeline.stop(), [s.stop() for s in self.gpu], self.cpu.stop()

"""Load over a window: CPU used by processes outside a benchmark (ForeignLoad), a GPU's busy fraction (BusySampler),
and where the host's CPU went, by the stack's roles (CpuSampler)."""
from __future__ import annotations

import os
import re
import threading
import time

from bench.harness.common import rounded


class ForeignLoad:
    """CPU seconds used, per phase, by processes OUTSIDE this benchmark's process tree (e.g. another
    user's test run on the same 2 cores), sampled from /proc every `interval_s`. Processes that start and
    end between two samples are missed, so this is a lower bound."""

    def __init__(self, interval_s: float = 2.0):
        self.interval_s = interval_s
        self.tick = os.sysconf("SC_CLK_TCK")
        self.phase = "setup"
        self.cpu_s: dict[str, float] = {}
        self.wall_s: dict[str, float] = {}
        self._phase_t0 = time.time()
        self._stop = threading.Event()
        self._prev = self._snapshot()
        self._thread = threading.Thread(target=self._loop, name="foreign-load", daemon=True)
        self._thread.start()

    @staticmethod
    def _snapshot() -> dict[int, tuple[int, int]]:
        procs = {}
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            try:
                with open(f"/proc/{d}/stat") as f:
                    text = f.read()
            except OSError:
                continue
            fields = text[text.rindex(")") + 2:].split()
            procs[int(d)] = (int(fields[1]), int(fields[11]) + int(fields[12]))  # ppid, utime + stime
        return procs

    def _sample(self) -> None:
        now = self._snapshot()
        mine, frontier = {os.getpid()}, [os.getpid()]
        children: dict[int, list[int]] = {}
        for pid, (ppid, _) in now.items():
            children.setdefault(ppid, []).append(pid)
        while frontier:
            for c in children.get(frontier.pop(), []):
                if c not in mine:
                    mine.add(c)
                    frontier.append(c)
        ticks = sum(max(0, cpu - self._prev[pid][1]) for pid, (_, cpu) in now.items()
                    if pid not in mine and pid in self._prev)
        self.cpu_s[self.phase] = self.cpu_s.get(self.phase, 0.0) + ticks / self.tick
        self._prev = now

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def set_phase(self, name: str) -> None:
        self._sample()
        self.wall_s[self.phase] = self.wall_s.get(self.phase, 0.0) + time.time() - self._phase_t0
        self.phase, self._phase_t0 = name, time.time()

    def report(self) -> dict:
        self.set_phase("done")
        self._stop.set()
        return {p: {"foreign_cpu_s": rounded(self.cpu_s.get(p, 0.0), 1), "wall_s": rounded(w, 1),
                    "foreign_cores": rounded(self.cpu_s.get(p, 0.0) / w, 2) if w else None}
                for p, w in self.wall_s.items()}


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

"""Load over a window: a GPU's busy fraction (BusySampler), where the host's CPU went by the stack's roles
(CpuSampler), and the run second by second (Timeline: CPU busy per role, the build and measure queues' depth;
sharetune.experiments.throughput adds lane and GPU busy afterwards and draws it). The samplers read /proc
(through psutil) and Redis from a thread of the benchmark."""
from __future__ import annotations

import re
import threading
import time

from services.tuner.shard_runner import clients_board
from sharetune.experiments.throughput import ROLES
from shared import store


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


def host_busy_frac(before, after) -> float | None:
    """The host's busy fraction between two psutil.cpu_times() readings (None: no time between them)."""
    idle = lambda t: t.idle + getattr(t, "iowait", 0.0)  # noqa: E731
    total = sum(after) - sum(before)
    return 1 - (idle(after) - idle(before)) / total if total > 0 else None


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
        busy = host_busy_frac(self.host0, host1)
        cpu_s = {k: round(v - self.roles0.get(k, 0.0), 1) for k, v in sorted(roles1.items())}
        return {"host_cpu_busy_frac": round(busy, 4) if busy is not None else None,
                "cpu_s_by_role": cpu_s, "cpu_window_s": round(time.time() - self.t0, 1)}


def role_of(proc_name: str) -> str:
    """tuner0 -> tuner, builder-cuda.sm_90-3 -> builder, lane-... -> lane; anything else: other."""
    head = re.match(r"[a-z]*", proc_name).group(0)
    return head if head in ROLES else "other"


class Timeline:
    """Samples once every `interval_s` until `stop()`: host CPU busy (cores), CPU cores busy per role of
    the stack's processes (each with its children), and the depth of the Celery queues (Redis lists) whose
    names match each group's pattern, summed per group."""

    QUEUES = {"build": "build.*", "measure": "measure.*"}

    def __init__(self, procs: dict, redis, interval_s: float = 1.0):
        import psutil

        self.procs, self.redis, self.interval_s = procs, redis, interval_s
        self.t0 = time.time()
        self.rows: list[dict] = []
        self._host, self._roles = psutil.cpu_times(), self._role_cpu()
        self._last = time.time()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="timeline", daemon=True)
        self._thread.start()

    def _role_cpu(self) -> dict[str, float]:
        return {**dict.fromkeys(ROLES, 0.0), **cpu_by_role(self.procs, role_of)}

    def _sample(self) -> None:
        import psutil

        now, host, roles = time.time(), psutil.cpu_times(), self._role_cpu()
        dt = max(now - self._last, 1e-6)
        busy = (psutil.cpu_count() or 1) * (host_busy_frac(self._host, host) or 0.0)
        row = {"t": round(now - self.t0, 2), "host_busy_cores": round(busy, 2),
               # a process that ended between samples takes its CPU with it: never below zero
               "cores_by_role": {k: round(max(0.0, roles[k] - self._roles.get(k, 0.0)) / dt, 2) for k in ROLES}}
        try:  # each job's candidates in flight, fair count and tuner clients: how several jobs shared the stack
            row["queued"] = {g: self._depth(pattern) for g, pattern in self.QUEUES.items()}
            row["in_flight"], row["measured"] = store.in_flight_by_job(self.redis), store.measured_by_job(self.redis)
            row["clients"] = clients_board(self.redis, 0.0)[0]
        except Exception:  # noqa: BLE001 - a sample without the queues, not a failed benchmark
            row["queued"] = None
        self.rows.append(row)
        self._host, self._roles, self._last = host, roles, now

    def _depth(self, pattern: str) -> int:
        keys = self.redis.keys(pattern)  # a queue's list exists while it holds messages (priority lists too)
        with self.redis.pipeline() as p:
            for k in keys:
                p.llen(k)
            return sum(n for n in p.execute(raise_on_error=False) if isinstance(n, int))

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def stop(self) -> list[dict]:
        self._stop.set()
        self._thread.join(timeout=5)
        return self.rows


class RunSamplers:
    """A run's samplers, started together at submit: each GPU's busy fraction (`uuids`; none: a sampler that reads
    nothing), the stack's CPU by role and its timeline."""

    def __init__(self, stack, uuids: list[str]):
        from shared import store

        self.gpu = [BusySampler(u) for u in uuids] or [BusySampler(None)]
        self.cpu = CpuSampler(stack.procs)
        self.timeline = Timeline(stack.procs, store.connect(stack.redis_url))

    def stop(self) -> tuple[list[dict], list, dict]:
        """(the timeline's rows, each GPU's busy fraction, the CPU's figures)."""
        return self.timeline.stop(), [s.stop() for s in self.gpu], self.cpu.stop()

"""A run's pipeline, second by second: CPU busy per role of the stack, the build and measure queues' depth,
each lane's busy time and the GPU's busy fraction; where each idle core-second went; and a PNG of it.

The sampler reads /proc (through psutil) and Redis once a second from a thread of the benchmark; lane busy
comes afterwards from the lanes' own batch clocks, the GPU's from the observer's window of readings."""
from __future__ import annotations

import re
import threading
import time

from bench.harness.samplers import cpu_by_role

ROLES = ("tuner", "builder", "lane", "updater", "other")


def role_of(proc_name: str) -> str:
    """tuner0 -> tuner, builder-cuda.sm_90-3 -> builder, lane-... -> lane; anything else: other."""
    head = re.match(r"[a-z]*", proc_name).group(0)
    return head if head in ROLES else "other"


class Timeline:
    """Samples once every `interval_s` until `stop()`: host CPU busy (cores), CPU cores busy per role of
    the stack's processes (each with its children), and the depth of the Celery queues (Redis lists) whose
    names match each group's pattern, summed per group."""

    def __init__(self, procs: dict, redis, queues: dict[str, str] | None = None, interval_s: float = 1.0):
        import psutil

        self.procs, self.redis, self.interval_s = procs, redis, interval_s
        self.queues = queues or {"build": "build.*", "measure": "measure.*"}
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
        idle = lambda t: t.idle + getattr(t, "iowait", 0.0)  # noqa: E731
        total = sum(host) - sum(self._host)
        cores = psutil.cpu_count() or 1
        busy = cores * (1 - (idle(host) - idle(self._host)) / total) if total > 0 else 0.0
        row = {"t": round(now - self.t0, 2), "host_busy_cores": round(busy, 2),
               # a process that ended between samples takes its CPU with it: never below zero
               "cores_by_role": {k: round(max(0.0, roles[k] - self._roles.get(k, 0.0)) / dt, 2) for k in ROLES}}
        try:
            row["queued"] = {g: self._depth(pattern) for g, pattern in self.queues.items()}
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


def add_lane_busy(rows: list[dict], batches, t0: float) -> None:
    """Each row's lanes busy (lane-seconds inside batches per second of the row's interval), from the lanes'
    batch clocks; `t0` is the timeline's start."""
    for i, row in enumerate(rows):
        lo = t0 + (rows[i - 1]["t"] if i else 0.0)
        hi = t0 + row["t"]
        inside = sum(max(0.0, min(b.finished_at, hi) - max(b.started_at, lo)) for b in batches)
        row["lanes_busy"] = round(inside / max(hi - lo, 1e-6), 2)


def add_gpu_busy(rows: list[dict], samples, t0: float) -> None:
    """Each row's GPU busy fraction: the mean NVML utilisation of the readings inside its interval."""
    for i, row in enumerate(rows):
        lo, hi = t0 + (rows[i - 1]["t"] if i else 0.0), t0 + row["t"]
        got = [s.utilization_gpu_pct for s in samples if lo <= s.timestamp < hi and s.utilization_gpu_pct is not None]
        row["gpu_busy"] = round(sum(got) / len(got) / 100, 3) if got else None


def idle_attribution(rows: list[dict], cores: int, start: float, end: float, tuners: int) -> dict:
    """Where the idle core-seconds between `start` and `end` (seconds on the timeline: first candidate sent
    to last measured) went. Each second's idle cores (its cores less host busy) are put down to one cause:

    - `builds_waiting`: candidates waited in the build queue, yet cores idled (builders too few or stalled);
    - `search_bound`: nothing to build and the `tuners` clients busy, half a core each or more (the search
      could not feed the builders);
    - `waiting_on_lanes`: nothing to build, the tuners mostly idle and candidates queued for or on the lanes;
    - `starved`: nothing queued anywhere and the tuners mostly idle (a client between steps, the job's end).
    """
    out = dict.fromkeys(("builds_waiting", "search_bound", "waiting_on_lanes", "starved"), 0.0)
    busy_s = span = 0.0
    prev = 0.0
    for row in rows:
        dt, t = row["t"] - prev, row["t"]
        prev = t
        if t <= start or t - dt >= end:
            continue
        span += dt
        busy_s += row["host_busy_cores"] * dt
        idle = max(0.0, cores - row["host_busy_cores"]) * dt
        q = row.get("queued") or {}
        searching = row["cores_by_role"].get("tuner", 0.0)
        if q.get("build", 0) > 0:
            cause = "builds_waiting"
        elif searching >= 0.5 * tuners:
            cause = "search_bound"
        elif q.get("measure", 0) > 0 or row.get("lanes_busy", 0) > 0.2:
            cause = "waiting_on_lanes"
        else:
            cause = "starved"
        out[cause] += idle
    total = sum(out.values())
    return {"window_s": round(span, 1), "host_busy_frac": round(busy_s / max(span * cores, 1e-9), 4),
            "idle_core_s": round(total, 1),
            "idle_core_s_by_cause": {k: round(v, 1) for k, v in out.items()},
            "idle_frac_by_cause": {k: round(v / total, 3) if total else 0.0 for k, v in out.items()}}


def plot(rows: list[dict], path, title: str, cores: int) -> str | None:
    """CPU cores busy per role (stacked) against the host's cores, the queues' depth, lanes and GPU busy."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    t = [r["t"] for r in rows]
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(11, 6.5), sharex=True, height_ratios=[3, 2])
    ax.stackplot(t, *[[r["cores_by_role"].get(k, 0.0) for r in rows] for k in ROLES], labels=ROLES, alpha=0.8)
    ax.plot(t, [r["host_busy_cores"] for r in rows], color="black", lw=1, label="host busy")
    ax.axhline(cores, color="grey", ls="--", lw=0.8)
    ax.set_ylabel("CPU cores busy")
    ax.legend(loc="upper right", fontsize=8, ncol=3)
    ax.set_title(title)
    for group, color in (("build", "tab:orange"), ("measure", "tab:red")):
        ax2.plot(t, [(r.get("queued") or {}).get(group, 0) for r in rows], color=color, lw=1, label=f"{group} queue")
    ax2.set_ylabel("candidates queued")
    ax2.set_xlabel("seconds from submit")
    ax3 = ax2.twinx()
    ax3.plot(t, [r.get("lanes_busy") or 0 for r in rows], color="tab:green", lw=1, label="lanes busy")
    if any(r.get("gpu_busy") is not None for r in rows):
        ax3.plot(t, [r.get("gpu_busy") or 0 for r in rows], color="tab:purple", lw=1, label="GPU busy")
    ax3.set_ylabel("lanes busy / GPU busy")
    lines = ax2.get_legend_handles_labels(), ax3.get_legend_handles_labels()
    ax2.legend(lines[0][0] + lines[1][0], lines[0][1] + lines[1][1], loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)

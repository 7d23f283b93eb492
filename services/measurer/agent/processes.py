"""The processes a node agent starts, by name: each in its own session with its log in the work dir, started
again after a back-off when it dies, given up when it keeps dying, and stopped by its process group (what
was started, never more). Also the node's shared settings (NodeConfig) and the `with` guard that lets a
SIGTERM still stop what a component started."""
from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from shared import store

REPO = Path(__file__).resolve().parents[3]
MAX_RESTARTS, RESTART_WINDOW_S = 5, 600.0  # a process restarted this often within the window is given up


def restart_backoff_s(recent_restarts: int) -> float:
    """Seconds a dead process waits before its next start: at once the first time, then 1, 2, 4, 8 s."""
    return 0.0 if recent_restarts <= 0 else min(30.0, 2.0 ** (recent_restarts - 1))


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie of ours is not alive
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


def signal_group(pid: int, sig) -> None:
    try:
        os.killpg(pid, sig)  # each process was started in its own session: its group is what we started
    except ProcessLookupError:
        pass


@dataclass
class NodeConfig:
    """What every part of a node agent reads: its work dir (logs, MPS dirs), the store's URL (set late by a
    local stack that starts its own Redis), the workers' log level and the agent's logger."""

    work_dir: Path
    redis_url: str | None
    log_level: str = "INFO"
    log_name: str = "sharetune.agent"

    @property
    def log(self) -> logging.Logger:
        return logging.getLogger(self.log_name)

    def log_file(self, name: str) -> Path:
        return self.work_dir / "logs" / f"{name}.log"


def start_guarded(component) -> Callable[[], None]:
    """Start `component` (start() and stop()) for a `with` block: a SIGTERM to this process (a timeout, a
    supervisor) raises SystemExit, so the block's exit still stops what it started; a start that fails stops
    what it had started. Returns what the block's exit calls: stop the component, give SIGTERM its old
    handler back."""
    old = None
    if threading.current_thread() is threading.main_thread():
        def _term(signum, frame):
            raise SystemExit(128 + signum)

        old = signal.signal(signal.SIGTERM, _term)

    def leave() -> None:
        component.stop()
        if old is not None:
            signal.signal(signal.SIGTERM, old)

    try:
        component.start()
    except BaseException:
        leave()
        raise
    return leave


class ProcessSupervisor:
    """`procs`: every process started, by name; `restartable`: how to start again those that die (builders,
    a local stack's services; lanes are the GPU recovery's); `restarts`: when each was started again;
    `given_up`: why a process is not started again."""

    def __init__(self, config: NodeConfig, environment: Callable[[], dict[str, str]]):
        self.config = config
        self.environment = environment
        self.procs: dict[str, subprocess.Popen] = {}
        self.restartable: dict[str, Callable[[], subprocess.Popen]] = {}
        self.restarts: dict[str, list[float]] = {}
        self.given_up: dict[str, str] = {}
        self.on_give_up: list[Callable[[str], None]] = []  # the tables that drop a given-up process
        self._dead_seen: dict[str, float] = {}  # process name -> when it was first seen dead
        self._forgotten: dict[str, int] = {}  # process name -> the exited pid whose liveness keys were deleted

    def spawn(self, name: str, args: list[str], env: dict | None = None) -> subprocess.Popen:
        log_file = self.config.log_file(name)
        log_file.parent.mkdir(parents=True, exist_ok=True)
        out = open(log_file, "ab")
        proc = subprocess.Popen(args, cwd=REPO, env=env or self.environment(), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        self.procs[name] = proc
        return proc

    def pid_of(self, name: str) -> int | None:
        proc = self.procs.get(name)
        return proc.pid if proc is not None and proc.poll() is None else None

    def exited(self, name: str) -> bool:
        proc = self.procs.get(name)
        return proc is not None and proc.poll() is not None

    def recent_restarts(self, name: str, now: float) -> int:
        return sum(1 for t in self.restarts.get(name, ()) if now - t < RESTART_WINDOW_S)

    def note_restart(self, name: str, now: float) -> None:
        self.restarts.setdefault(name, []).append(now)

    def backing_off(self, name: str, now: float) -> bool:
        """Whether a dead process still waits for its next start (its back-off runs from when it was seen dead)."""
        seen = self._dead_seen.setdefault(name, now)
        if now - seen < restart_backoff_s(self.recent_restarts(name, now)):
            return True
        self._dead_seen.pop(name, None)
        return False

    def give_up(self, name: str, code, restarts: int) -> None:
        why = f"exited {code} after {restarts} restarts in {RESTART_WINDOW_S:.0f} s: not started again"
        self.given_up[name] = why
        self.restartable.pop(name, None)
        self.procs.pop(name, None)
        self._dead_seen.pop(name, None)
        for drop in self.on_give_up:
            drop(name)
        self.config.log.error("%s %s (see %s)", name, why, self.config.log_file(name))

    def restart_dead(self, now: float, on_exit: Callable[[str, int], None] | None = None) -> list[str]:
        """The restartable processes that died, started again after their back-off (restart_backoff_s),
        unless one keeps dying (MAX_RESTARTS in RESTART_WINDOW_S): then it is given up. `on_exit(name, pid)`
        hears of each dead one first."""
        restarted = []
        for name, start in list(self.restartable.items()):
            proc = self.procs.get(name)
            if proc is None or proc.poll() is None:
                continue
            if on_exit is not None:
                on_exit(name, proc.pid)
            recent = self.recent_restarts(name, now)
            if recent >= MAX_RESTARTS:
                self.give_up(name, proc.returncode, recent)
                continue
            if self.backing_off(name, now):
                continue
            self.note_restart(name, now)
            new = start()
            self.config.log.warning("%s (pid %s) exited with %s: started again as pid %s", name, proc.pid,
                                    proc.returncode, new.pid)
            restarted.append(name)
        return restarted

    def forget_dead(self, name: str, pid: int) -> None:
        """A lane or builder process of ours has exited: its liveness key goes now, so a tuner waiting on a batch
        there re-sends it at once, not after the key's TTL (a worker id is host.pid; a lane's exec keeps the pid).
        Once per exited process: a dead builder in its back-off is seen again every round."""
        if self._forgotten.get(name) == pid:
            return
        self._forgotten[name] = pid
        try:
            from shared.ids import worker_id

            # one try, never the outage-riding client: the supervisor's round must not wait on a Redis restart
            store.forget_worker(store.connect_probe(self.config.redis_url, 2.0), worker_id(socket.gethostname(), pid))
        except Exception:  # noqa: BLE001 - Redis restarting: the key lapses by its TTL instead
            pass

    def stop_process(self, name: str, sig=signal.SIGTERM, timeout_s: float = 20.0) -> None:
        self._stop([name], sig, timeout_s)

    def stop_all(self, timeout_s: float = 20.0) -> None:
        """SIGTERM to every process group at once, then each waited for (a Celery worker's warm shutdown takes
        a second or two, which one after the other added up to ~10 s a stack)."""
        self._stop(list(self.procs), signal.SIGTERM, timeout_s)

    def _stop(self, names: list[str], sig, timeout_s: float) -> None:
        """`sig` to each named process's group, then each waited for; past `timeout_s` from the signal, SIGKILL."""
        signalled = []
        for name in names:
            proc = self.procs.pop(name, None)
            if proc is None or proc.poll() is not None:
                continue
            try:
                os.killpg(proc.pid, sig)  # its own session: the group is what we started
            except ProcessLookupError:
                continue
            signalled.append(proc)
        deadline = time.monotonic() + timeout_s
        for proc in signalled:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                signal_group(proc.pid, signal.SIGKILL)
                proc.wait()

    def rows(self, kind_of: Callable[[str], str]) -> list[dict]:
        """Every process with its liveness: name, kind, pid, alive, restarts, given_up (why)."""
        rows = []
        for name, proc in list(self.procs.items()):
            rows.append({"name": name, "kind": kind_of(name), "pid": proc.pid, "alive": proc.poll() is None,
                         "restarts": len(self.restarts.get(name, ())), "given_up": None})
        for name, why in list(self.given_up.items()):
            rows.append({"name": name, "kind": kind_of(name), "pid": None, "alive": False,
                         "restarts": len(self.restarts.get(name, ())), "given_up": why})
        return rows

"""The whole topology as local processes: an embedded Redis (unless REDIS_URL is given), the planner,
tuner client(s) and the cost-model updater, each its own process (group), beside this host's node agent
(services.measurer.agent: the lanes, builders, MPS daemon and GPU recovery, the same code a compose or
Kubernetes GPU node runs). Stops only what it started, by PID."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from shared import lanes as lane_kinds
from shared import names, store
from shared.settings import physical_cores
from services.measurer.agent import (  # noqa: F401 - the agent's helpers, as the CLI and tests know them
    MAX_RESTARTS, MPS_MAX_CLIENTS, REPO, RESTART_WINDOW_S, NodeAgent, alive as _alive, default_cpu_lanes,
    gpu_build_workers, gpu_lanes, restart_backoff_s, signal_group as _signal_group
)


def default_tuners(lanes: list[str], cores: int) -> int:
    """Tuner clients a stack starts when none are named: on a GPU one per lane, as measured on the H200
    (4 clients on 4x25 % lanes: 99 s against 1 client's 138 s, bench/results/sharding_h200.json), with at
    least 4 physical cores each for its search and builds; on CPU lanes one (the search competes with the
    lanes for the same cores)."""
    n_gpu_lanes = sum(1 for q in lanes if lane_kinds.of(lane_kinds.parse(q)).build_pool)
    if not n_gpu_lanes:
        return 1
    return max(1, min(n_gpu_lanes, cores // 4))


class Stack(NodeAgent):
    """A local stack: the central services (embedded Redis unless a URL is given, planner, tuner clients,
    updater) and this host's node agent, one supervisor thread for both. `lanes_only`: the agent alone,
    joining a running stack from another host (`sharetune up --join`)."""

    log_name = "sharetune.stack"

    def __init__(self, work_dir: Path, redis_url: str | None = None, lanes: list[str] | None = None,
                 tuners: int | None = None, log_level: str = "INFO", warm_kinds: str | None = None, lanes_only: bool = False,
                 supervise: bool = True, builders: int = 0, builder_cores: str | None = None,
                 builder_families: list[str] | None = None, redis_port: int | None = None, restart_redis: bool = False,
                 redis_password: str | None = None):
        super().__init__(work_dir, redis_url, lanes if lanes is not None else default_cpu_lanes(), log_level, warm_kinds,
                         supervise, builders, builder_cores, builder_families)
        self.lanes_only = lanes_only  # a second group of lanes joining a running stack (another host)
        if lanes_only and not self.redis_url:
            raise ValueError("lanes joining a stack need its REDIS_URL")
        if tuners is None:
            tuners = default_tuners(self.lanes, physical_cores())
        self.tuners = 0 if lanes_only else tuners
        self.redis_server = None
        self.redis_port = redis_port  # the embedded Redis's port (None: a free one)
        self.redis_password = redis_password  # the embedded Redis's services' password (None: a new random one)
        self.restart_redis = restart_redis  # the supervisor also starts a dead embedded Redis again
        self.redis_given_up: str | None = None  # why a dead embedded Redis is not started again

    def _worker(self, name: str, queue: str, env: dict | None = None) -> subprocess.Popen:
        """A tuner-service worker (planner, tuner client, updater), through its service's entry point."""
        return self._spawn(name, [sys.executable, "-m", "services.tuner", "--queue", queue, "--name", name,
                                  "--loglevel", self.log_level], env)

    def start_tuner(self, name: str) -> subprocess.Popen:
        """One more tuner client (horizontal scaling): it takes shards of queued and later jobs. The
        clients this stack starts split the host's physical cores for their searches."""
        env = self._env()
        if "SHARETUNE_SEARCH_THREADS" not in os.environ:
            env["SHARETUNE_SEARCH_THREADS"] = str(max(1, physical_cores() // max(1, self.tuners)))
        return self._worker(name, names.TUNE_QUEUE, env)

    def _restart_more(self, now: float) -> list[str]:
        """A dead embedded Redis comes back on the same port with the same AOF (when asked: `up`)."""
        import logging

        if not (self.restart_redis and self.redis_server is not None and self.redis_server.proc is not None
                and self.redis_server.proc.poll() is not None):
            return []
        recent = [t for t in self._restarts.get("redis", ()) if now - t < RESTART_WINDOW_S]
        log, code, pid = logging.getLogger(self.log_name), self.redis_server.proc.returncode, self.redis_server.proc.pid
        if len(recent) >= MAX_RESTARTS:
            if self.redis_given_up is None:
                log.error("redis (pid %s) exited with %s after %d restarts in %.0f s: not started again (see %s)",
                          pid, code, len(recent), RESTART_WINDOW_S, self.work_dir / "redis" / "redis.log")
            self.redis_given_up = f"exited {code}, {len(recent)} restarts in {RESTART_WINDOW_S:.0f} s"
            return []
        if self._backing_off("redis", now):
            return []
        self._restarts.setdefault("redis", []).append(now)
        self.redis_server.start()  # same port, same AOF
        log.warning("redis (pid %s) exited with %s: started again as pid %s (same port, same AOF)", pid, code,
                    self.redis_server.proc.pid)
        return ["redis"]

    def services(self) -> list[dict]:
        """Every process of the stack with its liveness: name, kind, pid, alive, restarts, given_up (why)."""
        rows = []
        if self.redis_server is not None and self.redis_server.proc is not None:
            proc = self.redis_server.proc
            rows.append({"name": "redis", "kind": "redis", "pid": proc.pid, "alive": proc.poll() is None,
                         "restarts": len(self._restarts.get("redis", ())), "given_up": self.redis_given_up})
        return rows + super().services()

    def start(self, wait_lanes_s: float = 300.0) -> "Stack":
        self.prepare()
        if not self.redis_url:
            import secrets

            from services.broker.server import SERVICE_USER, EmbeddedRedis

            # locked: any local user could otherwise read every model, cancel jobs or, through CONFIG, write
            # files as this user. The services get the URL (user and password) in their environment (_env)
            password = self.redis_password or secrets.token_urlsafe(24)
            self.redis_server = EmbeddedRedis(self.work_dir / "redis", port=self.redis_port, password=password,
                                              user=SERVICE_USER).start()
            self.redis_url = self.redis_server.url
        if not self.lanes_only:
            import functools

            self.service_procs["planner"] = functools.partial(self._worker, "planner", names.PLAN_QUEUE)
            for i in range(self.tuners):
                self.service_procs[f"tuner{i}"] = functools.partial(self.start_tuner, f"tuner{i}")
            self.service_procs["updater"] = functools.partial(self._worker, "updater", names.COSTMODEL_QUEUE)
            for start in self.service_procs.values():
                start()
        self.launch(wait_lanes_s)
        if wait_lanes_s:
            self.wait_for_tuners(self.tuners, wait_lanes_s)
        return self

    def wait_for_tuners(self, count: int, timeout_s: float) -> None:
        r = store.connect(self.redis_url)
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if store.live_tuners(r) >= count:
                return
            time.sleep(0.2)
        raise TimeoutError(f"{count} tuner client(s) did not warm up in {timeout_s} s; see {self.work_dir / 'logs'}")

    def stop(self) -> None:
        super().stop()
        if self.redis_server:
            self.redis_server.stop()
            self.redis_server = None

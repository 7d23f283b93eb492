"""The whole topology as local processes: an embedded Redis (unless REDIS_URL is given), the planner,
tuner client(s) and the cost-model updater, each its own process (group), beside this host's node agent
(services.measurer.agent: the lanes, builders, MPS daemon and GPU recovery, the same code a compose or
Kubernetes GPU node runs). The stack holds that agent: its supervisor thread restarts the services too.
Stops only what it started, by PID."""
from __future__ import annotations

import functools
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from shared import lanes as lane_kinds
from shared import names, store
from shared.settings import StackSettings, physical_cores
from services.measurer.agent import (MAX_RESTARTS, RESTART_WINDOW_S, BuilderSpec, NodeAgent, NodeConfig,
                                     default_cpu_lanes, start_guarded)


def default_tuners(lanes: list[str], cores: int) -> int:
    """Tuner clients a stack starts when none are named: on a GPU at least one per lane and at least 4, as
    measured on the H200 (4 clients on 4x25 % lanes: 99 s against 1 client's 138 s,
    bench/results/sharding_h200.json; every 1x100 % figure in bench/results/scale_h200.json is 4 clients'),
    with at least 4 physical cores each for its search and builds; on CPU lanes one (the search competes with
    the lanes for the same cores)."""
    n_gpu_lanes = sum(1 for q in lanes if lane_kinds.kind_of(q).build_pool)
    if not n_gpu_lanes:
        return 1
    return max(1, min(max(n_gpu_lanes, 4), cores // 4))


@dataclass(frozen=True)
class LocalRedis:
    """The embedded Redis a stack starts when it is given no URL: on `port` (None: a free one), locked with
    `password` for its services' user (None: a new random one); `restart`: the supervisor starts it again
    when it dies (`up`)."""

    port: int | None = None
    password: str | None = None
    restart: bool = False


class Stack:
    """A local stack: the central services (embedded Redis unless a URL is given, planner, tuner clients,
    updater) and this host's node agent (`agent`), one supervisor thread for both. `settings`: the process's
    (its entry point builds them); None: their defaults, the environment unread. `lanes_only` (Stack.joining):
    the agent alone, joining a running stack from another host (`sharetune up --join`)."""

    def __init__(self, work_dir: Path, redis_url: str | None = None, lanes: list[str] | None = None,
                 tuners: int | None = None, log_level: str = "INFO", builders: BuilderSpec | None = None,
                 local_redis: LocalRedis | None = None, settings: StackSettings | None = None):
        self.settings = settings if settings is not None else StackSettings.model_construct()
        node = self.settings.node
        self.agent = NodeAgent(NodeConfig(Path(work_dir), redis_url, log_level, "sharetune.stack"), self.settings,
                               lanes if lanes is not None else default_cpu_lanes(node=node), builders=builders)
        self.agent.supervise_also(self._restart_redis)
        self.lanes_only = False  # a second group of lanes joining a running stack (another host)
        if tuners is None:
            tuners = default_tuners(self.lanes, physical_cores())
        self.tuners = tuners
        self.local_redis = local_redis or LocalRedis()
        self.redis_server = None
        self.redis_given_up: str | None = None  # why a dead embedded Redis is not started again

    @classmethod
    def joining(cls, work_dir: Path, redis_url: str | None, lanes: list[str] | None = None, **kwargs) -> "Stack":
        """This host's lanes (and builders) alone, serving the running stack at `redis_url` (another host's)."""
        stack = cls(work_dir, redis_url, lanes, tuners=0, **kwargs)
        if not stack.redis_url:
            raise ValueError("lanes joining a stack need its REDIS_URL")
        stack.lanes_only = True
        return stack

    # ---- the agent's, as the stack's users read them ---------------------------------------------------

    @property
    def redis_url(self) -> str | None:
        return self.agent.redis_url

    @property
    def work_dir(self) -> Path:
        return self.agent.work_dir

    @property
    def lanes(self) -> list[str]:
        return self.agent.lanes

    @property
    def procs(self) -> dict[str, subprocess.Popen]:
        return self.agent.procs

    @property
    def recoveries(self) -> list[dict]:
        return self.agent.recoveries

    @property
    def mps(self):
        return self.agent.mps

    def check_cores(self) -> None:
        self.agent.check_cores()

    def start_lane(self, queue: str, instance: int = 0) -> subprocess.Popen:
        return self.agent.start_lane(queue, instance)

    def pid_of(self, name: str) -> int | None:
        return self.agent.pid_of(name)

    def stop_process(self, name: str, sig=signal.SIGTERM, timeout_s: float = 20.0) -> None:
        self.agent.stop_process(name, sig, timeout_s)

    def stop_lanes(self) -> None:
        self.agent.stop_lanes()

    def wait_for_lanes(self, queues: list[str], timeout_s: float) -> None:
        self.agent.wait_for_lanes(queues, timeout_s)

    # ---- the central services --------------------------------------------------------------------------

    def _worker(self, name: str, queue: str, env: dict | None = None) -> subprocess.Popen:
        """A tuner-service worker (planner, tuner client, updater), through its service's entry point."""
        return self.agent.processes.spawn(name, [sys.executable, "-m", "services.tuner", "--queue", queue, "--name",
                                                 name, "--loglevel", self.agent.config.log_level], env)

    def start_tuner(self, name: str) -> subprocess.Popen:
        """One more tuner client (horizontal scaling): it takes shards of queued and later jobs. The
        clients this stack starts split the host's physical cores for their searches."""
        env = self.agent.environment()
        if self.settings.given("search_threads") is None:
            env["SHARETUNE_SEARCH_THREADS"] = str(max(1, physical_cores() // max(1, self.tuners)))
        return self._worker(name, names.TUNE_QUEUE, env)

    def _restart_redis(self, now: float) -> list[str]:
        """A dead embedded Redis comes back on the same port with the same AOF (when asked: `up`)."""
        if not (self.local_redis.restart and self.redis_server is not None and self.redis_server.proc is not None
                and self.redis_server.proc.poll() is not None):
            return []
        processes = self.agent.processes
        recent = processes.recent_restarts("redis", now)
        log, code, pid = self.agent.config.log, self.redis_server.proc.returncode, self.redis_server.proc.pid
        if recent >= MAX_RESTARTS:
            if self.redis_given_up is None:
                log.error("redis (pid %s) exited with %s after %d restarts in %.0f s: not started again (see %s)",
                          pid, code, recent, RESTART_WINDOW_S, self.work_dir / "redis" / "redis.log")
            self.redis_given_up = f"exited {code}, {recent} restarts in {RESTART_WINDOW_S:.0f} s"
            return []
        if processes.backing_off("redis", now):
            return []
        processes.note_restart("redis", now)
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
                         "restarts": len(self.agent.processes.restarts.get("redis", ())),
                         "given_up": self.redis_given_up})
        return rows + self.agent.services()

    def start(self, wait_lanes_s: float = 300.0) -> "Stack":
        self.agent.prepare()
        if not self.redis_url:
            self._start_redis()
        if not self.lanes_only:
            restartable = self.agent.processes.restartable
            restartable["planner"] = functools.partial(self._worker, "planner", names.PLAN_QUEUE)
            for i in range(self.tuners):
                restartable[f"tuner{i}"] = functools.partial(self.start_tuner, f"tuner{i}")
            restartable["updater"] = functools.partial(self._worker, "updater", names.COSTMODEL_QUEUE)
            for start in list(restartable.values()):
                start()
        self.agent.launch(wait_lanes_s)
        if wait_lanes_s:
            self.wait_for_tuners(self.tuners, wait_lanes_s)
        return self

    def _start_redis(self) -> None:
        import secrets

        from services.broker.server import SERVICE_USER, EmbeddedRedis

        # locked: any local user could otherwise read every model, cancel jobs or, through CONFIG, write
        # files as this user. The services get the URL (user and password) in their environment
        password = self.local_redis.password or secrets.token_urlsafe(24)
        self.redis_server = EmbeddedRedis(self.work_dir / "redis", port=self.local_redis.port, password=password,
                                          maxmemory=self.settings.redis_maxmemory, user=SERVICE_USER).start()
        self.agent.redis_url = self.redis_server.url

    def wait_for_tuners(self, count: int, timeout_s: float) -> None:
        r = store.connect(self.redis_url)
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if store.live_tuners(r) >= count:
                return
            time.sleep(0.2)
        raise TimeoutError(f"{count} tuner client(s) did not warm up in {timeout_s} s; see {self.work_dir / 'logs'}")

    def stop(self) -> None:
        self.agent.stop()
        if self.redis_server:
            self.redis_server.stop()
            self.redis_server = None

    def __enter__(self):
        self._leave = start_guarded(self)
        return self

    def __exit__(self, *exc):
        self._leave()

"""The node agent: one per host, it starts, watches and restarts that host's measurer lanes and builders,
owns the host's MPS daemon and recovers a GPU after a fault, and reports its own liveness to the store. It
composes three parts: a ProcessSupervisor (processes.py: spawn, back-off, give-up), a BuilderPool
(builders.py) and a GpuRecovery (gpu_recovery.py: lane restarts, GPU resets, judged recoveries). It is the
same code whichever way the host was started: `sharetune up` (the local stack runs one agent beside the
central services), `sharetune up --join` and a compose or Kubernetes GPU node (`python -m
services.measurer.agent`). Stops only what it started, by PID."""
from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from shared import lanes as lane_kinds
from shared import store
from shared.settings import AgentSettings
from services.measurer.agent.builders import BuilderPool, BuilderSpec
from services.measurer.agent.gpu_recovery import GpuRecovery
from services.measurer.agent.processes import REPO, NodeConfig, ProcessSupervisor, start_guarded


def _kind_of(queue: str) -> lane_kinds.LaneKind:
    return lane_kinds.kind_of(queue)


def default_cpu_lanes(cores: int | None = None, node: str = "local") -> list[str]:
    """One single-core lane per core (of this host, or `cores`), named for the host's node (HostSettings.node):
    two lanes of 50 % each on a 2-core machine."""
    host = lane_kinds.Host(cores or lane_kinds.Host.this(node).cores, node)
    cpu = lane_kinds.kind("cpu")
    return [cpu.lane([c], host).queue for c in range(host.cores)]


def gpu_lanes(spec, max_total_percent: int = 100, observer=None) -> list[str]:
    """Lane queue names for a GPU lane spec ("4x25", "2x50", "25,25,50", or {gpu: spec}) on this host's
    GPUs, one entry per worker process. Refuses (ShareError) shares on one GPU summing past
    `max_total_percent`, percents outside 1..100 and GPUs this host lacks; LaneError without MPS."""
    from services.measurer.gpu import plan_gpu_lanes
    from services.measurer.observers import make_observer

    gpus = (observer or make_observer()).inventory()
    if not gpus:
        from shared.errors import LaneError

        raise LaneError("no NVIDIA GPU found through NVML on this host: GPU lanes cannot start")
    return [lane.queue for lane, count in plan_gpu_lanes(gpus, spec, max_total_percent) for _ in range(count)]


def lanes_from_spec(spec: str, host: lane_kinds.Host) -> list[str]:
    """The lanes an agent runs on `host`, from its --lanes: `cpu` (one single-core lane per core of this host),
    lane queue names (`measure.cpu.c0,measure.cpu.c1-2`), or a GPU share spec for this host's GPUs (`4x25`,
    `2x50`, `25,25,50`; gpu_lanes)."""
    spec = spec.strip()
    if spec == "cpu":
        return default_cpu_lanes(node=host.node)
    if spec.startswith("measure."):
        return [lane_kinds.parse(q.strip(), host).queue for q in spec.split(",") if q.strip()]
    return gpu_lanes(spec)


MPS_MAX_CLIENTS = 48  # client processes one MPS server accepts per GPU (Volta and later)


def gpu_build_workers(lanes: list[str], queue: str, cores: int, asked: int | None = None) -> int:
    """Build workers beside one GPU lane. GPU candidates take seconds to build and microseconds to time,
    so by default each GPU lane gets an equal part of the host's cores. Each build worker is an MPS client
    of its GPU, as is each lane: past 48 on one GPU the MPS server refuses new clients
    (cudaErrorDevicesUnavailable, seen on the H200 with seven lanes and their pools), so the pools of one
    GPU's lanes stay within that limit, one client left for serving."""
    pooled = [q for q in lanes if _kind_of(q).build_pool]
    gpu_lanes = len(pooled) or 1
    mine = lane_kinds.fault_domain(queue)
    on_gpu = sum(1 for q in pooled if lane_kinds.fault_domain(q) == mine) or 1
    workers = asked if asked is not None else max(1, cores // gpu_lanes)
    return max(1, min(workers, (MPS_MAX_CLIENTS - 1 - on_gpu) // on_gpu))


class NodeAgent:
    """`config`: its work dir, Redis (None: REDIS_URL, else set once a local stack's own is up), log level and
    logger; `settings`: this process's (the host's node name and core claims, a GPU lane's build pool); `lanes`:
    this host's lane queues, one entry per worker process (a queue twice: two workers of the lane); `builders`:
    the build workers beside them (BuilderSpec); `supervise`: restart what dies and recover faulted GPUs in a
    background thread. Its parts: `processes` (ProcessSupervisor), `builder_pool` (BuilderPool) and `gpus`
    (GpuRecovery)."""

    def __init__(self, config: NodeConfig, settings: AgentSettings, lanes: list[str] | None = None, *,
                 warm_kinds: str | None = None, supervise: bool = True, builders: BuilderSpec | None = None):
        self.config = dataclasses.replace(config, work_dir=Path(config.work_dir).resolve(),
                                          redis_url=config.redis_url or os.environ.get("REDIS_URL"))
        self.settings = settings
        self.host = settings.host()
        # lanes given by their cores alone (measure.cpu.c0) are named for this host: node and share
        self.lanes = [lane_kinds.parse(q, self.host).queue for q in lanes] if lanes is not None else []
        self.warm_kinds = warm_kinds or ",".join(sorted({_kind_of(q).target_kind for q in self.lanes})) or "llvm"
        self.supervise = supervise
        self.lane_procs: dict[str, tuple[str, int]] = {}  # process name -> (lane queue, instance)
        # a GPU lane's build pool size, by queue (None: an equal part of the host's cores, gpu_build_workers)
        self.lane_build_workers: Callable[[str], int | None] = lambda queue: None
        self.processes = ProcessSupervisor(self.config, self.environment)
        self.processes.on_give_up.append(lambda name: self.lane_procs.pop(name, None))
        self.builder_pool = BuilderPool(self.config, self.processes, builders or BuilderSpec(), self.lanes)
        self.gpus = GpuRecovery(self.config, self.processes, self.lane_procs,
                                lambda queue, instance: self.start_lane(queue, instance))
        self._checks: list[Callable[[float], list[str]]] = []  # more to supervise each round (a stack's Redis)
        self._supervisor: threading.Thread | None = None
        self._stopping = threading.Event()
        self._started_at = time.time()
        self._beat_stop: threading.Event | None = None

    # ---- what callers read ----------------------------------------------------------------------------

    @property
    def work_dir(self) -> Path:
        return self.config.work_dir

    @property
    def redis_url(self) -> str | None:
        return self.config.redis_url

    @redis_url.setter
    def redis_url(self, url: str | None) -> None:  # a local stack's own Redis, started after the agent is made
        self.config.redis_url = url

    @property
    def log_name(self) -> str:
        return self.config.log_name

    @property
    def procs(self) -> dict[str, subprocess.Popen]:
        return self.processes.procs

    @property
    def builder_procs(self) -> dict[str, str]:
        return self.builder_pool.families_by_name

    @property
    def given_up(self) -> dict[str, str]:
        return self.processes.given_up

    @property
    def recoveries(self) -> list[dict]:
        return self.gpus.recoveries

    @property
    def mps(self):
        return self.gpus.mps

    # ---- processes -------------------------------------------------------------------------------------

    def environment(self) -> dict[str, str]:
        """The environment every process of this node starts with."""
        env = dict(os.environ)
        env["REDIS_URL"] = self.redis_url
        env["SHARETUNE_WORK_DIR"] = str(self.work_dir)
        env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
        env.setdefault("TVM_NUM_THREADS", "1")
        env["SHARETUNE_WARM_KINDS"] = self.warm_kinds
        if self.gpus.mps is not None:
            env.update(self.gpus.mps.environment())
        return env

    def pid_of(self, name: str) -> int | None:
        return self.processes.pid_of(name)

    def start_lane(self, queue: str, instance: int = 0, build_workers: int | None = None) -> subprocess.Popen:
        """`build_workers`: the size of a GPU lane's build pool (default: lane_build_workers, else the
        settings' build_workers where given, else an equal part of the host's cores, see gpu_build_workers)."""
        lane = lane_kinds.parse(queue, self.host)
        kind, queue = lane_kinds.of(lane), lane.queue  # cores alone (measure.cpu.c0) are named for this host
        args = [sys.executable, "-m", "services.measurer", "--lane", queue, "--loglevel", self.config.log_level]
        if kind.device_uuid:
            if lane.gpu not in self.gpus.uuids:
                raise RuntimeError(f"lane {queue}: no GPU with UUID starting {lane.gpu} on this host")
            args += ["--gpu-uuid", self.gpus.uuids[lane.gpu]]
        env = self.environment()
        if kind.build_pool:  # with builders the lane only times (it builds only what is re-sent to it)
            build_workers = build_workers or self.lane_build_workers(queue)
            asked = build_workers or self.settings.given("build_workers")
            env["SHARETUNE_BUILD_WORKERS"] = "0" if self.builder_pool.spec.count else str(
                gpu_build_workers(self.lanes, queue, os.cpu_count() or 1, asked))
        name = f"lane-{queue}-{instance}" if instance else f"lane-{queue}"
        self.lane_procs[name] = (queue, instance)
        return self.processes.spawn(name, args, env)

    def services(self) -> list[dict]:
        """Every process the agent started with its liveness: name, kind, pid, alive, restarts, given_up (why)."""
        def kind(name):
            return ("lane" if name in self.lane_procs or name.startswith("lane-")
                    else "builder" if self.builder_pool.owns(name) else name.rstrip("0123456789"))

        return self.processes.rows(kind)

    def check_cores(self) -> None:
        """Before anything starts: CoresTaken when this agent's lanes would time on cores another live process
        of this host holds (another agent, a hand-started lane), unless SHARETUNE_CORE_OVERLAP=warn. Two
        lanes of this agent on one core are refused the same way."""
        from shared import hostcores

        s = self.settings
        hostcores.check_free([(q, lane_kinds.parse(q, self.host).cores) for q in self.lanes], s.core_lock_dir,
                             s.core_overlap)

    # ---- life cycle ------------------------------------------------------------------------------------

    def start(self, wait_lanes_s: float = 300.0) -> "NodeAgent":
        self.prepare()
        self.launch(wait_lanes_s)
        return self

    def prepare(self) -> None:
        """Before any process starts: the host's cores are free for these lanes, its GPUs named, its MPS
        daemon up."""
        self.check_cores()
        if any(_kind_of(q).device_uuid for q in self.lanes):
            self.gpus.start_support()

    def launch(self, wait_lanes_s: float = 300.0) -> None:
        """Start the lanes (and wait until they are live), the builders, the liveness beat and the supervisor."""
        for i, lane in enumerate(self.lanes):
            self.start_lane(lane, instance=self.lanes[:i].count(lane))
        if wait_lanes_s:
            self.wait_for_lanes(self.lanes, wait_lanes_s)
        if self.builder_pool.spec.count:
            self.builder_pool.start(wait_lanes_s)
        self._beat()
        from shared.heartbeat import keep_beating
        from shared.timeouts import HEARTBEAT_S

        self._beat_stop = keep_beating(self._beat, HEARTBEAT_S, "node agent heartbeat")
        if self.supervise:
            self.start_supervisor()

    def info(self):
        from shared.messages import AgentInfo

        return AgentInfo(host=socket.gethostname(), pid=os.getpid(), started_at=self._started_at,
                         lanes=sorted({q for q, _ in self.lane_procs.values()}), builders=len(self.builder_procs),
                         gpus=sorted(self.gpus.uuids.values()), restarts=sum(map(len, self.processes.restarts.values())),
                         recoveries=len(self.recoveries), given_up={**self.given_up, **self.gpus.given_up})

    def _beat(self) -> None:
        store.announce_agent(store.connect(self.redis_url), self.info())

    def wait_for_lanes(self, queues: list[str], timeout_s: float) -> None:
        r = store.connect(self.redis_url)
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            # only this agent's own workers count: a joining group must not be fooled by the lanes it joins
            ours = {p.pid for p in self.procs.values()}
            live = [l.queue for l in store.live_lanes(r) if l.pid in ours and l.host == socket.gethostname()]
            if all(live.count(q) >= queues.count(q) for q in set(queues)):
                return
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            if dead:
                raise RuntimeError(f"processes exited during start-up: {dead}; see {self.work_dir / 'logs'}")
            time.sleep(0.2)
        raise TimeoutError(f"lanes {queues} did not come up in {timeout_s} s; see {self.work_dir / 'logs'}")

    def stop_process(self, name: str, sig=signal.SIGTERM, timeout_s: float = 20.0) -> None:
        self.processes.stop_process(name, sig, timeout_s)

    def stop_lanes(self) -> None:
        """Stop every measurer lane (and its build pool), keeping Redis, the tuner services and the MPS
        daemon: what runs on the device afterwards has it to itself, at its own MPS share."""
        for name in [n for n in self.procs if n.startswith("lane-")]:
            self.stop_process(name)

    def stop(self) -> None:
        if self._supervisor is not None:
            self._stopping.set()
            self._supervisor.join(30)
            self._supervisor = None
        if self._beat_stop is not None:
            self._beat_stop.set()
            self._beat_stop = None
            try:
                store.retire_agent(store.connect(self.redis_url), self.info())
            except Exception:  # noqa: BLE001 - Redis gone first: the key lapses by its TTL
                pass
        self.processes.stop_all()
        self.gpus.stop()

    def __enter__(self):
        self._leave = start_guarded(self)
        return self

    def __exit__(self, *exc):
        self._leave()

    # ---- supervision: what dies comes back; a GPU fault restarts MPS and that GPU's lanes ------------------

    def supervise_also(self, check: Callable[[float], list[str]]) -> None:
        """One more thing each supervisor round looks after: `check(now)` returns the names it restarted."""
        self._checks.append(check)

    def recover_once(self, faults_since: float, now: float | None = None) -> float:
        """The lanes' round (GpuRecovery.recover_once): returns the new `faults_since`."""
        return self.gpus.recover_once(faults_since, now)

    def restart_services(self, now: float) -> list[str]:
        """Builders, the processes registered as restartable (a local stack's planner, tuner clients and
        updater: their state is in Redis, a job a dead tuner held is resumed by the reaper) and what else was
        given to supervise_also: what died is started again after its back-off, or given up."""
        def forget_builder(name: str, pid: int) -> None:
            if self.builder_pool.owns(name):
                self.processes.forget_dead(name, pid)

        restarted = self.processes.restart_dead(now, forget_builder)
        for check in self._checks:
            restarted += check(now)
        return restarted

    def start_supervisor(self, poll_s: float = 0.5) -> None:
        self._stopping = threading.Event()
        self._supervisor = threading.Thread(target=self._supervise, args=(poll_s,), name="node-agent-supervisor",
                                            daemon=True)
        self._supervisor.start()

    def _supervise(self, poll_s: float) -> None:
        fault_seen = time.time()
        while not self._stopping.wait(poll_s):
            try:
                fault_seen = self.recover_once(fault_seen)
                self.restart_services(time.time())
            except Exception:  # noqa: BLE001 - e.g. Redis restarting; the next round retries
                self.config.log.warning("supervisor round failed", exc_info=True)

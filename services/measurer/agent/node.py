"""The node agent: one per host, it starts, watches and restarts that host's measurer lanes and builders,
owns the host's MPS daemon and recovers a GPU after a fault (every client of the faulted GPU ended, its MPS
server restarted, its lanes started again and judged; a GPU whose recoveries keep failing is given up with a
clear error in the store), and reports its own liveness to the store. It is the same code whichever way the
host was started: `sharetune up` (the local stack runs one agent beside the central services), `sharetune up
--join` and a compose or Kubernetes GPU node (`python -m services.measurer.agent`). Stops only what it
started, by PID."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from shared import lanes as lane_kinds
from shared import names, store

REPO = Path(__file__).resolve().parents[3]


def _kind_of(queue: str) -> lane_kinds.LaneKind:
    return lane_kinds.of(lane_kinds.parse(queue))


def default_cpu_lanes(cores: int | None = None) -> list[str]:
    """One single-core lane per core: two lanes of 50 % each on a 2-core machine."""
    here = lane_kinds.Host.this()
    host = lane_kinds.Host(cores or here.cores, here.node)
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


def lanes_from_spec(spec: str) -> list[str]:
    """The lanes an agent runs, from its --lanes: `cpu` (one single-core lane per core of this host), lane
    queue names (`measure.cpu.c0,measure.cpu.c1-2`), or a GPU share spec for this host's GPUs (`4x25`,
    `2x50`, `25,25,50`; gpu_lanes)."""
    spec = spec.strip()
    if spec == "cpu":
        return default_cpu_lanes()
    if spec.startswith("measure."):
        return [lane_kinds.parse(q.strip()).queue for q in spec.split(",") if q.strip()]
    return gpu_lanes(spec)


MPS_MAX_CLIENTS = 48  # client processes one MPS server accepts per GPU (Volta and later)


def gpu_build_workers(lanes: list[str], queue: str, cores: int, asked: str | None = None) -> int:
    """Build workers beside one GPU lane. GPU candidates take seconds to build and microseconds to time,
    so by default each GPU lane gets an equal part of the host's cores. Each build worker is an MPS client
    of its GPU, as is each lane: past 48 on one GPU the MPS server refuses new clients
    (cudaErrorDevicesUnavailable, seen on the H200 with seven lanes and their pools), so the pools of one
    GPU's lanes stay within that limit, one client left for serving."""
    pooled = [q for q in lanes if _kind_of(q).build_pool]
    gpu_lanes = len(pooled) or 1
    mine = lane_kinds.fault_domain(queue)
    on_gpu = sum(1 for q in pooled if lane_kinds.fault_domain(q) == mine) or 1
    workers = int(asked) if asked else max(1, cores // gpu_lanes)
    return max(1, min(workers, (MPS_MAX_CLIENTS - 1 - on_gpu) // on_gpu))


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


CLIENT_GRACE_S = 1.0  # SIGTERM to SIGKILL for a faulted GPU's clients
MAX_RESTARTS, RESTART_WINDOW_S = 5, 600.0  # a process restarted this often within the window is given up


def restart_backoff_s(recent_restarts: int) -> float:
    """Seconds a dead process waits before its next start: at once the first time, then 1, 2, 4, 8 s."""
    return 0.0 if recent_restarts <= 0 else min(30.0, 2.0 ** (recent_restarts - 1))


class NodeAgent:
    """`lanes`: this host's lane queues, one entry per worker process (a queue twice: two workers of the lane);
    `builders`: build workers per family the lanes build for (or `builder_families`), pinned to
    `builder_cores`; `supervise`: restart what dies and recover faulted GPUs in a background thread."""

    log_name = "sharetune.agent"

    def __init__(self, work_dir: Path, redis_url: str | None = None, lanes: list[str] | None = None,
                 log_level: str = "INFO", warm_kinds: str | None = None, supervise: bool = True, builders: int = 0,
                 builder_cores: str | None = None, builder_families: list[str] | None = None):
        self.work_dir = Path(work_dir).resolve()
        self.redis_url = redis_url or os.environ.get("REDIS_URL")
        # lanes given by their cores alone (measure.cpu.c0) are named for this host: node and share
        self.lanes = [lane_kinds.parse(q).queue for q in lanes] if lanes is not None else []
        self.log_level = log_level
        self.warm_kinds = warm_kinds or ",".join(sorted({_kind_of(q).target_kind for q in self.lanes})) or "llvm"
        self.mps = None  # the MPS daemon, when this agent started one
        self.gpu_uuids: dict[str, str] = {}  # uuid8 -> full UUID
        self.procs: dict[str, subprocess.Popen] = {}
        self.lane_procs: dict[str, tuple[str, int]] = {}  # process name -> (lane queue, instance)
        self.supervise = supervise
        # builder workers: stateless, one build at a time each, serving the lanes' families (read from the
        # live lanes' targets unless named), pinned to builder_cores if given
        self.builders = builders
        self.builder_cores = builder_cores
        self.builder_families = builder_families
        self.builder_procs: dict[str, str] = {}  # process name -> family
        self.service_procs: dict[str, object] = {}  # other processes restarted alike: process name -> how to start it
        self.given_up: dict[str, str] = {}  # process name -> why it is not started again
        self._dead_seen: dict[str, float] = {}  # process name -> when the supervisor first saw it dead
        self.recoveries: list[dict] = []  # what the supervisor did, with times (faults bench, tests)
        self._restarts: dict[str, list[float]] = {}
        self._gpu_attempts: dict = {}  # uuid8 -> services.measurer.gpu.GpuAttempt being judged
        self._gpu_failures: dict[str, int] = {}  # uuid8 -> recoveries that failed in a row
        self._gpu_phases: dict[str, dict] = {}  # uuid8 -> the phase times of its recovery in progress
        self.gpus_given_up: dict[str, str] = {}  # uuid8 -> why: no lane of it is restarted again
        self._supervisor = None
        self._stopping = None
        self._started_at = time.time()
        self._beat_stop = None
        self._forgotten: dict[str, int] = {}  # process name -> the exited pid whose liveness keys were deleted

    # ---- processes ---------------------------------------------------------------------------------

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["REDIS_URL"] = self.redis_url
        env["SHARETUNE_WORK_DIR"] = str(self.work_dir)
        env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
        env.setdefault("TVM_NUM_THREADS", "1")
        env["SHARETUNE_WARM_KINDS"] = self.warm_kinds
        if self.mps is not None:
            env.update(self.mps.environment())
        return env

    def _spawn(self, name: str, args: list[str], env: dict | None = None) -> subprocess.Popen:
        logs = self.work_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        out = open(logs / f"{name}.log", "ab")
        proc = subprocess.Popen(args, cwd=REPO, env=env or self._env(), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        self.procs[name] = proc
        return proc

    def pid_of(self, name: str) -> int | None:
        proc = self.procs.get(name)
        return proc.pid if proc is not None and proc.poll() is None else None

    def start_lane(self, queue: str, instance: int = 0, build_workers: int | None = None) -> subprocess.Popen:
        """`build_workers`: the size of a GPU lane's build pool (default: SHARETUNE_BUILD_WORKERS, else an
        equal part of the host's cores, see gpu_build_workers)."""
        lane = lane_kinds.parse(queue)
        kind, queue = lane_kinds.of(lane), lane.queue  # cores alone (measure.cpu.c0) are named for this host
        args = [sys.executable, "-m", "services.measurer", "--lane", queue, "--loglevel", self.log_level]
        if kind.device_uuid:
            if lane.gpu not in self.gpu_uuids:
                raise RuntimeError(f"lane {queue}: no GPU with UUID starting {lane.gpu} on this host")
            args += ["--gpu-uuid", self.gpu_uuids[lane.gpu]]
        env = self._env()
        if kind.build_pool:  # with builders the lane only times (it builds only what is re-sent to it)
            asked = str(build_workers) if build_workers else os.environ.get("SHARETUNE_BUILD_WORKERS")
            env["SHARETUNE_BUILD_WORKERS"] = "0" if self.builders else str(
                gpu_build_workers(self.lanes, queue, os.cpu_count() or 1, asked))
        name = f"lane-{queue}-{instance}" if instance else f"lane-{queue}"
        self.lane_procs[name] = (queue, instance)
        return self._spawn(name, args, env)

    def start_builder(self, family: str, instance: int) -> subprocess.Popen:
        name = f"builder-{family}-{instance}"
        args = [sys.executable, "-m", "services.measurer", "--builder", family, "--loglevel", self.log_level]
        if self.builder_cores:
            args += ["--cores", self.builder_cores]
        self.builder_procs[name] = family
        return self._spawn(name, args)

    def start_builders(self, wait_s: float = 300.0) -> list[str]:
        """`builders` workers for each family the lanes build for (or the families named)."""
        families = self.builder_families
        if families is None:
            r = store.connect(self.redis_url)
            families = sorted({lane_kinds.target_family(l.target) for l in store.live_lanes(r) if l.queue in self.lanes})
        started = []
        for family in families:
            for i in range(self.builders):
                self.start_builder(family, i)
                started.append(family)
        if wait_s and started:
            self.wait_for_builders(families, self.builders, wait_s)
        return families

    def wait_for_builders(self, families: list[str], count: int, timeout_s: float) -> None:
        r = store.connect(self.redis_url)
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            live = store.live_builders(r)
            if all(sum(b.family == f for b in live) >= count for f in families):
                return
            dead = [n for n in self.builder_procs if n in self.procs and self.procs[n].poll() is not None]
            if dead:
                raise RuntimeError(f"builder {dead[0]} exited at start (see {self.work_dir / 'logs' / (dead[0] + '.log')})")
            time.sleep(0.3)
        raise TimeoutError(f"builders of {families} did not come up in {timeout_s} s")

    def _restart_services(self, now: float) -> list[str]:
        """Builders, and the processes registered in service_procs (the local stack's planner, tuner clients and
        updater), keep their state in Redis (a job a dead tuner held is resumed by the reaper): one that died is
        started again after a back-off (restart_backoff_s), unless it keeps dying (MAX_RESTARTS in
        RESTART_WINDOW_S): then it is given up."""
        import functools
        import logging

        starters = {n: functools.partial(self.start_builder, f, int(n.rsplit("-", 1)[1]))
                    for n, f in self.builder_procs.items()}
        starters.update(self.service_procs)
        restarted = []
        for name, start in list(starters.items()):
            proc = self.procs.get(name)
            if proc is None or proc.poll() is None:
                continue
            if name in self.builder_procs:
                self._forget_dead(name, proc.pid)
            recent = [t for t in self._restarts.get(name, ()) if now - t < RESTART_WINDOW_S]
            if len(recent) >= MAX_RESTARTS:
                self._give_up(name, proc.returncode, len(recent))
                continue
            if self._backing_off(name, now):
                continue
            self._restarts.setdefault(name, []).append(now)
            new = start()
            logging.getLogger(self.log_name).warning("%s (pid %s) exited with %s: started again as pid %s",
                                                     name, proc.pid, proc.returncode, new.pid)
            restarted.append(name)
        restarted += self._restart_more(now)
        return restarted

    def _restart_more(self, now: float) -> list[str]:
        """What a subclass supervises besides processes (the local stack: its embedded Redis)."""
        return []

    def _backing_off(self, name: str, now: float) -> bool:
        """Whether a dead process still waits for its next start (its back-off runs from when it was seen dead)."""
        recent = sum(1 for t in self._restarts.get(name, ()) if now - t < RESTART_WINDOW_S)
        seen = self._dead_seen.setdefault(name, now)
        if now - seen < restart_backoff_s(recent):
            return True
        self._dead_seen.pop(name, None)
        return False

    def _give_up(self, name: str, code, restarts: int) -> None:
        import logging

        why = f"exited {code} after {restarts} restarts in {RESTART_WINDOW_S:.0f} s: not started again"
        self.given_up[name] = why
        self.builder_procs.pop(name, None)
        self.service_procs.pop(name, None)
        self.lane_procs.pop(name, None)
        self.procs.pop(name, None)
        self._dead_seen.pop(name, None)
        logging.getLogger(self.log_name).error("%s %s (see %s)", name, why, self.work_dir / "logs" / f"{name}.log")

    def services(self) -> list[dict]:
        """Every process the agent started with its liveness: name, kind, pid, alive, restarts, given_up (why)."""
        def kind(name):
            return ("lane" if name in self.lane_procs else "builder" if name in self.builder_procs
                    else name.rstrip("0123456789"))

        rows = []
        for name, proc in list(self.procs.items()):
            rows.append({"name": name, "kind": kind(name), "pid": proc.pid, "alive": proc.poll() is None,
                         "restarts": len(self._restarts.get(name, ())), "given_up": None})
        for name, why in list(self.given_up.items()):
            rows.append({"name": name, "kind": "lane" if name.startswith("lane-") else kind(name), "pid": None,
                         "alive": False, "restarts": len(self._restarts.get(name, ())), "given_up": why})
        return rows

    def _start_gpu_support(self) -> None:
        """Name GPUs by UUID, and start an MPS daemon (own pipe and log dirs) unless one answers."""
        from services.measurer.gpu import MpsDaemon
        from services.measurer.observers import make_observer
        from shared.ids import gpu8

        self.gpu_uuids = {gpu8(g.uuid): g.uuid for g in make_observer().inventory()}
        mps = MpsDaemon(self.work_dir / "mps" / "pipe", self.work_dir / "mps" / "log")
        mps.start()
        self.mps = mps

    def check_cores(self) -> None:
        """Before anything starts: CoresTaken when this agent's lanes would time on cores another live process
        of this host holds (another agent, a hand-started lane), unless SHARETUNE_CORE_OVERLAP=warn. Two
        lanes of this agent on one core are refused the same way."""
        from shared import hostcores
        from shared.settings import LaneSettings

        s = LaneSettings()
        hostcores.check_free([(q, lane_kinds.parse(q).cores) for q in self.lanes], s.core_lock_dir, s.core_overlap)

    def start(self, wait_lanes_s: float = 300.0) -> "NodeAgent":
        self.prepare()
        self.launch(wait_lanes_s)
        return self

    def prepare(self) -> None:
        """Before any process starts: the host's cores are free for these lanes, its GPUs named, its MPS
        daemon up."""
        self.check_cores()
        if any(_kind_of(q).device_uuid for q in self.lanes):
            self._start_gpu_support()

    def launch(self, wait_lanes_s: float = 300.0) -> None:
        """Start the lanes (and wait until they are live), the builders, the liveness beat and the supervisor."""
        for i, lane in enumerate(self.lanes):
            self.start_lane(lane, instance=self.lanes[:i].count(lane))
        if wait_lanes_s:
            self.wait_for_lanes(self.lanes, wait_lanes_s)
        if self.builders:
            self.start_builders(wait_lanes_s)
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
                         gpus=sorted(self.gpu_uuids.values()), restarts=sum(map(len, self._restarts.values())),
                         recoveries=len(self.recoveries), given_up={**self.given_up, **self.gpus_given_up})

    def _beat(self) -> None:
        store.announce_agent(store.connect(self.redis_url), self.info())

    # ---- supervision: lanes that die come back; a GPU fault restarts MPS and that GPU's lanes ----------

    def start_supervisor(self, poll_s: float = 0.5) -> None:
        import threading

        self._stopping = threading.Event()
        self._supervisor = threading.Thread(target=self._supervise, args=(poll_s,), name="node-agent-supervisor", daemon=True)
        self._supervisor.start()

    def _supervise(self, poll_s: float) -> None:
        import logging

        log = logging.getLogger(self.log_name)
        fault_seen = time.time()
        while not self._stopping.wait(poll_s):
            try:
                fault_seen = self.recover_once(fault_seen)
                self._restart_services(time.time())
            except Exception:  # noqa: BLE001 - e.g. Redis restarting; the next round retries
                log.warning("supervisor round failed", exc_info=True)

    def recover_once(self, faults_since: float) -> float:
        """One round: find lane processes that ended and GPU faults reported since `faults_since`, judge
        the GPU recoveries still in doubt, act on services.measurer.gpu.plan_recovery's decision; returns
        the new `faults_since`."""
        from services.measurer.gpu import LaneExit, plan_recovery

        now = time.time()
        exits = [LaneExit(name, q, self.procs[name].returncode, now) for name, (q, _) in list(self.lane_procs.items())
                 if name in self.procs and self.procs[name].poll() is not None
                 # a lane that shares a fault domain is restarted by the recovery plan, at once
                 and (lane_kinds.fault_domain(q) or not self._backing_off(name, now))]
        faults = []
        if self.gpu_uuids:
            r = store.connect(self.redis_url)
            faults = [f for g in self.gpu_uuids if g not in self.gpus_given_up
                      for f in store.gpu_faults(r, g, since=faults_since)]
        for e in exits:
            self._forget_dead(e.name, self.procs[e.name].pid)
        plan = plan_recovery(exits, faults, self._restarts, now, gpu_fault_code=names.EXIT_GPU_FAULT)
        retry, give_up = self._judge_gpu_recoveries(now, set(plan.gpus), faults)
        if plan.empty and not (retry or give_up):
            return faults_since
        gpus = sorted((set(plan.gpus) | retry) - give_up - set(self.gpus_given_up))
        event = {"detected_at": now, "exits": {e.name: e.code for e in exits}, "gpus": gpus,
                 "restarted": list(plan.restart), "given_up": list(plan.given_up), "gpus_given_up": sorted(give_up),
                 "faults": [f.model_dump() for f in faults]}
        for name in plan.given_up:
            self._give_up(name, event["exits"].get(name), len(self._restarts.get(name, ())))
        for gpu8 in sorted(give_up):
            event.setdefault("gpu_resets", {})[gpu8] = self._give_up_gpu(gpu8, faults)
        for gpu8 in gpus:
            event.setdefault("gpu_lanes", []).extend(self._restart_gpu(gpu8, event))
        for name in plan.restart:
            if name in self.lane_procs:
                self._restart_lane(name)
        event["restarted_at"] = time.time()
        self.recoveries.append(event)
        # reports that arrive while a GPU recovers belong to the same incident (lanes stopping)
        return max([faults_since] + [f.at + 1e-6 for f in faults] + ([event["restarted_at"]] if gpus or give_up else []))

    def _forget_dead(self, name: str, pid: int) -> None:
        """A lane or builder process of ours has exited: its liveness key goes now, so a tuner waiting on a batch
        there re-sends it at once, not after the key's TTL (a worker id is host.pid; a lane's exec keeps the pid).
        Once per exited process: a dead builder in its back-off is seen again every round."""
        if self._forgotten.get(name) == pid:
            return
        self._forgotten[name] = pid
        try:
            from shared.ids import worker_id

            # one try, never the outage-riding client: the supervisor's round must not wait on a Redis restart
            store.forget_worker(store.connect_probe(self.redis_url, 2.0), worker_id(socket.gethostname(), pid))
        except Exception:  # noqa: BLE001 - Redis restarting: the key lapses by its TTL instead
            pass

    def _restart_lane(self, name: str) -> None:
        import logging

        queue, instance = self.lane_procs[name]
        old = self.procs.pop(name, None)
        self._restarts.setdefault(name, []).append(time.time())
        new = self.start_lane(queue, instance)
        logging.getLogger(self.log_name).warning("%s (pid %s) exited with %s: started again as pid %s", name,
                                                     getattr(old, "pid", None), getattr(old, "returncode", None),
                                                     getattr(new, "pid", None))

    def _gpu_lane_names(self, gpu8: str) -> list[str]:
        return [n for n, (q, _) in self.lane_procs.items() if lane_kinds.fault_domain(q) == gpu8]

    def _restart_gpu(self, gpu8: str, event: dict | None = None) -> list[str]:
        """End every MPS client of the GPU and, where it serves that GPU alone, its server; then start the
        GPU's lanes again and judge the recovery in later rounds. The phase times (fault reported, detected
        here, clients ended, MPS restarted, lanes started, then live and first batch measured, filled in by
        later rounds) go into the event: where a recovery's seconds go."""
        from services.measurer.gpu import GpuAttempt

        event = event if event is not None else {"detected_at": time.time(), "faults": []}
        reported = [f["at"] for f in event.get("faults", ()) if f.get("gpu8") == gpu8]
        phases = {"fault_at": min(reported) if reported else None, "detected_at": event["detected_at"]}
        event.setdefault("phases", {})[gpu8] = phases
        lanes = self._gpu_lane_names(gpu8)
        reset = self._reset_gpu_clients(gpu8, phases)
        event.setdefault("gpu_resets", {})[gpu8] = reset
        for name in lanes:
            self._restart_lane(name)
        phases["lanes_started_at"] = time.time()
        self._gpu_phases[gpu8] = phases
        self._gpu_attempts[gpu8] = GpuAttempt(gpu8, restarted_at=time.time(), failures=self._gpu_failures.get(gpu8, 0))
        return lanes

    def _reset_gpu_clients(self, gpu8: str, phases: dict | None = None) -> dict:
        """Every process the agent started for the GPU (lanes, build pools: whole sessions, exited leaders
        included) and every other client of the MPS server serving it, ended by PID; other GPUs' lanes and
        their children are never touched. The server goes too when it serves this GPU alone. Returns what
        was done (errors as data)."""
        import logging

        from services.measurer.gpu import plan_gpu_reset

        log = logging.getLogger(self.log_name)
        mine = self._gpu_lane_names(gpu8)
        gpu_roots = [self.procs[n].pid for n in mine if n in self.procs]
        # exited ones too: their sessions (a build pool left behind) belong to their own GPU
        other_roots = [p.pid for n, p in self.procs.items() if n in self.lane_procs and n not in mine]
        servers = self.mps.servers() if self.mps is not None else {}
        plan = plan_gpu_reset(self._process_table(), gpu_roots, other_roots, servers,
                                      daemon_is_ours=bool(self.mps is not None and self.mps.started), me=os.getpid())
        done = {"servers": {str(k): list(v) for k, v in servers.items()}, "end": list(plan.end),
                "kill_servers": list(plan.kill_servers), "kept_servers": list(plan.kept), "quit_daemon": plan.quit_daemon}
        # a faulted GPU's clients hold nothing worth a long warm shutdown: a short grace, then SIGKILL
        done["clients"] = self._end_pids(plan.end, grace_s=CLIENT_GRACE_S)
        for name in mine:  # reap the leaders we started (no zombies left behind)
            proc = self.procs.get(name)
            if proc is not None:
                try:
                    proc.wait(5)
                except subprocess.TimeoutExpired:
                    done.setdefault("unreaped", []).append(proc.pid)
        try:
            self._forget_gpu_lanes(gpu8, set(gpu_roots))
        except Exception as err:  # noqa: BLE001 - Redis restarting: the keys lapse by their TTL instead
            done["forget_error"] = str(err)
        if phases is not None:
            phases["clients_ended_at"] = time.time()
        # the servers go by PID before the daemon is asked to quit: a server that still counts clients (a
        # faulted one does, for a while after they exited) holds a 'quit' for its 10 s timeout
        done["servers_ended"] = self._end_pids(plan.kill_servers, grace_s=5.0)
        if plan.quit_daemon:
            try:
                self.mps.stop()  # waits until the daemon is gone (its servers were ended above)
            except Exception as err:  # noqa: BLE001 - the daemon outlived its servers: its lanes will say so
                done["daemon_error"] = str(err)
            try:
                self.mps.start()
            except Exception as err:  # noqa: BLE001 - lanes refuse to run without a daemon: the recovery fails
                done["daemon_error"] = str(err)
                log.error("MPS daemon restart failed", exc_info=True)
        if phases is not None:
            phases["mps_restarted_at"] = time.time() if plan.quit_daemon else None
        log.warning("GPU %s reset: %s", gpu8, done)
        return done

    def _forget_gpu_lanes(self, gpu8: str, pids: set[int]) -> None:
        """The ended lanes' liveness keys and their entries in the GPU's gate go at once: a tuner re-sends
        what they held without waiting out their TTL, and a suspect of the restarted lanes does not wait for
        a dead lane's candidate."""
        r = store.connect(self.redis_url)
        for info in store.live_lanes(r):
            if info.pid in pids and lane_kinds.fault_domain(info.queue) == gpu8:
                store.retire_lane(r, info)
        store.clear_gpu_isolation(r, gpu8)

    # the host's process table and a signal sender; replaced by fakes in tests
    def _process_table(self) -> dict:
        from services.measurer.gpu import read_process_table

        return read_process_table()

    def _end_pids(self, pids, grace_s: float = 3.0) -> dict:
        from services.measurer.gpu import end_processes

        return end_processes(pids, grace_s)

    def _judge_gpu_recoveries(self, now: float, faulted: set[str], faults=()) -> tuple[set[str], set[str]]:
        """Judge each GPU recovery in doubt (services.measurer.gpu.judge_recovery): returns the GPUs to
        recover again (their lanes never came back) and those to give up (recoveries failed twice in a row).
        A fault a restarted lane reports with its candidate shows the lanes measuring again: a new incident."""
        from services.measurer.gpu import Verdict, give_up_gpu, judge_recovery, measured_by_fault

        retry, give_up = set(), set()
        for gpu8, attempt in list(self._gpu_attempts.items()):
            attempt = measured_by_fault(self._observe_attempt(attempt, now), faults)
            verdict = judge_recovery(attempt, now, now if gpu8 in faulted else None)
            if verdict == Verdict.PENDING:
                self._gpu_attempts[gpu8] = attempt
                continue
            del self._gpu_attempts[gpu8]
            self._gpu_failures[gpu8] = 0 if verdict == Verdict.OK else attempt.failures + 1
            if verdict == Verdict.FAILED:
                (give_up if give_up_gpu(self._gpu_failures[gpu8]) else retry).add(gpu8)
        return retry, give_up

    def _observe_attempt(self, attempt, now: float):
        """When every lane of the GPU was live again, and when one of them had answered a batch."""
        from dataclasses import replace

        pids = {self.procs[n].pid for n in self._gpu_lane_names(attempt.gpu8) if n in self.procs}
        live = [l for l in store.live_lanes(store.connect(self.redis_url)) if l.pid in pids]
        phases = self._gpu_phases.get(attempt.gpu8, {})
        if attempt.live_at is None and pids and len({l.pid for l in live}) >= len(pids):
            attempt = replace(attempt, live_at=now)
            phases["lanes_live_at"] = now
        if attempt.measured_at is None and any(l.batches > 0 for l in live):
            attempt = replace(attempt, measured_at=now)
            phases["first_batch_at"] = now
        return attempt

    def _give_up_gpu(self, gpu8: str, faults) -> dict:
        """Stop the GPU's lanes for good (their clients ended, so the MPS server holds nothing of them) and
        write a clear error to the store: the lanes view and the jobs that used the GPU show it."""
        import logging

        lanes = self._gpu_lane_names(gpu8)
        queues = sorted({self.lane_procs[n][0] for n in lanes})
        reset = self._reset_gpu_clients(gpu8)
        last = next((f.error for f in reversed(faults) if f.gpu8 == gpu8), None)
        why = (f"GPU {self.gpu_uuids.get(gpu8, gpu8)} given up: {self._gpu_failures.get(gpu8, 0)} recoveries in a row "
               f"failed (lanes did not come back measuring, or faulted again at once); its lanes {', '.join(queues)} "
               f"are stopped, other GPUs' lanes go on" + (f"; last fault: {last[:300]}" if last else ""))
        self.gpus_given_up[gpu8] = why
        for name in lanes:
            self.procs.pop(name, None)
            self.lane_procs.pop(name, None)
            self.given_up[name] = why
        reset["jobs"] = store.give_up_gpu(store.connect(self.redis_url), gpu8, why, queues)
        logging.getLogger(self.log_name).error(why)
        return reset

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
        proc = self.procs.pop(name, None)
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)  # its own session: the group is what we started
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

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
        for name in list(self.procs):
            self.stop_process(name)
        if self.mps is not None:
            self.mps.stop()  # only if this agent started it
            self.mps = None

    def __enter__(self):
        # a SIGTERM to this process (a timeout, a supervisor) must still stop what it started
        import threading

        if threading.current_thread() is threading.main_thread():
            def _term(signum, frame):
                raise SystemExit(128 + signum)

            self._old_term = signal.signal(signal.SIGTERM, _term)
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc):
        self.stop()
        old = getattr(self, "_old_term", None)
        if old is not None:
            signal.signal(signal.SIGTERM, old)

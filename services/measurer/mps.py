"""The MPS lane manager's core: the CUDA MPS control daemon that makes GPU percentages real, and the plan
of which GPU lanes (GPU, percent) a host runs.

A GPU lane below 100 % relies on MPS: its process sets CUDA_MPS_ACTIVE_THREAD_PERCENTAGE and talks to
the control daemon through the pipe directory. Without a daemon that variable is silently ignored and
the lane would run on the whole GPU, so a partial lane without MPS is refused, never run unshared.

Every subprocess goes through one injectable runner (``Runner``), so the command lines and the
environment can be checked without a GPU.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from shared.errors import LaneError, ShareError
from shared.ids import gpu_hex as _hex
from shared.names import LaneName

CONTROL_BINARY = "nvidia-cuda-mps-control"


# --------------------------------------------------------------------------------------------- GPUs
@dataclass(frozen=True)
class GpuInfo:
    """One physical GPU of this host, as an observer's inventory reports it."""

    index: int
    uuid: str  # full NVML UUID, "GPU-3f2a1c9b-...."
    name: str
    memory_total_mb: int
    sm_count: int | None = None
    compute_capability: tuple[int, int] | None = None

    @property
    def uuid8(self) -> str:
        """The 8 hex digits a lane queue name carries (see shared.names.LaneName)."""
        return _hex(self.uuid)[:8]

    @property
    def label(self) -> str:
        return f"GPU {self.index} ({self.uuid}, {self.name})"

    def to_dict(self) -> dict:
        d = asdict(self)
        d["compute_capability"] = list(self.compute_capability) if self.compute_capability else None
        return d


# ------------------------------------------------------------------------------------ the runner
@dataclass(frozen=True)
class CommandResult:
    returncode: int
    stdout: str = ""
    stderr: str = ""


# runner(argv, env, input, timeout) -> CommandResult. ``env`` holds only the variables to add to the
# inherited environment; ``input`` is text for stdin or None.
Runner = Callable[[Sequence[str], Mapping[str, str], "str | None", float], CommandResult]


def run_command(argv: Sequence[str], env: Mapping[str, str], input: str | None, timeout: float) -> CommandResult:
    """The real runner. Output goes to temporary files, not pipes: ``nvidia-cuda-mps-control -d`` forks
    a daemon that may keep inherited descriptors open, and waiting for a pipe's end would then hang."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        try:
            proc = subprocess.run(
                list(argv),
                env={**os.environ, **env},
                input=input,
                stdin=None if input is not None else subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                text=True,
                timeout=timeout,
            )
            code = proc.returncode
        except FileNotFoundError as e:
            return CommandResult(127, "", str(e))
        except subprocess.TimeoutExpired:
            code = 124
        out.seek(0)
        err.seek(0)
        return CommandResult(code, out.read(), err.read() or ("timed out" if code == 124 else ""))


# ----------------------------------------------------------------------------------- the daemon
class MpsDaemon:
    """The MPS control daemon of one pipe directory.

    ``start()`` starts a daemon only when none answers on that pipe directory and remembers whether it
    did; ``stop()`` stops only a daemon this object started. Lanes must run with ``environment()`` (the
    same pipe and log directories) added to their own variables: see ``client_environment``.
    """

    def __init__(
        self,
        pipe_dir: Path | str,
        log_dir: Path | str,
        control_binary: str = CONTROL_BINARY,
        *,
        runner: Runner = run_command,
        which: Callable[[str], str | None] = shutil.which,
        timeout_s: float = 10.0,
        poll_s: float = 0.1,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.pipe_dir = Path(pipe_dir)
        self.log_dir = Path(log_dir)
        self.control_binary = control_binary
        self.runner = runner
        self._which = which
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self._sleep = sleep
        self._clock = clock
        self.started = False  # True only while a daemon this object started runs

    # -- commands
    @property
    def control_pipe(self) -> Path:
        return self.pipe_dir / "control"

    def environment(self) -> dict[str, str]:
        return {"CUDA_MPS_PIPE_DIRECTORY": str(self.pipe_dir), "CUDA_MPS_LOG_DIRECTORY": str(self.log_dir)}

    def start_command(self) -> list[str]:
        return [self.control_binary, "-d"]

    def quit_command(self) -> tuple[list[str], str]:
        return [self.control_binary], "quit\n"

    def query_command(self) -> tuple[list[str], str]:
        return [self.control_binary], "get_server_list\n"

    def client_list_command(self, server_pid: int) -> tuple[list[str], str]:
        return [self.control_binary], f"get_client_list {int(server_pid)}\n"

    def available(self) -> bool:
        return self._which(self.control_binary) is not None

    def servers(self) -> dict[int, list[int]]:
        """MPS server PID -> its client PIDs, as the daemon reports them ({} when none answers)."""
        argv, text = self.query_command()
        res = self._run(argv, text)
        if res.returncode != 0:
            return {}
        out = {}
        for pid in parse_pids(res.stdout):
            argv, text = self.client_list_command(pid)
            got = self._run(argv, text)
            out[pid] = parse_pids(got.stdout) if got.returncode == 0 else []
        return out

    def request_quit(self) -> CommandResult:
        """Ask the daemon (and its servers) to exit, without waiting: a server with live clients stays."""
        argv, text = self.quit_command()
        return self._run(argv, text)

    # -- state
    def is_running(self) -> bool:
        """A daemon serves this pipe directory: its control pipe exists and it answers a query."""
        if not self.control_pipe.exists():
            return False
        argv, text = self.query_command()
        return self._run(argv, text).returncode == 0

    def start(self) -> bool:
        """Start a daemon unless one already serves the pipe directory. True when this call started it."""
        if self.is_running():
            return False
        if not self.available():
            raise LaneError(f"MPS is not available ({self.control_binary} not found): cannot start its daemon")
        self.pipe_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        res = self._run(self.start_command(), None)
        if res.returncode != 0:
            raise LaneError(
                f"MPS control daemon did not start (exit {res.returncode}): {(res.stderr or res.stdout).strip()}"
                f" [pipe dir {self.pipe_dir}, log dir {self.log_dir}]"
            )
        if not self._wait(self.is_running, True):
            raise LaneError(
                f"MPS control daemon started but does not answer on {self.control_pipe} after {self.timeout_s} s;"
                f" see {self.log_dir / 'control.log'}"
            )
        self.started = True
        return True

    def stop(self) -> bool:
        """Stop the daemon if this object started it (never one it found running). True when stopped."""
        if not self.started:
            return False
        argv, text = self.quit_command()
        res = self._run(argv, text)
        if not self._wait(self.is_running, False):
            raise LaneError(
                f"MPS control daemon on {self.pipe_dir} still runs {self.timeout_s} s after 'quit'"
                f" (exit {res.returncode}: {(res.stderr or res.stdout).strip()})"
            )
        self.started = False
        return True

    # -- lanes
    def require_for(self, lanes: Iterable) -> list[int]:
        """Refuse when a GPU lane below 100 % would run without MPS. ``lanes``: LaneName or (LaneName,
        count) pairs, as ``plan_gpu_lanes`` returns. Returns the partial percents (empty: MPS not needed)."""
        partial = sorted({lane.percent for lane in _lanes(lanes) if lane.kind == "gpu" and lane.percent < 100})
        if partial and not self.available():
            raise LaneError(
                f"MPS is not available ({self.control_binary} not found): refusing to run GPU lanes at "
                f"{', '.join(f'{p} %' for p in partial)} unshared"
            )
        return partial

    def ensure_for(self, lanes: Iterable) -> bool:
        """Make sure MPS serves the planned lanes: refuse without MPS, start the daemon when a partial lane
        needs one and none runs. True when the lanes must run with ``environment()``."""
        if not self.require_for(lanes):
            return self.is_running()  # only full lanes: use MPS if one already runs, never start it
        self.start()
        return True

    def check_lane(self, lane: LaneName) -> None:
        """For a lane worker about to start: a partial GPU lane needs a daemon answering on the pipe dir."""
        if self.require_for([lane]) and not self.is_running():
            raise LaneError(
                f"no MPS control daemon answers on {self.pipe_dir}: refusing to run GPU lane {lane.queue} "
                f"at {lane.percent} % unshared"
            )

    def client_environment(self, lane: LaneName, gpu_uuid: str) -> dict[str, str]:
        """Everything a GPU lane's process needs before CUDA starts: its share and the daemon's dirs."""
        from services.measurer.lanes import lane_environment

        return {**lane_environment(lane, gpu_uuid), **self.environment()}

    # -- helpers
    def _run(self, argv: Sequence[str], text: str | None) -> CommandResult:
        return self.runner(list(argv), self.environment(), text, self.timeout_s)

    def _wait(self, probe: Callable[[], bool], want: bool) -> bool:
        deadline = self._clock() + self.timeout_s
        while True:
            if probe() == want:
                return True
            if self._clock() >= deadline:
                return False
            self._sleep(self.poll_s)

    def __enter__(self) -> "MpsDaemon":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _lanes(lanes: Iterable) -> list[LaneName]:
    return [item[0] if isinstance(item, tuple) else item for item in lanes]


# -------------------------------------------------------------------------------------- the plan
_ITEM = re.compile(r"^(?:(?P<count>\d+)\s*[x×*]\s*)?(?P<pct>-?\d+)\s*%?$", re.IGNORECASE)


def parse_share_spec(spec: str | int | Sequence[int]) -> list[int]:
    """"4x25" -> [25, 25, 25, 25]; "25,25,50" -> [25, 25, 50]; "2x25,50" -> [25, 25, 50]; 100 -> [100].
    Only the syntax is checked here; ranges are checked per GPU by ``plan_gpu_lanes``."""
    if isinstance(spec, bool):
        raise ShareError(f"not a GPU share spec: {spec!r}")
    if isinstance(spec, int):
        return [spec]
    if not isinstance(spec, str):
        try:
            return [int(p) for p in spec]
        except (TypeError, ValueError):
            raise ShareError(f"not a GPU share spec: {spec!r}") from None
    percents: list[int] = []
    for item in spec.split(","):
        m = _ITEM.match(item.strip())
        if not m:
            raise ShareError(f"not a GPU share spec: {spec!r} (expected e.g. '4x25', '1x100' or '25,25,50')")
        count = int(m["count"]) if m["count"] is not None else 1
        if count < 1:
            raise ShareError(f"GPU share spec {spec!r} asks for {count} lanes of {m['pct']} %")
        percents += [int(m["pct"])] * count
    return percents


def find_gpu(gpus: Sequence[GpuInfo], key: int | str) -> GpuInfo:
    """A GPU by index (an int, or a string of digits naming an index) or else by UUID prefix ("GPU-3f2a",
    "3f2a1c9b"). A prefix matching several GPUs is refused as ambiguous."""
    have = ", ".join(f"{g.index}: {g.uuid}" for g in gpus) or "none"
    if isinstance(key, bool) or not isinstance(key, (int, str)):
        raise ShareError(f"not a GPU index or UUID prefix: {key!r}")
    if isinstance(key, int):
        found = [g for g in gpus if g.index == key]
    else:
        text = key.strip().lower()
        hexkey = _hex(text)
        if not hexkey:
            raise ShareError(f"not a GPU index or UUID prefix: {key!r}")
        found = [g for g in gpus if g.index == int(text)] if text.isdigit() else []
        if not found:
            found = [g for g in gpus if _hex(g.uuid).startswith(hexkey)]
    if not found:
        raise ShareError(f"GPU {key!r} is not in this host's inventory (GPUs: {have})")
    if len(found) > 1:
        raise ShareError(f"GPU {key!r} is ambiguous: it names {', '.join(g.label for g in found)}")
    return found[0]


def gpu_for_lane(gpus: Sequence[GpuInfo], lane: LaneName) -> GpuInfo:
    """The inventory GPU a GPU lane runs on (the lane carries only the UUID's first 8 hex digits)."""
    return find_gpu(gpus, lane.gpu)


def plan_gpu_lanes(
    gpus: Sequence[GpuInfo], spec: str | dict, max_total_percent: int = 100
) -> list[tuple[LaneName, int]]:
    """The GPU lanes this host runs, as (lane, number of worker processes) pairs, by GPU index.

    ``spec`` is one share spec for every GPU ("4x25", "2x50", "1x100", "25,25,50") or a dict
    {GPU index or UUID prefix: share spec} naming some GPUs (the others get no lane). Lanes with the same
    (GPU, percent) share one queue name, so they appear once with their count: "4x25" on one GPU is
    [(measure.<uuid8>.p25, 4)] -- four Celery worker processes serving that one queue.

    Refused (ShareError): a percent outside 1..100; shares on one GPU summing past
    ``max_total_percent``; a GPU the inventory lacks (or named twice); an empty plan.
    """
    if isinstance(max_total_percent, bool) or not isinstance(max_total_percent, int) or max_total_percent < 1:
        raise ShareError(f"max_total_percent must be a positive whole percent, not {max_total_percent!r}")
    seen8: dict[str, GpuInfo] = {}
    for g in gpus:
        if g.uuid8 in seen8:
            raise ShareError(
                f"{g.label} and {seen8[g.uuid8].label} share the UUID prefix {g.uuid8}: their lane queues would collide"
            )
        seen8[g.uuid8] = g

    if isinstance(spec, Mapping):
        per_gpu: dict[int, tuple[GpuInfo, list[int]]] = {}
        for key, sub in spec.items():
            gpu = find_gpu(gpus, key)
            if gpu.index in per_gpu:
                raise ShareError(f"{gpu.label} is named twice in the lane plan")
            per_gpu[gpu.index] = (gpu, parse_share_spec(sub))
        assignments = [per_gpu[i] for i in sorted(per_gpu)]
    else:
        percents = parse_share_spec(spec)
        assignments = [(g, percents) for g in sorted(gpus, key=lambda g: g.index)]

    plan: list[tuple[LaneName, int]] = []
    for gpu, percents in assignments:
        for p in percents:
            if not 1 <= p <= 100:
                raise ShareError(f"{gpu.label}: share {p} % is outside 1..100 %")
        total = sum(percents)
        if total > max_total_percent:
            raise ShareError(
                f"{gpu.label}: shares {' + '.join(map(str, percents))} = {total} % exceed the limit of "
                f"{max_total_percent} %"
            )
        counts: dict[int, int] = {}
        for p in percents:
            counts[p] = counts.get(p, 0) + 1
        plan += [(LaneName.for_gpu(gpu.uuid, p), n) for p, n in counts.items()]
    if not plan:
        where = "the inventory has no GPU" if not gpus else f"spec {spec!r} names no lane"
        raise ShareError(f"empty GPU lane plan: {where}")
    return plan


# ---------------------------------------------------------------------------- faults and recovery
# Under MPS a kernel that faults (illegal address, ...) takes down every client of that GPU's server:
# the culprit sees its own fault, its neighbours see their contexts torn down. The server takes no new
# clients until all of them have exited, so recovery is: every lane of the GPU exits, the daemon is
# restarted, the lanes start again, and the tuner re-sends what they left unanswered.

_CULPRIT = ("illegal memory access", "illegal address", "misaligned address", "illegal instruction",
            "device-side assert", "hardware stack error", "invalid program counter", "out of bounds")
_VICTIM = ("mps", "context is destroyed", "context destroyed", "launch failure", "not yet initialized",
           "exclusive-process", "busy or unavailable")


def classify_cuda_error(error: str | None) -> str | None:
    """How a candidate's error bears on its lane's CUDA context: "culprit" (its own kernel faulted),
    "victim" (a neighbour's fault took the context), or None (an ordinary error: a failed build, too many
    threads, out of memory; the lane goes on). The lane probes its context after any other run error and
    calls a dead one "unknown" (see services.measurer.tasks)."""
    if not error:
        return None
    text = error.lower()
    if error.startswith("build failed"):
        return None
    if any(p in text for p in _CULPRIT):
        return "culprit"
    if any(p in text for p in _VICTIM):
        return "victim"
    return None


@dataclass(frozen=True)
class LaneExit:
    """A lane process of the stack that ended: its process name, queue and exit code."""

    name: str
    queue: str
    code: int | None
    at: float


@dataclass(frozen=True)
class Recovery:
    """What the supervisor does next. `gpus`: GPUs (uuid8) whose lanes all stop, whose MPS daemon is
    restarted and whose lanes start again; `restart`: other lane processes to start again; `given_up`:
    lanes that died too often to restart (reported, not restarted)."""

    gpus: tuple[str, ...] = ()
    restart: tuple[str, ...] = ()
    given_up: tuple[str, ...] = ()

    @property
    def empty(self) -> bool:
        return not (self.gpus or self.restart or self.given_up)


def plan_recovery(exits: Sequence[LaneExit], faults: Sequence, history: Mapping[str, Sequence[float]],
                  now: float, max_restarts: int = 5, window_s: float = 600.0, gpu_fault_code: int = 75) -> Recovery:
    """Decide, from what was observed, which lanes to restart. Pure: `exits` are lane processes seen
    ended, `faults` GpuFault-like records (with .gpu8) reported since the last recovery, `history`
    lane name -> times it was restarted. A GPU with a reported fault, or a lane that exited with the
    GPU-fault code, is recovered as a whole; a lane restarted `max_restarts` times within `window_s`
    is given up (a crash loop is not hidden behind restarts)."""
    gpus = {f.gpu8 for f in faults if getattr(f, "gpu8", None)}
    restart, given_up = [], []
    died: dict[str, int] = {}
    for ex in exits:
        lane = LaneName.parse(ex.queue)
        if lane.kind == "gpu" and ex.code == gpu_fault_code:
            gpus.add(lane.gpu)
        elif lane.kind == "gpu" and ex.code:
            died[lane.gpu] = died.get(lane.gpu, 0) + 1
    # several lanes of one GPU dying together, with no report: an MPS server that took its clients down
    gpus |= {g for g, n in died.items() if n >= 2}
    for ex in exits:
        lane = LaneName.parse(ex.queue)
        recent = [t for t in history.get(ex.name, ()) if now - t < window_s]
        if len(recent) >= max_restarts:
            given_up.append(ex.name)
        elif not (lane.kind == "gpu" and lane.gpu in gpus):
            restart.append(ex.name)
    return Recovery(gpus=tuple(sorted(gpus)), restart=tuple(sorted(restart)), given_up=tuple(sorted(given_up)))


def diagnose(faults: Sequence) -> dict:
    """Which candidate took a GPU down, from the lanes' fault reports of one incident: the culprits
    (their own kernel faulted), else the suspects (in flight, role unknown). Victims are innocent."""
    culprits = sorted({f.candidate_hash for f in faults if f.role == "culprit" and f.candidate_hash})
    suspects = sorted({f.candidate_hash for f in faults if f.role == "unknown" and f.candidate_hash})
    return {"culprits": culprits, "suspects": [] if culprits else suspects,
            "victims": sorted({f.candidate_hash for f in faults if f.role == "victim" and f.candidate_hash})}


# ------------------------------------------------------------------- ending a faulted GPU's clients
# The server of a faulted GPU takes no new client until every old one has exited, and every process that
# touched CUDA there is one: lanes, their build pools, anything else on the server's client list. So a
# recovery ends all of them by PID, then makes sure the server itself is gone, then starts the lanes.

@dataclass(frozen=True)
class ProcEntry:
    """One row of the host's process table: enough to find a process tree, orphans included."""

    pid: int
    ppid: int
    pgid: int
    sid: int


def read_process_table(proc: Path | str = "/proc") -> dict[int, ProcEntry]:
    """pid -> ProcEntry for every process readable under /proc (fields 4, 5, 6 of /proc/PID/stat)."""
    table: dict[int, ProcEntry] = {}
    for d in Path(proc).iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue  # ended while we looked
        fields = stat.rsplit(")", 1)[-1].split()
        if len(fields) >= 4 and fields[0] != "Z":  # a zombie holds no CUDA context
            table[int(d.name)] = ProcEntry(int(d.name), int(fields[1]), int(fields[2]), int(fields[3]))
    return table


def process_family(table: Mapping[int, ProcEntry], roots: Iterable[int]) -> set[int]:
    """The processes started from `roots`: their descendants, plus every process of their sessions and
    process groups (a build-pool worker whose lane already exited is re-parented to init, but keeps the
    lane's session: the stack starts each lane as a session leader)."""
    roots = set(roots)
    family = {p for p, e in table.items() if p in roots or e.sid in roots or e.pgid in roots}
    children: dict[int, list[int]] = {}
    for p, e in table.items():
        children.setdefault(e.ppid, []).append(p)
    todo = list(family | (roots & table.keys()))
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in family:
                family.add(child)
                todo.append(child)
    return family


def parse_pids(text: str) -> list[int]:
    """PIDs, one a line, as get_server_list and get_client_list print them (other lines ignored)."""
    return [int(t) for t in (line.strip() for line in text.splitlines()) if t.isdigit()]


@dataclass(frozen=True)
class GpuReset:
    """What recovering one GPU ends. `end`: client PIDs (SIGTERM, then SIGKILL); `kill_servers`: MPS
    servers serving only that GPU's clients (killed when `quit` leaves them); `quit_daemon`: the control
    daemon is the stack's own and serves no other GPU's lane, so it is quit and started again; `kept`:
    servers left running because lanes of other GPUs are their clients (MPS recreates the faulted GPU's
    context once its clients have exited)."""

    end: tuple[int, ...] = ()
    kill_servers: tuple[int, ...] = ()
    quit_daemon: bool = False
    kept: tuple[int, ...] = ()


def plan_gpu_reset(table: Mapping[int, ProcEntry], gpu_roots: Iterable[int], other_roots: Iterable[int],
                   servers: Mapping[int, Sequence[int]], daemon_is_ours: bool, me: int) -> GpuReset:
    """Pure. `gpu_roots`: PIDs the stack started for the faulted GPU (lanes, running or exited);
    `other_roots`: those of other GPUs' lanes (never ended, nor their descendants); `servers`: MPS server
    PID -> its client PIDs; `me`: this process (never ended)."""
    ours = process_family(table, gpu_roots)
    protected = process_family(table, other_roots) | set(other_roots) | {me}
    end = set(ours)
    kill, kept = [], []
    for server, clients in sorted(servers.items()):
        clients = set(clients)
        if clients & protected:
            kept.append(server)
            end |= clients & ours  # only the faulted GPU's own clients on a shared server
        else:
            end |= clients  # a server with none of the other GPUs' lanes: all its clients go, then it goes
            kill.append(server)
    end -= protected | set(servers)
    return GpuReset(end=tuple(sorted(end)), kill_servers=tuple(kill), quit_daemon=daemon_is_ours and not kept,
                    kept=tuple(kept))


def end_processes(pids: Iterable[int], grace_s: float = 3.0, *, send: Callable[[int, int], None] = os.kill,
                  alive: Callable[[int], bool] | None = None, sleep: Callable[[float], None] = time.sleep,
                  clock: Callable[[], float] = time.monotonic, poll_s: float = 0.1) -> dict:
    """SIGTERM each PID, SIGKILL what is left after `grace_s`, wait up to `grace_s` more for them to go.
    Returns {"terminated", "killed", "survivors"} (lists of PIDs): errors as data, never raised."""
    import signal

    alive = alive or pid_alive
    pids = sorted(set(pids))
    out: dict[str, list[int]] = {"terminated": [], "killed": [], "survivors": []}

    def signal_all(group: list[int], sig: int) -> None:
        for pid in group:
            try:
                send(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def wait(group: list[int]) -> list[int]:
        deadline = clock() + grace_s
        while True:
            left = [p for p in group if alive(p)]
            if not left or clock() >= deadline:
                return left
            sleep(poll_s)

    signal_all(pids, signal.SIGTERM)
    left = wait(pids)
    out["terminated"] = [p for p in pids if p not in left]
    if left:
        signal_all(left, signal.SIGKILL)
        survivors = wait(left)
        out["killed"] = [p for p in left if p not in survivors]
        out["survivors"] = survivors
    return out


def pid_alive(pid: int) -> bool:
    """Alive and not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return False


# ---------------------------------------------------------------------- judging a GPU's recovery
@dataclass(frozen=True)
class GpuAttempt:
    """One recovery of a GPU: when its lanes were started again, when they were all live again, when one
    of them answered a batch; `failures`: recoveries of this GPU that failed just before this one."""

    gpu8: str
    restarted_at: float
    live_at: float | None = None
    measured_at: float | None = None
    failures: int = 0


def judge_recovery(attempt: GpuAttempt, now: float, faulted_again_at: float | None = None,
                   come_back_s: float = 300.0, settle_s: float = 20.0) -> str:
    """"ok", "failed" or "pending". Pure. A recovery failed when the lanes did not come back live within
    `come_back_s`, or the GPU faulted again before they were measuring (answered a batch, or stayed live
    for `settle_s`): a server still refusing clients, or a fault the restart did not cure."""
    confirmed_at = None
    if attempt.live_at is not None:
        confirmed_at = min(t for t in (attempt.measured_at, attempt.live_at + settle_s) if t is not None)
    if faulted_again_at is not None and faulted_again_at >= attempt.restarted_at:
        return "ok" if confirmed_at is not None and confirmed_at <= faulted_again_at else "failed"
    if attempt.live_at is None:
        return "failed" if now - attempt.restarted_at > come_back_s else "pending"
    return "ok" if confirmed_at <= now else "pending"


def give_up_gpu(failures: int, max_failed_recoveries: int = 2) -> bool:
    """A GPU whose recoveries failed this many times in a row is not restarted again."""
    return failures >= max_failed_recoveries


# ------------------------------------------------------------------------- hung kernels
def run_hung(started_at: float, timeout_s: float, now: float, margin_s: float = 10.0) -> bool:
    """Pure: has one candidate's build-and-run, started at `started_at`, outlived its allowance?"""
    return now - started_at > timeout_s + margin_s


def watchdog_allowance_s(timeout_s: float, builds_in_pool: bool) -> float:
    """A GPU lane waits up to `timeout_s` for a candidate's build from its pool, then runs it for up to
    `timeout_s`; in-process it builds and runs within one."""
    return timeout_s * (2 if builds_in_pool else 1)


class Watchdog:
    """A thread that watches the candidate the lane is running: armed before it, disarmed after; past its
    allowance, `on_hang(armed)` is called once (the lane reports and exits from there: a kernel that spins
    forever never returns control to the lane's own thread)."""

    def __init__(self, on_hang: Callable[[dict], None], margin_s: float = 10.0, poll_s: float = 1.0,
                 clock: Callable[[], float] = time.time):
        import threading

        self.on_hang, self.margin_s, self.poll_s, self.clock = on_hang, margin_s, poll_s, clock
        self._armed: dict | None = None
        self._lock = threading.Lock()
        self._thread = None

    def arm(self, allowance_s: float, **what) -> None:
        with self._lock:
            self._armed = {**what, "started_at": self.clock(), "allowance_s": allowance_s}
        if self._thread is None:
            import threading

            self._thread = threading.Thread(target=self._watch, name="lane-watchdog", daemon=True)
            self._thread.start()

    def disarm(self) -> None:
        with self._lock:
            self._armed = None

    def check(self) -> dict | None:
        """The armed candidate if it hung (and disarms it); None otherwise."""
        with self._lock:
            armed = self._armed
            if armed and run_hung(armed["started_at"], armed["allowance_s"], self.clock(), self.margin_s):
                self._armed = None
                return armed
        return None

    def _watch(self) -> None:
        while True:
            time.sleep(self.poll_s)
            hung = self.check()
            if hung is not None:
                self.on_hang(hung)

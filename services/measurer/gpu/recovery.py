"""The supervisor's recovery policy, pure where it can be: which lanes to restart after exits and GPU
fault reports, which processes to end so a faulted GPU's MPS server takes clients again, and whether a
recovery worked or the GPU is given up."""
from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from shared import lanes


@dataclass(frozen=True)
class LaneExit:
    """A lane process of the stack that ended: its process name, queue and exit code."""

    name: str
    queue: str
    code: int | None
    at: float


# A GPU lane that dies of these crashed in native code: under MPS that is how a lost CUDA context ends a
# process whose CUDA objects are freed after the fault (the runtime's error thrown from a destructor aborts),
# and its neighbours' contexts are gone with it even while they sit idle. Killed from outside (SIGKILL,
# SIGTERM) it is only that lane.
CRASH_SIGNALS = frozenset({4, 6, 7, 8, 11})  # SIGILL, SIGABRT, SIGBUS, SIGFPE, SIGSEGV


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
    lane name -> times it was restarted. A GPU with a reported fault, a lane that exited with the
    GPU-fault code or crashed (CRASH_SIGNALS), or two of its lanes dying together, is recovered as a whole;
    any other lane restarted `max_restarts` times within `window_s` is given up (a crash loop is not hidden behind restarts). A lane that goes down with its
    GPU is never given up here: finding a culprit among suspects takes one recovery per fault, each of
    them progress (a suspect cleared or a culprit counted toward its quarantine), so the GPU's own
    verdict decides (judge_recovery, give_up_gpu: recoveries whose lanes do not come back measuring)."""
    gpus = {f.gpu8 for f in faults if getattr(f, "gpu8", None)}
    restart, given_up = [], []
    died: dict[str, int] = {}
    for ex in exits:
        gpu = lanes.fault_domain(ex.queue)
        if gpu and (ex.code == gpu_fault_code or (ex.code is not None and -ex.code in CRASH_SIGNALS)):
            gpus.add(gpu)
        elif gpu and ex.code:
            died[gpu] = died.get(gpu, 0) + 1
    # several lanes of one GPU dying together, with no report: an MPS server that took its clients down
    gpus |= {g for g, n in died.items() if n >= 2}
    for ex in exits:
        gpu = lanes.fault_domain(ex.queue)
        if gpu and gpu in gpus:
            continue  # restarted with its GPU
        recent = [t for t in history.get(ex.name, ()) if now - t < window_s]
        (given_up if len(recent) >= max_restarts else restart).append(ex.name)
    return Recovery(gpus=tuple(sorted(gpus)), restart=tuple(sorted(restart)), given_up=tuple(sorted(given_up)))


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


class Verdict(StrEnum):
    """How a GPU's recovery went."""

    OK = "ok"
    FAILED = "failed"
    PENDING = "pending"


def judge_recovery(attempt: GpuAttempt, now: float, faulted_again_at: float | None = None,
                   come_back_s: float = 300.0, settle_s: float = 20.0) -> Verdict:
    """The recovery's verdict. Pure. A recovery failed when the lanes did not come back live within
    `come_back_s`, or the GPU faulted again before they were measuring (answered a batch, or stayed live
    for `settle_s`): a server still refusing clients, or a fault the restart did not cure."""
    confirmed_at = None
    if attempt.live_at is not None:
        confirmed_at = min(t for t in (attempt.measured_at, attempt.live_at + settle_s) if t is not None)
    if faulted_again_at is not None and faulted_again_at >= attempt.restarted_at:
        return Verdict.OK if confirmed_at is not None and confirmed_at <= faulted_again_at else Verdict.FAILED
    if attempt.live_at is None:
        return Verdict.FAILED if now - attempt.restarted_at > come_back_s else Verdict.PENDING
    return Verdict.OK if confirmed_at <= now else Verdict.PENDING


def measured_by_fault(attempt: GpuAttempt, faults: Sequence) -> GpuAttempt:
    """A fault reported with a candidate after the restart means a restarted lane took and ran that
    candidate: the lanes were measuring again, and the fault is a new incident (the next suspect of an
    attribution, say), not a failed recovery. Pure."""
    from dataclasses import replace

    ran = [f.at for f in faults if f.gpu8 == attempt.gpu8 and f.candidate_hash and f.at >= attempt.restarted_at]
    if not ran:
        return attempt
    first = min(ran)  # a lane announces itself live before it takes a candidate
    return replace(attempt, live_at=first if attempt.live_at is None else min(attempt.live_at, first),
                   measured_at=first if attempt.measured_at is None else min(attempt.measured_at, first))


def give_up_gpu(failures: int, max_failed_recoveries: int = 2) -> bool:
    """A GPU whose recoveries failed this many times in a row is not restarted again."""
    return failures >= max_failed_recoveries

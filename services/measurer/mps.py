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


def _hex(uuid: str) -> str:
    return uuid.strip().lower().removeprefix("gpu-").replace("-", "")


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

    def available(self) -> bool:
        return self._which(self.control_binary) is not None

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

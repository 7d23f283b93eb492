"""The CUDA MPS control daemon that makes GPU percentages real.

A GPU lane below 100 % relies on MPS: its process sets CUDA_MPS_ACTIVE_THREAD_PERCENTAGE and talks to
the control daemon through the pipe directory. Without a daemon that variable is silently ignored and
the lane would run on the whole GPU, so a partial lane without MPS is refused, never run unshared.

Every subprocess goes through one injectable runner (``Runner``), so the command lines and the
environment can be checked without a GPU.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from shared.errors import LaneError
from shared import lanes as lane_kinds
from shared.lanes import Lane

CONTROL_BINARY = "nvidia-cuda-mps-control"
# MPS makes Unix sockets in its pipe directory, and a socket's path must fit 107 bytes (sockaddr_un): on the H100
# host a daemon did not start with an 89-character pipe directory and did with 85 (its longest name there)
MAX_PIPE_DIR_CHARS = 80


def usable_pipe_dir(path: Path | str) -> Path:
    """`path`, or where it is too long for MPS's sockets, a short directory named by its hash under /tmp: every
    process given the same long path (a lane, its daemon, a probe) finds the same short one."""
    import hashlib

    path = Path(path)
    if len(str(path)) <= MAX_PIPE_DIR_CHARS:
        return path
    return Path("/tmp") / f"sharetune-mps-{hashlib.sha256(str(path.absolute()).encode()).hexdigest()[:16]}"


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
@dataclass(frozen=True)
class DaemonWait:
    """How the daemon's start and stop are waited for: each command and each wait gives up after `timeout_s`,
    the daemon's state is looked at every `poll_s`; `sleep` and `clock` are injectable so tests need no time."""

    timeout_s: float = 10.0
    poll_s: float = 0.1
    sleep: Callable[[float], None] = time.sleep
    clock: Callable[[], float] = time.monotonic


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
        wait: DaemonWait = DaemonWait(),
    ):
        self.pipe_dir = usable_pipe_dir(pipe_dir)
        self.log_dir = Path(log_dir)
        self.control_binary = control_binary
        self.runner = runner
        self._which = which
        self.wait = wait
        self.started = False  # True only while a daemon this object started runs

    @property
    def timeout_s(self) -> float:
        return self.wait.timeout_s

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
        if not self._wait_until(self.is_running, True):
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
        if not self._wait_until(self.is_running, False):
            raise LaneError(
                f"MPS control daemon on {self.pipe_dir} still runs {self.timeout_s} s after 'quit'"
                f" (exit {res.returncode}: {(res.stderr or res.stdout).strip()})"
            )
        self.started = False
        return True

    # -- lanes
    def require_for(self, lanes: Iterable) -> list[int]:
        """Refuse when a GPU lane below 100 % would run without MPS. ``lanes``: Lane or (Lane,
        count) pairs, as ``plan_gpu_lanes`` returns. Returns the partial percents (empty: MPS not needed)."""
        partial = sorted({lane.share for lane in _lanes(lanes) if lane_kinds.of(lane).mps and lane.share < 100})
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

    def check_lane(self, lane: Lane) -> None:
        """For a lane worker about to start: a partial GPU lane needs a daemon answering on the pipe dir. A query
        can go unanswered while a whole stack starts at once on a busy host: it is asked again until the wait's
        timeout before the lane is refused."""
        if self.require_for([lane]) and not self._wait_until(self.is_running, True):
            raise LaneError(
                f"no MPS control daemon answers on {self.pipe_dir} within {self.timeout_s} s: refusing to run GPU "
                f"lane {lane.queue} at {lane.share} % unshared"
            )

    def client_environment(self, lane: Lane, gpu_uuid: str) -> dict[str, str]:
        """Everything a GPU lane's process needs before CUDA starts: its share and the daemon's dirs."""
        return {**lane_kinds.of(lane).environment(lane, gpu_uuid), **self.environment()}

    # -- helpers
    def _run(self, argv: Sequence[str], text: str | None) -> CommandResult:
        return self.runner(list(argv), self.environment(), text, self.timeout_s)

    def _wait_until(self, probe: Callable[[], bool], want: bool) -> bool:
        deadline = self.wait.clock() + self.wait.timeout_s
        while True:
            if probe() == want:
                return True
            if self.wait.clock() >= deadline:
                return False
            self.wait.sleep(self.wait.poll_s)

    def __enter__(self) -> "MpsDaemon":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _lanes(lanes: Iterable) -> list[Lane]:
    return [item[0] if isinstance(item, tuple) else item for item in lanes]


def parse_pids(text: str) -> list[int]:
    """PIDs, one a line, as get_server_list and get_client_list print them (other lines ignored)."""
    return [int(t) for t in (line.strip() for line in text.splitlines()) if t.isdigit()]

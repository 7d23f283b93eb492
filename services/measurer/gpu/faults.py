"""What a lane's CUDA error means for its GPU (culprit, victim or neither), who took a GPU down, and the
watchdog that catches a kernel that never returns.

Under MPS a kernel that faults (illegal address, ...) takes down every client of that GPU's server:
the culprit sees its own fault, its neighbours see their contexts torn down. The server takes no new
clients until all of them have exited, so recovery (services.measurer.gpu.recovery) is: every lane of the
GPU exits, the daemon is restarted, the lanes start again, and the tuner re-sends what they left
unanswered."""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from shared.messages import ErrorKind

_CULPRIT = ("illegal memory access", "illegal address", "misaligned address", "illegal instruction",
            "device-side assert", "hardware stack error", "invalid program counter", "out of bounds")
_VICTIM = ("mps", "context is destroyed", "context destroyed", "launch failure", "not yet initialized",
           "exclusive-process", "busy or unavailable")


def classify_cuda_error(error: str | None, kind: ErrorKind | None = None) -> str | None:
    """How a candidate's error bears on its lane's CUDA context: "culprit" (its own kernel faulted),
    "victim" (a neighbour's fault took the context), or None (an ordinary error: a failed build, too many
    threads, out of memory; the lane goes on). The lane probes its context after any other run error and
    calls a dead one "unknown" (see services.measurer.worker)."""
    if not error:
        return None
    text = error.lower()
    if kind == ErrorKind.BUILD:  # codegen's own messages may name a fault: the build is no kernel run
        return None
    if any(p in text for p in _CULPRIT):
        return "culprit"
    if any(p in text for p in _VICTIM):
        return "victim"
    return None


def diagnose(faults: Sequence) -> dict:
    """Which candidate took a GPU down, from the lanes' fault reports of one incident: the culprits
    (their own kernel faulted), else the suspects (in flight, role unknown). Victims are innocent."""
    culprits = sorted({f.candidate_hash for f in faults if f.role == "culprit" and f.candidate_hash})
    suspects = sorted({f.candidate_hash for f in faults if f.role == "unknown" and f.candidate_hash})
    return {"culprits": culprits, "suspects": [] if culprits else suspects,
            "victims": sorted({f.candidate_hash for f in faults if f.role == "victim" and f.candidate_hash})}


# ------------------------------------------------------------------------- hung kernels
def run_hung(started_at: float, timeout_s: float, now: float, margin_s: float = 10.0) -> bool:
    """Pure: has one candidate's build-and-run, started at `started_at`, outlived its allowance?"""
    return now - started_at > timeout_s + margin_s



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

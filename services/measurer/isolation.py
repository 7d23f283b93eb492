"""One suspect at a time on a GPU, with its neighbours idle.

Under MPS a faulting kernel takes down every lane of its GPU, and a lane whose context died without a
readable error cannot tell whether its own candidate or a neighbour's faulted: all the candidates in
flight become suspects (their crash count is raised before they run). Re-sent, a suspect runs alone:
it takes the GPU's gate, waits until no other lane of the GPU is running a candidate, and runs while
the others hold back. If the GPU faults then, the suspect is the culprit; if not, it was innocent.
So the culprit is found one by one, and an innocent neighbour never reaches the quarantine.

The gate and the running set live in Redis (lanes are separate processes). Entries carry a deadline,
so a lane that dies holding either cannot block the GPU for longer than one candidate's timeout.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass

from shared import store


class GpuGate:
    """Candidates of the lanes of one GPU: `ordinary()` around a candidate with no fault behind it,
    `alone()` around a suspect. Ordinary candidates of different lanes run together as usual."""

    def __init__(self, r, gpu8: str, worker: str, hold_s: float, poll_s: float = 0.02):
        self.r, self.gpu8, self.worker, self.hold_s, self.poll_s = r, gpu8, worker, float(hold_s), poll_s

    def _held_by_other(self, holder: str | None, until: float, now: float) -> bool:
        return holder is not None and holder != self.worker and until > now

    def _others_running(self, now: float) -> bool:
        return any(w != self.worker and u > now for w, u in store.gpu_running(self.r, self.gpu8).items())

    @contextmanager
    def ordinary(self):
        # announce first, then look at the gate: a suspect that takes the gate after our look sees us running
        # and waits for us (the same two steps in the other order on its side), so the two never overlap.
        # Both steps go in one round trip, in order: this runs before every candidate of a GPU lane
        while True:
            now = time.time()
            holder, until = store.enter_gpu_running(self.r, self.gpu8, self.worker, now + self.hold_s)
            if not self._held_by_other(holder, until, now):
                break
            store.leave_gpu_running(self.r, self.gpu8, self.worker)
            time.sleep(self.poll_s)
        try:
            yield
        finally:
            store.leave_gpu_running(self.r, self.gpu8, self.worker)

    @contextmanager
    def alone(self):
        """Run a suspect with the GPU to itself (the lanes', at least); yields the gate, whose waited_s says
        how long the suspect waited for it."""
        t0 = time.time()
        while not store.take_gpu_gate(self.r, self.gpu8, self.worker, time.time(), time.time() + 2 * self.hold_s):
            time.sleep(self.poll_s)  # another suspect is being tried
        try:
            while self._others_running(time.time()):
                time.sleep(self.poll_s)  # neighbours finish the candidate they started
            self.waited_s = time.time() - t0
            store.set_gpu_running(self.r, self.gpu8, self.worker, time.time() + self.hold_s)
            yield self
        finally:
            store.leave_gpu_running(self.r, self.gpu8, self.worker)
            # ours only: a gate that lapsed (this suspect overran its deadline) and was taken stays taken
            store.release_gpu_gate(self.r, self.gpu8, self.worker)


def attribute(role: str | None, ran_alone: bool, shared_gpu: bool = False) -> str | None:
    """A fault's role once isolation is known: a suspect that ran alone when its context died without a
    readable error is the culprit; a "culprit" by its error text is only a suspect when it ran beside other
    lanes of its GPU (under MPS a neighbour's illegal address reaches every client as the same error 700: on
    the H200 the one report of an injected fault named an innocent neighbour); otherwise the role stands (a
    "victim" error names a fault from outside, say a process that is not a lane: no blame on doubt)."""
    if role == "unknown" and ran_alone:
        return "culprit"
    if role == "culprit" and shared_gpu and not ran_alone:
        return "unknown"
    return role


def runs_alone(crashes: int) -> bool:
    """A candidate whose count, raised just now, was already raised and never cleared was in flight at an
    earlier fault of its GPU: it is a suspect and runs alone."""
    return crashes > 1


@dataclass(frozen=True)
class Verdict:
    """What a GPU lane does with one candidate's outcome. `role`: the fault's role once isolation is known
    (None: no fault); `answer`: its result is written now (else it stays unanswered and is re-sent);
    `clear`: its crash count goes (innocent); `quarantine`: never sent again, by any job; `lane_ends`: the
    lane's CUDA context is gone."""

    role: str | None
    answer: bool
    clear: bool
    quarantine: bool = False

    @property
    def lane_ends(self) -> bool:
        return self.role is not None


def judge(role: str | None, ran_alone: bool, shared_gpu: bool, crashes: int, max_crashes: int) -> Verdict:
    """Pure: the attribution policy for one candidate of a GPU lane. A fault while it ran beside other lanes
    of its GPU only makes it a suspect (unanswered, count kept: re-sent, it runs alone); a fault while it ran
    alone makes it the culprit, quarantined once its count reaches `max_crashes`; a victim's count is
    cleared (an outside fault). So an innocent, cleared by its solo run, never reaches the quarantine."""
    role = attribute(role, ran_alone, shared_gpu)
    if role is None:
        return Verdict(None, answer=True, clear=True)
    if role == "victim":
        return Verdict(role, answer=False, clear=True)
    if role == "culprit":
        return Verdict(role, answer=True, clear=False, quarantine=crashes >= max_crashes)
    return Verdict(role, answer=False, clear=False)

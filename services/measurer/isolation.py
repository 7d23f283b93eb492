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

import redis as redis_lib

from shared import names

# take the gate only if it is free; the deadline lets a dead holder's gate lapse
_TAKE = """
local now = tonumber(ARGV[2])
local holder = redis.call('HGET', KEYS[1], 'holder')
local until_ = tonumber(redis.call('HGET', KEYS[1], 'until') or '0')
if holder and holder ~= ARGV[1] and until_ > now then return 0 end
redis.call('HSET', KEYS[1], 'holder', ARGV[1], 'until', ARGV[3])
redis.call('EXPIRE', KEYS[1], math.ceil(tonumber(ARGV[3]) - now) + 1)
return 1
"""


class GpuGate:
    """Candidates of the lanes of one GPU: `ordinary()` around a candidate with no fault behind it,
    `alone()` around a suspect. Ordinary candidates of different lanes run together as usual."""

    def __init__(self, r: redis_lib.Redis, gpu8: str, worker: str, hold_s: float, poll_s: float = 0.02):
        self.r, self.worker, self.hold_s, self.poll_s = r, worker, float(hold_s), poll_s
        self.gate_key, self.running_key = names.gpu_gate_key(gpu8), names.gpu_running_key(gpu8)

    def _held_by_other(self, holder, until, now: float) -> bool:
        return holder is not None and holder.decode() != self.worker and float(until or 0) > now

    def _others_running(self, now: float) -> bool:
        return any(w.decode() != self.worker and float(u) > now for w, u in self.r.hgetall(self.running_key).items())

    @contextmanager
    def ordinary(self):
        # announce first, then look at the gate: a suspect that takes the gate after our look sees us running
        # and waits for us (the same two steps in the other order on its side), so the two never overlap.
        # Both steps go in one round trip, in order: this runs before every candidate of a GPU lane
        while True:
            now = time.time()
            with self.r.pipeline(transaction=False) as p:
                p.hset(self.running_key, self.worker, now + self.hold_s)
                p.hmget(self.gate_key, "holder", "until")
                _, (holder, until) = p.execute()
            if not self._held_by_other(holder, until, now):
                break
            self.r.hdel(self.running_key, self.worker)
            time.sleep(self.poll_s)
        try:
            yield
        finally:
            self.r.hdel(self.running_key, self.worker)

    @contextmanager
    def alone(self):
        """Run a suspect with the GPU to itself (the lanes', at least); yields the gate, whose waited_s says
        how long the suspect waited for it."""
        t0 = time.time()
        while not self.r.eval(_TAKE, 1, self.gate_key, self.worker, time.time(), time.time() + 2 * self.hold_s):
            time.sleep(self.poll_s)  # another suspect is being tried
        try:
            while self._others_running(time.time()):
                time.sleep(self.poll_s)  # neighbours finish the candidate they started
            self.waited_s = time.time() - t0
            self.r.hset(self.running_key, self.worker, time.time() + self.hold_s)
            yield self
        finally:
            self.r.hdel(self.running_key, self.worker)
            holder = self.r.hget(self.gate_key, "holder")
            if holder is not None and holder.decode() == self.worker:
                self.r.delete(self.gate_key)


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

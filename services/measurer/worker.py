"""The measurer's cores, free of Celery: a lane worker (`LaneWorker.measure(batch) -> results`) and a
builder (`Builder.build(request)`), each built once when its worker process starts and kept warm.

A lane measures every batch its queue ever receives in the same warm process: in a sandbox child (CPU
lanes, so a candidate that segfaults, aborts or hangs kills only the child) or in the lane process itself
(GPU lanes: the CUDA context and the MPS share are the lane's), where a CUDA fault ends the lane and a
watchdog catches a kernel that never returns. A builder needs no GPU: it builds each candidate for its
target family and hands the built ones to `forward`, which sends them to their lane. Both write results,
liveness and counters through shared.store."""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable

from shared import exits, hostcores, lanes, names, store, timeouts
from shared.exits import exit_now
from shared.heartbeat import keep_beating
from shared.ids import worker_id
from shared.messages import (BuilderInfo, BuildRequest, ErrorKind, JobState, LaneBatch, LaneInfo, MeasureBatch,
                             MeasureResult)
from shared.settings import LaneSettings
from shared.ranking import live_bar, rank_secs
from services.measurer import poison
from services.measurer.in_process import InProcessMeasuring

log = logging.getLogger("sharetune.lane")

class LaneWorker:
    """One lane's warm state (Redis connection, target, sandbox or build pool, NVML observer, counters) and
    its one job: measure a batch and write one result per candidate. Candidates it measures in its own
    process go through `in_process` (crash counts, GPU gate, watchdog, fault reports)."""

    def __init__(self, settings: LaneSettings, lane: lanes.Lane, redis, sandboxed: bool | None = None):
        self.settings, self.lane, self.redis = settings, lane, redis
        self.kind = lanes.of(lane)
        self.sandboxed = sandboxed if sandboxed is not None else self.kind.sandboxed
        self.fault_domain = self.kind.fault_domain(lane)  # the GPU whose fault would end this lane, if any
        self.target = None
        self.info: LaneInfo | None = None
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.pool = None  # evaluate.BuildPool when the lane builds beside itself
        self.sandbox = None  # sandbox.Sandbox: the child that builds and times, when the lane isolates candidates
        self.core_claim: hostcores.CoreClaim | None = None  # this host's cores the lane times on, held while it lives
        self.observer = None  # NVML observer of a GPU lane's device, when NVML sees it
        self.in_process = InProcessMeasuring(self)

    @property
    def worker(self) -> str:
        return self.info.worker if self.info else worker_id()

    @property
    def gpu_fault(self) -> str | None:
        """Set when this lane's CUDA context died: it measures no more."""
        return self.in_process.gpu_fault

    # ------------------------------------------------------------------------- life cycle
    def start(self) -> None:
        """Warm up (build pool, sandbox child or a trivial kernel), announce the lane, keep it announced."""
        from services.measurer.metaschedule import evaluate
        from services.measurer.metaschedule.cuda_compile import options_from

        s, lane, kind = self.settings, self.lane, self.kind
        t0 = time.perf_counter()
        kind.check(lane, s.host())  # the share in the lane's name is the share it measures at
        if lane.cores:  # before anything is timed: no two timers on one core of this host
            self.core_claim = hostcores.claim(lane.cores, hostcores.this_process(f"lane {lane.queue}"),
                                              s.core_lock_dir, s.core_overlap)
            if self.core_claim.overlaps:
                log.warning("lane %s shares cores with another timer (SHARETUNE_CORE_OVERLAP=warn): %s; its "
                            "figures are noisy", lane.queue, hostcores.describe_holders(self.core_claim.overlaps))
        if s.lane_claim:  # before the warm-up, which may outlast the claim's TTL
            threading.Thread(target=self.keep_claim, name="lane-claim", daemon=True).start()
        if s.build_workers > 0:  # spawned before this process touches CUDA
            self.pool = evaluate.BuildPool(s.build_workers, s.builder_hide_gpus, options_from(s), s.batch_priority)
        if kind.mps:
            from services.measurer.gpu.daemon import MpsDaemon

            # a lane below 100 % must never measure unshared: refuse unless an MPS daemon answers
            MpsDaemon(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps"),
                      os.environ.get("CUDA_MPS_LOG_DIRECTORY", "/var/log/nvidia-mps")).check_lane(lane)
        if kind.device_uuid and s.gpu_uuid:
            from services.measurer.observers import make_observer

            observer = make_observer()
            self.observer = observer if observer.inventory() else None
        t_target = time.perf_counter()
        self.target = lane_target(kind, lane)
        t_warm = time.perf_counter()
        if self.sandboxed:
            from services.measurer.metaschedule.sandbox import Sandbox

            self.sandbox = Sandbox(str(self.target), s.warmup, s.sandbox_recycle, s.test_fault_hooks,
                                   options_from(s))
            warm_s = self.sandbox.start()
        else:
            warm_s = evaluate.warm_up(self.target) if s.warmup else 0.0
        if self.pool is not None and s.warmup:
            self.pool.start_warm_up(self.target)
        self.info = LaneInfo(
            queue=lane.queue,
            kind=lane.kind,
            share=lane.share,  # checked above against this host: what every result of this lane is measured at
            cores=list(lane.cores),
            gpu_uuid=s.gpu_uuid,
            target=str(self.target),
            host=socket.gethostname(),
            pid=os.getpid(),
            started_at=time.time(),
        )
        self.announce()
        keep_beating(self.announce, timeouts.HEARTBEAT_S, "lane heartbeat", self.stop)
        # where a (re)start's seconds go: the checks and observer, the target (a GPU's first CUDA call), the warm-up
        log.info("lane %s ready in %.2f s (checks %.2f s, target %.2f s, warm-up %.2f s; share %s %%, target %s)",
                 lane.queue, time.perf_counter() - t0, t_target - t0, t_warm - t_target, warm_s, self.info.share,
                 self.target)

    def announce(self) -> None:
        with self.lock:
            store.announce_lane(self.redis, self.info)

    def keep_claim(self) -> None:
        """A replica that claimed its lane from a pool holds the claim while it lives. Once another replica
        holds it (this one's claim lapsed: a stall, a long Redis outage), this one ends at once: a lane
        queue is never consumed by two workers; its batch in flight is sent again like a dead lane's."""
        worker = worker_id()
        while not self.stop.is_set():
            try:
                if not store.refresh_claim(self.redis, self.settings.lane_claim, worker):
                    self.on_claim_lost(self.settings.lane_claim)
                    return
            except Exception:  # noqa: BLE001 - Redis may be restarting; the next beat retries
                log.warning("lane claim refresh failed", exc_info=True)
            self.stop.wait(timeouts.HEARTBEAT_S)

    def on_claim_lost(self, claim: str) -> None:
        exit_now(exits.CLAIM_LOST, log, "lane claim %s is held by another replica now: exiting, so that one "
                 "lane is never served twice", claim)

    def close(self) -> None:
        """Warm shutdown: stop the heartbeat, end the sandbox child, leave the lane list, free the claim."""
        self.stop.set()
        if self.sandbox is not None:
            self.sandbox.close()
        try:
            if self.info is not None:
                store.retire_lane(self.redis, self.info)
            if self.settings.lane_claim:  # only our own claim: it may have passed to another
                store.release_claim(self.redis, self.settings.lane_claim, worker_id())
        except Exception:  # noqa: BLE001
            pass

    def leave(self) -> None:
        """Stop serving at once: no more heartbeats, and the liveness key retired, so the tuner re-sends
        what this lane left unanswered."""
        self.stop.set()
        if self.info is not None:
            store.retire_lane(self.redis, self.info)

    # ------------------------------------------------------------------------- measuring
    def measure(self, batch: MeasureBatch) -> list[MeasureResult]:
        """Build and time a batch's candidates; write each answered candidate's MeasureResult to the store
        and return them. After a GPU fault (`gpu_fault` set) the rest of the batch stays unanswered (the
        tuner re-sends it) and the lane has left the lane list: the caller ends the process."""
        from services.measurer.metaschedule.targets import target_from_json

        r, lane, s = self.redis, self.lane, self.settings
        worker = self.worker
        late = redelivered(r, batch)
        if late:
            log.warning("lane %s drops batch %s of job %s: %s", lane.queue, batch.batch_id, batch.job_id, late)
            return []
        store.mark_batch_started(r, batch.batch_id, lane.queue, worker, batch.job_id, len(batch.candidates))
        if store.job_cancelled(r, batch.job_id):  # answered, so no one waits on it
            cancelled = [MeasureResult(candidate_id=c.candidate_id, error=store.CANCELLED,
                                       error_kind=ErrorKind.CANCELLED, lane=lane.queue)
                         for c in batch.candidates]
            for res in cancelled:
                store.put_result(r, batch.batch_id, res)
            return cancelled
        started = time.time()
        target = target_from_json(batch.target) if batch.target else self.target
        window = self.observer is not None
        if window:
            self.observer.start_window(s.gpu_uuid)
        batch = with_references(r, tightened(r, batch))
        results = self._results(batch, target)
        answered = []
        self.in_process.held = (batch.batch_id, answered)  # written by the watchdog if the lane dies holding them
        for res in results:
            res.lane, res.share = lane.queue, self.info.share if self.info else None
            res.device = {"host": socket.gethostname(), "cores": list(lane.cores), "gpu_uuid": s.gpu_uuid}
            answered.append(res)
            if not window:  # else sent when the window closes, with the device facts of the batch
                store.put_result(r, batch.batch_id, res)
        if window:
            facts = self.observer.stop_window().summary()
            sample = self.observer.sample(s.gpu_uuid)
            facts.update({"name": sample.name, "sm_clock_mhz": sample.sm_clock_mhz} if sample else {})
            for res in answered:
                res.device.update(facts)
                store.put_result(r, batch.batch_id, res)
        self.in_process.held = None
        keep_live_bests(r, batch, answered)
        ok = sum(res.error is None for res in answered)
        store.log_lane_batch(r, batch.job_id, LaneBatch(
            batch_id=batch.batch_id, lane=lane.queue, worker=worker, started_at=started, finished_at=time.time(),
            candidates=len(batch.candidates), errors=len(batch.candidates) - ok))
        if self.gpu_fault is not None:
            # a lost CUDA context cannot be recovered in-process: leave before the message is acknowledged
            self.leave()
            return answered
        with self.lock:
            self.info.batches += 1
            self.info.candidates += len(batch.candidates)
        self.announce()
        return answered

    def _results(self, batch: MeasureBatch, target):
        """The batch's results as they come: from the sandbox child, or measured in this process (built by the
        lane's pool or here), quarantined candidates answered without running."""
        from services.measurer.metaschedule import evaluate

        r, s = self.redis, self.settings
        guard = dict(max_crashes=s.max_crashes, lane=self.lane.queue, job_id=batch.job_id, batch_id=batch.batch_id)
        if self.sandbox is not None:
            sandboxed = lambda c: self.sandbox.measure(c, batch.timing, batch.target or None)  # noqa: E731
            return (poison.measure_guarded(r, cand, sandboxed, **guard) for cand in batch.candidates)
        quarantined = {c.candidate_id: q for c in batch.candidates
                       if (q := poison.already_poison(r, store.candidate_hash(c.mod), **guard)) is not None}
        todo = [c for c in batch.candidates if c.candidate_id not in quarantined]
        if self.pool is not None:
            if any(c.artifact is None for c in todo):
                self.pool.finish_warm_up()  # before any watchdog is armed: start-up is not a build's time
            measuring = self.pool.measure_batch(todo, target, batch.timing)
        else:
            measuring = (evaluate.measure(c, target, batch.timing) for c in todo)
        return self.in_process.measure(batch, measuring, quarantined, guard)


def tightened(r, batch: MeasureBatch) -> MeasureBatch:
    """The batch with each screened candidate's bar (one with a bar key) tightened to its task's live best
    (ranking.live_bar); a first round's candidates, sent with nothing to beat, get one once the round has it."""
    keys = sorted({c.bar_key for c in batch.candidates if c.bar_key})
    best = store.live_bests(r, keys) if keys else {}
    if not best:
        return batch
    cands = [c.model_copy(update={"full_below_s": live_bar(c.full_below_s, best.get(c.bar_key))})
             if c.bar_key else c for c in batch.candidates]
    return batch.model_copy(update={"candidates": cands})


def with_references(r, batch: MeasureBatch) -> MeasureBatch:
    """The batch with each candidate that names a reference (Candidate.reference_key) given that module from the
    store, to check its output against once it is fully timed; one whose reference is not stored goes unchecked."""
    keys = sorted({c.reference_key for c in batch.candidates if c.reference_key and c.reference is None})
    found = store.references(r, keys) if keys else {}
    if not any(found.values()):
        return batch
    cands = [c.model_copy(update={"reference": found.get(c.reference_key)})
             if c.reference_key and c.reference is None else c for c in batch.candidates]
    return batch.model_copy(update={"candidates": cands})


def keep_live_bests(r, batch: MeasureBatch, answered: list[MeasureResult]) -> None:
    """Each fully timed answer lowers its task's live best, for the bars of the candidates still to come."""
    keys = {c.candidate_id: c.bar_key for c in batch.candidates if c.bar_key}
    for res in answered:
        if res.error is None and res.timing == "full" and res.run_secs and keys.get(res.candidate_id):
            store.lower_live_best(r, keys[res.candidate_id], rank_secs(res.run_secs))


def redelivered(r, batch: MeasureBatch) -> str | None:
    """Why a batch is a late duplicate (None: it is not). Redis hands an unacknowledged message out again
    after its visibility timeout (an hour): by then the tuner has re-sent what the batch's dead lane left
    unanswered as a new batch, so a batch some lane already started, or of a job that has ended, is not
    measured twice."""
    started = store.batch_started(r, batch.batch_id)
    if started is not None:
        return f"started before, at {started.get('at')} by {started.get('worker')} (a redelivery)"
    try:
        state = store.job_status(r, batch.job_id)
    except Exception:  # noqa: BLE001 - no job record (a bench's or a probe's batch): measured as sent
        return None
    return f"its job is {state}" if state in (JobState.DONE, JobState.FAILED) else None


def lane_target(kind: lanes.LaneKind, lane: lanes.Lane):
    """The TVM target a lane measures for, read from its device (TVM's half of a lane kind)."""
    from services.measurer.metaschedule.targets import cpu_target, gpu_target

    from_device = {"llvm": lambda: cpu_target(len(lane.cores)), "cuda": gpu_target}
    return from_device[kind.target_kind]()


class Builder:
    """Builds candidates for one target family and forwards the built ones to their lane with
    `forward(batch, lane_queue, priority)`; a candidate that fails to build is answered as its error. With no
    family it is a lane's own builder for a build message that reached it: no liveness key, no counters."""

    def __init__(self, redis, forward: Callable[[MeasureBatch, str, int], None], family: str | None = None):
        self.redis, self.forward = redis, forward
        self.family = names.check_family(family) if family else None
        self.info = (BuilderInfo(family=family, host=socket.gethostname(), pid=os.getpid(), started_at=time.time())
                     if family else None)
        self.alive_key = names.builder_key(family, self.info.worker) if family else ""
        self.lock = threading.Lock()
        self.stop = threading.Event()

    @property
    def worker(self) -> str:
        return self.info.worker if self.info else worker_id()

    def start(self) -> None:
        """Warm up for the family (a builder that cannot build exits before it takes work), then announce."""
        from services.measurer.metaschedule.build import warm_up_builder

        try:
            warm_s = warm_up_builder(self.family)
        except Exception as err:  # noqa: BLE001 - a builder that cannot build must not take work
            log.error("%s", err)
            os._exit(3)
        self.announce()
        keep_beating(self.announce, timeouts.HEARTBEAT_S, "builder heartbeat", self.stop)
        log.info("builder for %s ready (warm-up %.2f s)", self.family, warm_s)

    def announce(self) -> None:
        with self.lock:
            store.announce_builder(self.redis, self.info)

    def close(self) -> None:
        self.stop.set()
        try:
            store.retire_builder(self.redis, self.info)
        except Exception:  # noqa: BLE001
            pass

    def build(self, req: BuildRequest) -> dict:
        """Build every candidate of the request's batch: failed builds are answered, the built ones are
        forwarded to the request's lane as one batch. Returns counts."""
        from services.measurer.metaschedule.build import build_artifact
        from services.measurer.metaschedule.targets import target_from_json

        batch, r, worker = req.batch, self.redis, self.worker
        store.mark_batch_building(r, batch.batch_id, worker, self.alive_key)
        if store.job_cancelled(r, batch.job_id):
            for cand in batch.candidates:
                store.put_result(r, batch.batch_id,
                                 MeasureResult(candidate_id=cand.candidate_id, error=store.CANCELLED,
                                               error_kind=ErrorKind.CANCELLED, lane=req.lane))
            return {"batch_id": batch.batch_id, "built": 0, "cancelled": True}
        target = target_from_json(batch.target)
        built, failed, secs = [], 0, 0.0
        for cand in batch.candidates:
            art, error, spent = build_artifact(cand, target, worker)
            secs += spent
            if art is None:
                failed += 1
                store.put_result(r, batch.batch_id, MeasureResult(candidate_id=cand.candidate_id, error=error,
                                                                  error_kind=ErrorKind.BUILD,
                                                                  build_s=spent, lane=req.lane))
            else:
                built.append(cand.model_copy(update={"artifact": art}))
        if built:
            self.forward(batch.model_copy(update={"candidates": built}), req.lane, req.priority)
        store.mark_batch_building(r, batch.batch_id, worker, self.alive_key, forwarded=True)
        if self.info is not None:
            with self.lock:
                self.info.built += len(built)
                self.info.failed += failed
                self.info.build_s += secs
            self.announce()
        return {"batch_id": batch.batch_id, "built": len(built), "failed": failed}

"""The measurer's only Celery boundary: one lane per worker process, one queue per lane; and the
builders, stateless workers that build candidates for a target family and forward them to their lanes.

A lane is started by `python -m services.measurer --lane QUEUE`, which sets the lane's environment
and CPU affinity before this module (and TVM) load, then runs a solo-pool worker: the same warm process
builds (when no builder serves its family) and times every batch the lane ever receives. A builder is
started by `python -m services.measurer --builder FAMILY` (SHARETUNE_BUILDER_FAMILY set): it needs no GPU,
opens no CUDA context, and any number of them, on any host, serve one build.<family> queue."""
from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from contextlib import nullcontext

from celery import signals

from shared import names, store
from shared.ids import worker_id
from services.celery_app import make_celery
from shared.errors import MessageError
from shared.messages import BuilderInfo, BuildRequest, LaneBatch, LaneInfo, MeasureBatch, MeasureResult
from shared.settings import LaneSettings
from services.measurer import poison
from services.measurer.lanes import lane_share

log = logging.getLogger("sharetune.lane")
settings = LaneSettings()
app = make_celery("measurer", settings.redis_url)  # Celery connects when the worker starts, not here
# Set when the worker starts (_init_worker), never at import: the lane this process serves, whether it
# measures in a sandbox child, and a builder's state when it is a builder.
LANE: names.LaneName | None = None
SANDBOXED = False


class _LaneState:
    """What this worker process keeps warm: the Redis connection, the lane's target and counters."""

    def __init__(self):
        self.redis = None  # connected when the worker starts (_init_worker)
        self.target = None
        self.info: LaneInfo | None = None
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.pool = None  # evaluate.BuildPool when the lane builds beside itself
        self.sandbox = None  # sandbox.Sandbox: the child that builds and times, when the lane isolates candidates
        self.observer = None  # NVML observer of a GPU lane's device, when NVML sees it
        self.gpu_fault: str | None = None  # set when this lane's CUDA context died: it measures no more

    def start(self) -> None:
        from services.measurer.metaschedule import evaluate

        if settings.build_workers > 0:  # spawned before this process touches CUDA
            self.pool = evaluate.BuildPool(settings.build_workers)
        if LANE.kind == "cpu":
            self.target = evaluate.cpu_target(len(LANE.cores))
        else:
            from services.measurer.gpu.daemon import MpsDaemon
            from services.measurer.observers import make_observer

            # a lane below 100 % must never measure unshared: refuse unless an MPS daemon answers
            MpsDaemon(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps"),
                      os.environ.get("CUDA_MPS_LOG_DIRECTORY", "/var/log/nvidia-mps")).check_lane(LANE)
            observer = make_observer()
            self.observer = observer if settings.gpu_uuid and observer.inventory() else None
            self.target = evaluate.gpu_target()
        if SANDBOXED:
            from services.measurer.metaschedule.sandbox import Sandbox

            self.sandbox = Sandbox(str(self.target), settings.warmup, settings.sandbox_recycle, settings.test_fault_hooks)
            warm_s = self.sandbox.start()
        else:
            warm_s = evaluate.warm_up(self.target) if settings.warmup else 0.0
        if self.pool is not None and settings.warmup:
            warm_s += self.pool.warm_up(self.target)
        self.info = LaneInfo(
            queue=LANE.queue,
            kind=LANE.kind,
            share=lane_share(LANE),
            cores=list(LANE.cores),
            gpu_uuid=settings.gpu_uuid,
            target=str(self.target),
            host=socket.gethostname(),
            pid=os.getpid(),
            started_at=time.time(),
        )
        self.announce()
        threading.Thread(target=self._heartbeat, name="lane-heartbeat", daemon=True).start()
        log.info("lane %s ready (share %s %%, warm-up %.2f s, target %s)", LANE.queue, self.info.share, warm_s, self.target)

    def announce(self) -> None:
        with self.lock:
            store.announce_lane(self.redis, self.info)

    def keep_claim(self) -> None:
        """A replica that claimed its lane from a pool holds the claim while it lives."""
        worker = worker_id()
        while not self.stop.is_set():
            try:
                if not store.refresh_claim(self.redis, settings.lane_claim, worker):
                    log.warning("lane claim %s is held by another replica", settings.lane_claim)
            except Exception:  # noqa: BLE001 - Redis may be restarting; the next beat retries
                log.warning("lane claim refresh failed", exc_info=True)
            self.stop.wait(names.LANE_TTL_S / 3)

    def _heartbeat(self) -> None:
        _keep_announcing(self.stop, self.announce, "lane")


def _keep_announcing(stop: threading.Event, announce, what: str) -> None:
    """Refresh a liveness key well within its TTL until `stop` is set."""
    while not stop.wait(names.LANE_TTL_S / 3):
        try:
            announce()
        except Exception:  # noqa: BLE001 - Redis may be restarting; the next beat retries
            log.warning("%s heartbeat failed", what, exc_info=True)


class _BuilderState:
    """A builder worker's warm state: its Redis connection, liveness key and counters."""

    def __init__(self, family: str):
        self.family = names.check_family(family)
        self.redis = store.connect(settings.redis_url)
        self.info = BuilderInfo(family=family, host=socket.gethostname(), pid=os.getpid(), started_at=time.time())
        self.alive_key = names.builder_key(family, self.info.worker)
        self.lock = threading.Lock()
        self.stop = threading.Event()

    def start(self) -> None:
        from services.measurer.metaschedule import evaluate

        try:
            warm_s = evaluate.warm_up_builder(self.family)
        except Exception as err:  # noqa: BLE001 - a builder that cannot build must not take work
            log.error("%s", err)
            os._exit(3)
        self.announce()
        threading.Thread(target=self._heartbeat, name="builder-heartbeat", daemon=True).start()
        log.info("builder for %s ready (warm-up %.2f s)", self.family, warm_s)

    def announce(self) -> None:
        with self.lock:
            store.announce_builder(self.redis, self.info)

    def _heartbeat(self) -> None:
        _keep_announcing(self.stop, self.announce, "builder")


STATE = _LaneState()
BUILDER: _BuilderState | None = None


@signals.worker_init.connect
def _init_worker(**_):
    """Before the worker consumes: parse its lane, connect to Redis, and make a builder's state."""
    global LANE, SANDBOXED, BUILDER
    LANE = names.LaneName.parse(settings.lane)
    SANDBOXED = settings.sandbox if settings.sandbox is not None else LANE.kind == "cpu"
    STATE.redis = store.connect(settings.redis_url)
    BUILDER = _BuilderState(settings.builder_family) if settings.builder_family else None


@signals.worker_ready.connect
def _on_ready(**_):
    if BUILDER is not None:
        BUILDER.start()
        return
    if settings.lane_claim:  # before the warm-up, which may outlast the claim's TTL
        threading.Thread(target=STATE.keep_claim, name="lane-claim", daemon=True).start()
    STATE.start()


@signals.worker_shutdown.connect
def _on_shutdown(**_):
    if BUILDER is not None:
        BUILDER.stop.set()
        try:
            store.retire_builder(BUILDER.redis, BUILDER.info)
        except Exception:  # noqa: BLE001
            pass
        return
    STATE.stop.set()
    if STATE.sandbox is not None:
        STATE.sandbox.close()
    try:
        if STATE.info is not None:
            store.retire_lane(STATE.redis, STATE.info)
        if settings.lane_claim:  # only our own claim: it may have passed to another
            store.release_claim(STATE.redis, settings.lane_claim, worker_id())
    except Exception:  # noqa: BLE001
        pass


# Acknowledged on receipt: a builder killed mid-batch loses the message, and the tuner's batch watch,
# which sees the builder's liveness key expire, re-sends the batch to a lane (which builds it itself).
@app.task(name=names.BUILD_TASK, acks_late=False)
def build_batch(payload):
    """Build every candidate of a batch; forward the built ones to their lane, answer failed builds."""
    from services.measurer.metaschedule import evaluate

    b = BUILDER
    try:
        req = BuildRequest.parse(payload)
    except MessageError as err:
        _answer_malformed(payload.get("batch") if isinstance(payload, dict) else payload, str(err),
                          names.build_queue(b.family) if b else "build")
        return {"error": str(err)}
    batch = req.batch
    r = b.redis if b else STATE.redis
    worker = b.info.worker if b else worker_id()
    store.mark_batch_building(r, batch.batch_id, worker, b.alive_key if b else "")
    if store.job_cancelled(r, batch.job_id):
        for cand in batch.candidates:
            store.put_result(r, batch.batch_id, MeasureResult(candidate_id=cand.candidate_id, error=store.CANCELLED, lane=req.lane))
        return {"batch_id": batch.batch_id, "built": 0, "cancelled": True}
    target = evaluate.target_from_json(batch.target)
    built, failed, secs = [], 0, 0.0
    for cand in batch.candidates:
        art, error, spent = evaluate.build_artifact(cand, target, worker)
        secs += spent
        if art is None:
            failed += 1
            store.put_result(r, batch.batch_id, MeasureResult(candidate_id=cand.candidate_id, error=error, build_s=spent,
                                                              lane=req.lane))
        else:
            built.append(cand.model_copy(update={"artifact": art}))
    if built:
        app.send_task(names.MEASURE_TASK, args=[batch.model_copy(update={"candidates": built}).model_dump(mode="json")],
                      queue=req.lane)
    store.mark_batch_building(r, batch.batch_id, worker, b.alive_key if b else "", forwarded=True)
    if b is not None:
        with b.lock:
            b.info.built += len(built)
            b.info.failed += failed
            b.info.build_s += secs
        b.announce()
    return {"batch_id": batch.batch_id, "built": len(built), "failed": failed}


@app.task(name=names.MEASURE_TASK, acks_late=True)
def measure_batch(payload):
    """Build and time a batch of candidates; write one MeasureResult per candidate to Redis."""
    from services.measurer.metaschedule import evaluate

    try:
        batch = MeasureBatch.parse(payload)
    except MessageError as err:
        _answer_malformed(payload, str(err))
        return {"error": str(err)}
    worker = STATE.info.worker if STATE.info else worker_id()
    store.mark_batch_started(STATE.redis, batch.batch_id, LANE.queue, worker, batch.job_id, len(batch.candidates))
    if store.job_cancelled(STATE.redis, batch.job_id):  # answered, so no one waits on it
        for cand in batch.candidates:
            store.put_result(STATE.redis, batch.batch_id,
                             MeasureResult(candidate_id=cand.candidate_id, error=store.CANCELLED, lane=LANE.queue))
        return {"batch_id": batch.batch_id, "measured": 0, "cancelled": True}
    started = time.time()
    target = evaluate.target_from_json(batch.target) if batch.target else STATE.target
    ok = 0
    window = STATE.observer is not None
    if window:
        STATE.observer.start_window(settings.gpu_uuid)
    guard = dict(max_crashes=settings.max_crashes, lane=LANE.queue, job_id=batch.job_id, batch_id=batch.batch_id)
    if STATE.sandbox is not None:
        sandboxed = lambda c: STATE.sandbox.measure(c, batch.timing, batch.target or None)  # noqa: E731
        results = (poison.measure_guarded(STATE.redis, cand, sandboxed, **guard) for cand in batch.candidates)
    else:
        quarantined = {c.candidate_id: q for c in batch.candidates
                       if (q := poison.already_poison(STATE.redis, store.candidate_hash(c.mod), **guard)) is not None}
        todo = [c for c in batch.candidates if c.candidate_id not in quarantined]
        if STATE.pool is not None:
            measuring = STATE.pool.measure_batch(todo, target, batch.timing)
        else:
            measuring = (evaluate.measure(c, target, batch.timing) for c in todo)
        results = _in_process(batch, measuring, quarantined, guard)
    measured = []
    for res in results:
        res.lane, res.share = LANE.queue, STATE.info.share if STATE.info else None
        res.device = {"host": socket.gethostname(), "cores": list(LANE.cores), "gpu_uuid": settings.gpu_uuid}
        if window:
            measured.append(res)  # sent when the window closes, with the device facts of the batch
        else:
            store.put_result(STATE.redis, batch.batch_id, res)
        ok += res.error is None
    if window:
        facts = STATE.observer.stop_window().summary()
        sample = STATE.observer.sample(settings.gpu_uuid)
        facts.update({"name": sample.name, "sm_clock_mhz": sample.sm_clock_mhz} if sample else {})
        for res in measured:
            res.device.update(facts)
            store.put_result(STATE.redis, batch.batch_id, res)
    store.log_lane_batch(STATE.redis, batch.job_id, LaneBatch(
        batch_id=batch.batch_id, lane=LANE.queue, worker=worker, started_at=started, finished_at=time.time(),
        candidates=len(batch.candidates), errors=len(batch.candidates) - ok))
    if STATE.gpu_fault is not None:
        _leave_after_gpu_fault()
        return {"batch_id": batch.batch_id, "measured": len(measured), "ok": ok, "gpu_fault": STATE.gpu_fault}
    with STATE.lock:
        STATE.info.batches += 1
        STATE.info.candidates += len(batch.candidates)
    STATE.announce()
    return {"batch_id": batch.batch_id, "measured": len(batch.candidates), "ok": ok}


def _answer_malformed(payload, why: str, queue: str | None = None) -> None:
    """A message that fails validation is kept in the dead-letter list, and if it names a batch and
    candidates, each gets an error result, so whoever waits on them is not left hanging."""
    queue = queue or LANE.queue
    body = payload if isinstance(payload, str) else json.dumps(payload, default=str)
    store.dead_letter(STATE.redis, queue, why, body)
    log.error("rejected message on %s: %s", queue, why)
    if isinstance(payload, dict) and isinstance(payload.get("batch_id"), str):
        for cand in payload.get("candidates") or []:
            cid = cand.get("candidate_id") if isinstance(cand, dict) else None
            if isinstance(cid, str):
                store.put_result(STATE.redis, payload["batch_id"], MeasureResult(candidate_id=cid, error=why, lane=LANE.queue))


def _in_process(batch: MeasureBatch, results, quarantined: dict, guard):
    """Candidates measured in the lane process itself (GPU lanes: the CUDA context and the MPS share are
    the lane's). Each candidate's crash count is raised before it runs, so a lane that dies with it
    leaves the count; a CUDA fault ends the batch: the lane's context is gone."""
    from services.measurer.isolation import GpuGate, attribute
    from services.measurer.gpu.faults import classify_cuda_error, watchdog_allowance_s

    gate = None
    if LANE.kind == "gpu":
        worker = STATE.info.worker if STATE.info else worker_id()
        gate = GpuGate(STATE.redis, LANE.gpu or "", worker, hold_s=batch.timing.timeout_s + 30)
    for cand in batch.candidates:
        if cand.candidate_id in quarantined:  # answered without building or running it
            yield poison.quarantined_result(quarantined[cand.candidate_id], cand.candidate_id)
            continue
        chash = store.candidate_hash(cand.mod)
        crashes = store.crash_pending(STATE.redis, chash)
        # in flight at an earlier fault of its GPU (the count raised then was never cleared): run it alone
        alone = gate is not None and crashes > 1
        with gate.alone() if alone else gate.ordinary() if gate is not None else nullcontext():
            if LANE.kind == "gpu":
                _watchdog().arm(watchdog_allowance_s(batch.timing.timeout_s, STATE.pool is not None),
                                batch_id=batch.batch_id, candidate_id=cand.candidate_id, chash=chash,
                                crashes=crashes, job_id=batch.job_id, timeout_s=batch.timing.timeout_s)
            try:
                res = next(results)
            finally:
                if LANE.kind == "gpu":
                    _watchdog().disarm()
        role = classify_cuda_error(res.error) if LANE.kind == "gpu" and res.error else None
        if role is None and LANE.kind == "gpu" and res.error and res.error.startswith("run failed") and not _cuda_alive():
            role = "unknown"
        if role is not None:
            role = attribute(role, alone, shared_gpu=_gpu_shared())
        if role is None:
            store.crash_clear(STATE.redis, chash)
            yield res
            continue
        _report_gpu_fault(chash, res.error, role)
        if role == "victim":
            store.crash_clear(STATE.redis, chash)  # an MPS neighbour's fault took it: re-sent, not counted
        elif crashes >= guard["max_crashes"]:  # faulted (or was in flight at a fault) max_crashes times
            from shared.messages import Quarantined

            store.quarantine(STATE.redis, Quarantined(candidate_hash=chash, error=res.error, crashes=crashes, lane=LANE.queue,
                                                      job_id=guard["job_id"], batch_id=guard["batch_id"]))
            res.fault, res.error = "crash", f"quarantined after {crashes} crashes: {res.error}"
            yield res
        elif role == "culprit":  # answered; its count stays until it reaches max_crashes
            res.fault = "crash"
            yield res
        # unknown, below the cap: unanswered with its count kept, so the tuner re-sends it to a restarted
        # lane, where it runs alone: a culprit faults again and is named, an innocent clears its count
        return  # the rest of the batch is unanswered and re-sent by the tuner's batch watch


def _gpu_shared() -> bool:
    """Does another live lane worker use this lane's GPU (so a fault here may be a neighbour's)?"""
    me = STATE.info.worker if STATE.info else worker_id()
    try:
        return any(l.kind == "gpu" and names.LaneName.parse(l.queue).gpu == LANE.gpu and l.worker != me
                   for l in store.live_lanes(STATE.redis))
    except Exception:  # noqa: BLE001 - Redis unreachable: assume neighbours, so no innocent is blamed
        return True


def _cuda_alive() -> bool:
    from services.measurer.metaschedule.evaluate import cuda_context_alive

    return cuda_context_alive()


def _report_gpu_fault(chash: str, error: str, role: str) -> None:
    from shared.messages import GpuFault

    STATE.gpu_fault = f"{role}: {error[:300]}"
    log.error("lane %s lost its CUDA context (%s) on candidate %s: %s", LANE.queue, role, chash, error[:300])
    store.report_gpu_fault(STATE.redis, GpuFault(gpu8=LANE.gpu or "", lane=LANE.queue,
                                                 worker=STATE.info.worker if STATE.info else "", candidate_hash=chash,
                                                 error=error[:2000], role=role))


# past its build wait and its run timeout (plus this), a candidate's kernel is taken as hung
WATCHDOG_MARGIN_S = float(os.environ.get("SHARETUNE_WATCHDOG_MARGIN_S", "15"))
_WATCHDOG = None


def _watchdog():
    global _WATCHDOG
    if _WATCHDOG is None:
        from services.measurer.gpu.faults import Watchdog

        _WATCHDOG = Watchdog(_on_hung_candidate, margin_s=WATCHDOG_MARGIN_S)
    return _WATCHDOG


def _on_hung_candidate(armed: dict) -> None:
    """From the watchdog thread: the lane's own thread is stuck in a kernel that does not return, and a
    context with a spinning kernel cannot be saved. Report the candidate as the GPU's culprit (its raised
    crash count stays; at the cap it is quarantined), answer it, leave the lane list, and exit with the
    GPU-fault code so the supervisor recovers the GPU as after any fault."""
    from shared.messages import Quarantined

    code = names.EXIT_GPU_FAULT
    try:
        allowance = armed["allowance_s"] + WATCHDOG_MARGIN_S
        error = (f"run hung: the candidate's kernel did not return within {allowance:.0f} s (timeout "
                 f"{armed['timeout_s']:.0f} s, build wait and margin included); the lane exits")
        _report_gpu_fault(armed["chash"], error, "culprit")
        res = MeasureResult(candidate_id=armed["candidate_id"], error=error, fault="crash", lane=LANE.queue)
        if armed["crashes"] >= settings.max_crashes:
            store.quarantine(STATE.redis, Quarantined(candidate_hash=armed["chash"], error=error, crashes=armed["crashes"],
                                                      lane=LANE.queue, job_id=armed["job_id"], batch_id=armed["batch_id"]))
            res.error = f"quarantined after {armed['crashes']} crashes: {error}"
        store.put_result(STATE.redis, armed["batch_id"], res)
        STATE.stop.set()
        if STATE.info is not None:
            store.retire_lane(STATE.redis, STATE.info)
    except BaseException:  # noqa: BLE001 - exit regardless: a lane stuck in a kernel serves nobody
        log.exception("reporting a hung candidate failed")
    finally:
        logging.shutdown()
        os._exit(code)


def _leave_after_gpu_fault() -> None:
    """A lost CUDA context cannot be recovered in-process: retire the liveness key at once (the tuner
    re-sends the batch's unanswered candidates), and end the worker after this message is acknowledged,
    with an exit code the stack's supervisor reads as "restart MPS and this GPU's lanes"."""
    from celery.worker import state as worker_state

    STATE.stop.set()
    if STATE.info is not None:
        store.retire_lane(STATE.redis, STATE.info)
    worker_state.should_stop = names.EXIT_GPU_FAULT

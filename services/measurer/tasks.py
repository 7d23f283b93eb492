"""The measurer's only Celery boundary: one lane per worker process, one queue per lane; and the
builders, stateless workers that build candidates for a target family and forward them to their lanes.

A lane is started by `python -m services.measurer --lane QUEUE`, which sets the lane's environment
and CPU affinity before this module (and TVM) load, then runs a solo-pool worker: the same warm process
builds (when no builder serves its family) and times every batch the lane ever receives. A builder is
started by `python -m services.measurer --builder FAMILY` (SHARETUNE_BUILDER_FAMILY set): it needs no GPU,
opens no CUDA context, and any number of them, on any host, serve one build.<family> queue.

Here only: the worker's life (MeasurerWorker, on Celery's worker signals) builds, warms and tears down its
core (services.measurer.worker), and each task parses its message, calls the core, and answers a malformed
message."""
from __future__ import annotations

import atexit
import json
import logging
import os

from celery import signals

from shared import lanes, names, store
from services.celery_app import exits_if_it_fails, make_celery, use_broker
from shared.errors import MessageError
from shared.messages import BuildRequest, ErrorKind, MeasureBatch, MeasureResult
from shared.settings import LaneSettings
from services.measurer.worker import Builder, LaneWorker

log = logging.getLogger("sharetune.lane")
app = make_celery("measurer")  # its broker is the worker's settings' Redis (MeasurerWorker.configure)


def _forward(batch: MeasureBatch, lane: str, priority: int = 0) -> None:
    app.send_task(names.MEASURE_TASK, args=[batch.model_dump(mode="json")], queue=lane, priority=priority)


class MeasurerWorker:
    """This worker process's core from start to shutdown: its settings, read once as the worker starts; its
    lane (LaneWorker), or its Builder when the process was started as one. Built when the worker starts, never
    at import."""

    def __init__(self):
        self.settings: LaneSettings | None = None
        self.lane: LaneWorker | None = None
        self.builder: Builder | None = None

    def configure(self, **_) -> None:
        """The first step of the worker's start, before it connects: read the settings, point the app at Redis,
        and say how this process compiles CUDA."""
        from services.measurer.metaschedule import cuda_compile

        self.settings = LaneSettings()
        use_broker(app, self.settings.redis_url, self.settings.redis_outage_s)
        cuda_compile.configure(cuda_compile.options_from(self.settings))

    def build(self, **_) -> None:
        """Before the worker consumes: a builder's core when it is a builder, else its lane's (not warm yet)."""
        s = self.settings
        r = store.connect(s.redis_url, s.redis_outage_s)
        if s.builder_family:
            self.builder = Builder(r, _forward, s.builder_family)
        else:
            self.lane = LaneWorker(s, lanes.parse(s.lane, s.host()), r, sandboxed=s.sandbox)

    def start(self, **_) -> None:
        (self.builder or self.lane).start()

    def stop(self, **_) -> None:
        (self.builder or self.lane).close()

    def builder_for_message(self) -> Builder:
        """This process's builder, or a lane's own for a build message that reached it."""
        return self.builder or Builder(self.lane.redis, _forward)


WORKER = MeasurerWorker()
signals.celeryd_init.connect(exits_if_it_fails(WORKER.configure), weak=False)
signals.worker_init.connect(exits_if_it_fails(WORKER.build), weak=False)
signals.worker_ready.connect(exits_if_it_fails(WORKER.start), weak=False)
signals.worker_shutdown.connect(WORKER.stop, weak=False)


# Acknowledged on receipt: a builder killed mid-batch loses the message, and the tuner's batch watch,
# which sees the builder's liveness key expire, re-sends the batch to a lane (which builds it itself).
@app.task(name=names.BUILD_TASK, acks_late=False)
def build_batch(payload):
    """Build every candidate of a batch; forward the built ones to their lane, answer failed builds."""
    builder = WORKER.builder_for_message()
    try:
        req = BuildRequest.parse(payload)
    except MessageError as err:
        queue = names.build_queue(builder.family) if builder.family else "build"
        _answer_malformed(builder.redis, queue, WORKER.settings.lane,
                          payload.get("batch") if isinstance(payload, dict) else payload, str(err))
        return {"error": str(err)}
    return builder.build(req)


@app.task(name=names.MEASURE_TASK, acks_late=True)
def measure_batch(payload):
    """Build and time a batch of candidates; one MeasureResult per candidate goes to Redis."""
    from celery.worker import state as worker_state

    lane = WORKER.lane
    try:
        batch = MeasureBatch.parse(payload)
    except MessageError as err:
        _answer_malformed(lane.redis, lane.lane.queue, lane.lane.queue, payload, str(err))
        return {"error": str(err)}
    results = lane.measure(batch)
    summary = {"batch_id": batch.batch_id, "measured": len(results), "ok": sum(r.error is None for r in results)}
    if any(r.error_kind == ErrorKind.CANCELLED for r in results):
        summary["cancelled"] = True
    if lane.gpu_fault is not None:
        # the lane has left the lane list; end the worker once this message is acknowledged, with the exit
        # code the stack's supervisor reads as "restart MPS and this GPU's lanes"
        worker_state.should_stop = names.EXIT_GPU_FAULT
        summary["gpu_fault"] = lane.gpu_fault
        atexit.register(_end_without_freeing)
    return summary


def _end_without_freeing() -> None:
    """The process's last step after a GPU fault: leave with the GPU-fault code before the interpreter frees
    the dead context's device objects (a free there aborts, and the supervisor would read a crash)."""
    logging.shutdown()
    os._exit(names.EXIT_GPU_FAULT)


def _answer_malformed(r, queue: str, lane: str, payload, why: str) -> None:
    """A message that fails validation is kept in the dead-letter list, and if it names a batch and
    candidates, each gets an error result, so whoever waits on them is not left hanging."""
    body = payload if isinstance(payload, str) else json.dumps(payload, default=str)
    store.dead_letter(r, queue, why, body)
    log.error("rejected message on %s: %s", queue, why)
    if isinstance(payload, dict) and isinstance(payload.get("batch_id"), str):
        for cand in payload.get("candidates") or []:
            cid = cand.get("candidate_id") if isinstance(cand, dict) else None
            if isinstance(cid, str):
                store.put_result(r, payload["batch_id"], MeasureResult(candidate_id=cid, error=why, lane=lane,
                                                                     error_kind=ErrorKind.MALFORMED))

"""The measurer's only Celery boundary: one lane per worker process, one queue per lane; and the
builders, stateless workers that build candidates for a target family and forward them to their lanes.

A lane is started by `python -m services.measurer --lane QUEUE`, which sets the lane's environment
and CPU affinity before this module (and TVM) load, then runs a solo-pool worker: the same warm process
builds (when no builder serves its family) and times every batch the lane ever receives. A builder is
started by `python -m services.measurer --builder FAMILY` (SHARETUNE_BUILDER_FAMILY set): it needs no GPU,
opens no CUDA context, and any number of them, on any host, serve one build.<family> queue.

Here only: the worker's signals build and tear down its core (services.measurer.worker), and each task
parses its message, calls the core, and answers a malformed message."""
from __future__ import annotations

import atexit
import json
import logging
import os

from celery import signals

from shared import lanes, names, store
from services.celery_app import exits_if_it_fails, make_celery
from shared.errors import MessageError
from shared.messages import BuildRequest, ErrorKind, MeasureBatch, MeasureResult
from shared.settings import LaneSettings
from services.measurer.worker import Builder, LaneWorker

log = logging.getLogger("sharetune.lane")
settings = LaneSettings()
# Celery connects when the worker starts, not here
app = make_celery("measurer", settings.redis_url, settings.redis_outage_s)
# Built when the worker starts (_init_worker), never at import: this process's lane, or its builder.
WORKER: LaneWorker | None = None
BUILDER: Builder | None = None


def _forward(batch: MeasureBatch, lane: str) -> None:
    app.send_task(names.MEASURE_TASK, args=[batch.model_dump(mode="json")], queue=lane)


@signals.worker_init.connect
@exits_if_it_fails
def _init_worker(**_):
    """Before the worker consumes: a builder's core when it is a builder, else its lane's (not warm yet)."""
    global WORKER, BUILDER
    r = store.connect(settings.redis_url, settings.redis_outage_s)
    if settings.builder_family:
        BUILDER = Builder(r, _forward, settings.builder_family)
    else:
        WORKER = LaneWorker(settings, lanes.parse(settings.lane), r, sandboxed=settings.sandbox)


@signals.worker_ready.connect
@exits_if_it_fails
def _on_ready(**_):
    (BUILDER or WORKER).start()


@signals.worker_shutdown.connect
def _on_shutdown(**_):
    (BUILDER or WORKER).close()


# Acknowledged on receipt: a builder killed mid-batch loses the message, and the tuner's batch watch,
# which sees the builder's liveness key expire, re-sends the batch to a lane (which builds it itself).
@app.task(name=names.BUILD_TASK, acks_late=False)
def build_batch(payload):
    """Build every candidate of a batch; forward the built ones to their lane, answer failed builds."""
    builder = BUILDER or Builder(WORKER.redis, _forward)  # a build message that reached a lane
    try:
        req = BuildRequest.parse(payload)
    except MessageError as err:
        _answer_malformed(builder.redis, names.build_queue(BUILDER.family) if BUILDER else "build", settings.lane,
                          payload.get("batch") if isinstance(payload, dict) else payload, str(err))
        return {"error": str(err)}
    return builder.build(req)


@app.task(name=names.MEASURE_TASK, acks_late=True)
def measure_batch(payload):
    """Build and time a batch of candidates; one MeasureResult per candidate goes to Redis."""
    from celery.worker import state as worker_state

    try:
        batch = MeasureBatch.parse(payload)
    except MessageError as err:
        _answer_malformed(WORKER.redis, WORKER.lane.queue, WORKER.lane.queue, payload, str(err))
        return {"error": str(err)}
    results = WORKER.measure(batch)
    summary = {"batch_id": batch.batch_id, "measured": len(results), "ok": sum(r.error is None for r in results)}
    if any(r.error_kind == ErrorKind.CANCELLED for r in results):
        summary["cancelled"] = True
    if WORKER.gpu_fault is not None:
        # the lane has left the lane list; end the worker once this message is acknowledged, with the exit
        # code the stack's supervisor reads as "restart MPS and this GPU's lanes"
        worker_state.should_stop = names.EXIT_GPU_FAULT
        summary["gpu_fault"] = WORKER.gpu_fault
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

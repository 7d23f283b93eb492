"""The tuner service's only Celery boundary: plan (queue `plan`), tune (queue `tune`) and the central
cost-model updater (queue `costmodel`). Each runs in its own worker process (`-Q` picks the role); the
logic lives in planner.py, search.py and updater.py. Failures end the job with a message naming the
problem; they are never raised back across the queue."""
from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import traceback

from celery import signals

from shared import names, store
from shared.celery_app import make_celery
from shared.errors import MessageError, SharetuneError
from shared.messages import JobRef, TrainingBatch
from shared.settings import TunerSettings, UpdaterSettings

log = logging.getLogger("sharetune.tuner")
settings = TunerSettings()
app = make_celery("tuner", settings.redis_url)
_redis = None


def redis():
    global _redis
    if _redis is None:
        _redis = store.connect(settings.redis_url)
    return _redis


@signals.worker_ready.connect
def _warm_up(sender=None, **_):
    """A tuner client loads TVM and its targets' tensor intrinsics once, before it takes work, then
    keeps a liveness key (the stack waits for it; a later issue's reaper reads it)."""
    consumer = getattr(sender, "task_consumer", None) or getattr(getattr(sender, "consumer", None), "task_consumer", None)
    queues = {q.name for q in consumer.queues} if consumer is not None else set()
    if names.PLAN_QUEUE in queues:
        import tvm.s_tir.meta_schedule  # noqa: F401 - the planner's first job should not pay the import
    if names.TUNE_QUEUE not in queues:
        return
    from services.tuner.metaschedule.intrinsics import load_tensor_intrinsics

    for kind in settings.warm_kinds.split(","):
        if kind.strip():
            load_tensor_intrinsics(kind.strip())
    worker = f"{socket.gethostname()}.{os.getpid()}"

    def beat():
        while True:
            redis().set(names.tuner_key(worker), "ready", ex=names.LANE_TTL_S)
            time.sleep(names.LANE_TTL_S / 3)

    threading.Thread(target=beat, name="tuner-heartbeat", daemon=True).start()


def _job_ref(payload, source: str) -> JobRef | None:
    try:
        return JobRef.parse(payload)
    except MessageError as err:
        store.dead_letter(redis(), source, str(err), payload if isinstance(payload, str) else json.dumps(payload, default=str))
        log.error("rejected message on %s: %s", source, err)
        return None


def _fail(job_id: str, stage: str, err: BaseException) -> None:
    msg = str(err) if isinstance(err, SharetuneError) else f"{type(err).__name__}: {err}"
    log.error("job %s failed while %s: %s\n%s", job_id, stage, msg, traceback.format_exc())
    store.set_state(redis(), job_id, "failed", error=f"{stage}: {msg}")


@app.task(name=names.PLAN_TASK)
def plan_job(payload):
    from services.tuner import planner

    ref = _job_ref(payload, names.PLAN_QUEUE)
    if ref is None:
        return None
    try:
        tasks = planner.plan(redis(), ref.job_id, settings.lane_wait_s)
    except Exception as err:  # noqa: BLE001
        _fail(ref.job_id, "planning", err)
        return None
    app.send_task(names.TUNE_TASK, args=[ref.model_dump(mode="json")], queue=names.TUNE_QUEUE)
    return {"job_id": ref.job_id, "tasks": len(tasks)}


@app.task(name=names.TUNE_TASK)
def tune_job(payload):
    from services.tuner import search

    ref = _job_ref(payload, names.TUNE_QUEUE)
    if ref is None:
        return None
    state = store.job_state(redis(), ref.job_id).get("state")
    if state in ("done", "cancelled"):
        return {"job_id": ref.job_id, "skipped": state}  # a re-delivered message for a finished job
    try:
        result = search.tune(app, redis(), ref.job_id, settings.work_dir, settings.batch_grace_s)
    except Exception as err:  # noqa: BLE001
        _fail(ref.job_id, "tuning", err)
        return None
    return {"job_id": ref.job_id, "trials": result.trials}


@app.task(name=names.INGEST_TASK)
def ingest_results(payload):
    from services.tuner import updater

    try:
        batch = TrainingBatch.parse(payload)
    except MessageError as err:
        store.dead_letter(redis(), names.COSTMODEL_QUEUE, str(err), json.dumps(payload, default=str)[:4096])
        return None
    up = UpdaterSettings()
    snap = updater.ingest(redis(), batch, up.warmup_rows, up.boost_rounds)
    return {"rows": len(batch.rows), "version": snap.version if snap else None}

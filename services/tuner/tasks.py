"""The tuner service's only Celery boundary: plan (queue `plan`), tune shards and finish jobs (queue
`tune`) and the central cost-model updater (queue `costmodel`). Each runs in its own worker process
(`-Q` picks the role); the logic lives in planner.py, search.py, updater.py and reaper.py. Failures end
the job with a message naming the problem; they are never raised back across the queue.

A tuner client holds the shard it searches with a lease (a Redis key with a TTL its heartbeat renews).
A client that dies loses its lease; any live client's reaper then refunds the shard's unrecorded claim
and sends the shard again, and the next client resumes it from the store. A client asked to stop hands
its shard back at the next round."""
from __future__ import annotations

import json
import logging
import threading
import time
import traceback

from celery import signals

from shared import names, store
from shared.ids import worker_id
from services.celery_app import make_celery
from shared.errors import MessageError, SharetuneError
from shared.messages import FINAL_STATES, JobRef, ShardRef, TrainingBatch
from shared.settings import TunerSettings, UpdaterSettings

log = logging.getLogger("sharetune.tuner")
settings = TunerSettings()
app = make_celery("tuner", settings.redis_url)
_redis = None
WORKER_ID = worker_id()  # a solo-pool worker: the process that imports this module is the one that works
_stopping = threading.Event()  # set on warm shutdown: the running shard is handed back at its next round


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
        from services.tuner.metaschedule import extract  # noqa: F401 - the planner's first job should not pay TVM's import
    if names.TUNE_QUEUE not in queues:
        return
    from services.tuner.metaschedule.intrinsics import load_tensor_intrinsics

    for kind in settings.warm_kinds.split(","):
        if kind.strip():
            load_tensor_intrinsics(kind.strip())
    from services.tuner import reaper

    def beat():
        while True:
            try:
                if _stopping.is_set():
                    return
                store.announce_tuner(redis(), WORKER_ID)
                reaper.reap(redis(), lambda ref: send_shard(ref.job_id, ref.shard), send_finish)
            except Exception as err:  # noqa: BLE001 - a Redis hiccup must not end the heartbeat
                log.warning("heartbeat/reaper: %s", err)
            time.sleep(names.LANE_TTL_S / 3)

    threading.Thread(target=beat, name="tuner-heartbeat", daemon=True).start()


@signals.worker_shutting_down.connect
def _on_shutdown(**_):
    _stopping.set()
    try:  # a stopped client is no longer counted when jobs are split into shards
        store.retire_tuner(redis(), WORKER_ID)
    except Exception:  # noqa: BLE001
        pass


def send(task_name: str, payload: dict, queue: str) -> None:
    """Publish one message: what the search, its lanes runner and its cost model are given to send with."""
    app.send_task(task_name, args=[payload], queue=queue)


def send_shard(job_id: str, shard: int) -> None:
    app.send_task(names.TUNE_TASK, args=[ShardRef(job_id=job_id, shard=shard).model_dump(mode="json")],
                  queue=names.TUNE_QUEUE)


def send_finish(job_id: str) -> None:
    app.send_task(names.FINISH_TASK, args=[JobRef(job_id=job_id).model_dump(mode="json")], queue=names.TUNE_QUEUE)


def _job_ref(payload, source: str, contract=JobRef):
    try:
        return contract.parse(payload)
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
        shards = planner.plan(redis(), ref.job_id, settings.lane_wait_s)
    except planner.Parked as parked:  # look again later; the planner takes the next job meanwhile
        app.send_task(names.PLAN_TASK, args=[ref.model_dump(mode="json")], queue=names.PLAN_QUEUE,
                      countdown=parked.retry_in)
        return {"job_id": ref.job_id, "parked": parked.waiting_for}
    except Exception as err:  # noqa: BLE001
        _fail(ref.job_id, "planning", err)
        return None
    for sh in shards:
        if sh.state == "pending":
            send_shard(ref.job_id, sh.shard)
    return {"job_id": ref.job_id, "shards": len(shards)}


@app.task(name=names.TUNE_TASK)
def tune_shard(payload):
    from services.tuner import search
    from services.tuner.metaschedule.rounds import Stopped

    ref = _job_ref(payload, names.TUNE_QUEUE, ShardRef)
    if ref is None:
        return None
    r = redis()
    state = store.job_hash(r, ref.job_id).state
    if state == "cancelled":
        _finish_cancelled(r, ref.job_id)  # a shard no client took: the job may be finished now
    if state in FINAL_STATES:
        return {"job_id": ref.job_id, "skipped": state}  # a re-delivered message for a finished job
    shard = store.shards(r, ref.job_id).get(ref.shard)
    if shard is None or shard.state == "done":
        return {"job_id": ref.job_id, "shard": ref.shard, "skipped": "done"}
    if _stopping.is_set() or not store.take_lease(r, ref.job_id, ref.shard, WORKER_ID):
        if _stopping.is_set():
            send_shard(ref.job_id, ref.shard)  # taken while shutting down: hand it straight back
        return {"job_id": ref.job_id, "shard": ref.shard, "skipped": "held by another client"}

    def running(sh):
        if sh.state == "done":  # finished by the client that held it until we took the lease
            return False
        sh.state, sh.owner, sh.attempts = "running", WORKER_ID, sh.attempts + 1
        sh.started_at = sh.started_at or time.time()

    if store.update_shard(r, ref.job_id, ref.shard, running, owner=WORKER_ID) is None:
        store.release_lease(r, ref.job_id, ref.shard, WORKER_ID)
        return {"job_id": ref.job_id, "shard": ref.shard, "skipped": "done, or the lease lapsed"}
    if state in ("planned", "queued"):
        store.set_state(r, ref.job_id, "tuning")
    lease = _LeaseKeeper(ref.job_id, ref.shard)
    try:
        run = search.tune_shard(send, r, ref.job_id, ref.shard, settings.work_dir, settings.batch_grace_s,
                                check=lease.check, search_threads=settings.search_threads,
                                cold_start=settings.cold_start, population=settings.population())
    except Stopped as why:
        log.warning("job %s shard %s handed back: %s", ref.job_id, ref.shard, why)
        lease.stop()
        state = store.job_hash(r, ref.job_id).state
        if lease.held() and state not in ("failed", "cancelled"):
            refunded = store.refund_claim(r, ref.job_id, ref.shard)

            def handed_back(sh):
                sh.refunded += refunded
                sh.state, sh.owner, sh.queued_at = "pending", None, time.time()

            # written only while the lease is ours, and released with it: a client that lost its lease
            # was replaced, and the replacement's state stands
            if store.update_shard(r, ref.job_id, ref.shard, handed_back, owner=WORKER_ID, release=True):
                send_shard(ref.job_id, ref.shard)
        elif lease.held() and state == "cancelled":
            # its in-flight round is recorded: it is over
            if store.finish_shard(r, ref.job_id, ref.shard, WORKER_ID):
                _finish_cancelled(r, ref.job_id)
        return {"job_id": ref.job_id, "shard": ref.shard, "handed_back": str(why)}
    except Exception as err:  # noqa: BLE001
        lease.stop()
        _fail(ref.job_id, f"tuning shard {ref.shard}", err)
        return None
    lease.stop()
    if not store.finish_shard(r, ref.job_id, ref.shard, WORKER_ID):
        # the lease lapsed (this client stalled): the reaper sent the shard again, and its next client,
        # which resumes from the records this one stored, marks it done
        log.warning("job %s shard %s: lease lost before the shard was marked done", ref.job_id, ref.shard)
        return {"job_id": ref.job_id, "shard": ref.shard, "lease_lost": True, "trials": run.trials}
    if all(sh.state == "done" for sh in store.shards(r, ref.job_id).values()):
        if store.claim_finish(r, ref.job_id, WORKER_ID):
            send_finish(ref.job_id)
    return {"job_id": ref.job_id, "shard": ref.shard, "trials": run.trials, "reused": run.reused}


def _finish_cancelled(r, job_id: str) -> None:
    """A cancelled job gets the same finishing step as a finished one, on what was measured (best so far
    per task, the exported database, a compiled model), once no client searches it any more; its state
    stays "cancelled"."""
    if store.job_result(r, job_id) is not None:
        return
    if any(sh.state == "running" for sh in store.shards(r, job_id).values()):
        return  # the client still searching finishes it when it stops
    if store.claim_finish(r, job_id, WORKER_ID):
        send_finish(job_id)


@app.task(name=names.FINISH_TASK)
def finish_job(payload):
    from services.tuner import search

    ref = _job_ref(payload, names.TUNE_QUEUE)
    if ref is None:
        return None
    state = store.job_hash(redis(), ref.job_id).state
    if state in ("done", "failed") or (state == "cancelled" and store.job_result(redis(), ref.job_id)):
        return {"job_id": ref.job_id, "skipped": state}
    try:
        result = search.finish_job(send, redis(), ref.job_id, settings.work_dir, settings.batch_grace_s)
    except Exception as err:  # noqa: BLE001
        _fail(ref.job_id, "finishing", err)
        return None
    return {"job_id": ref.job_id, "trials": result.trials}


class _LeaseKeeper:
    """Renews this client's lease on a shard while it searches; `check` (called between rounds) raises
    Stopped once the worker shuts down or the lease was lost (this client stalled and was replaced)."""

    def __init__(self, job_id: str, shard: int):
        self.job_id, self.shard = job_id, shard
        self.started = time.time()
        self._lost = threading.Event()
        self._done = threading.Event()
        threading.Thread(target=self._renew, name=f"lease-{job_id}-{shard}", daemon=True).start()

    def _renew(self):
        while not self._done.wait(names.LEASE_TTL_S / 4):
            try:
                if not store.renew_lease(redis(), self.job_id, self.shard, WORKER_ID):
                    self._lost.set()
                    return
            except Exception as err:  # noqa: BLE001 - Redis away for a moment: try again
                log.warning("lease renewal of %s/%s: %s", self.job_id, self.shard, err)

    def held(self) -> bool:
        return not self._lost.is_set()

    def check(self, passed: bool = False) -> None:
        from services.tuner.metaschedule.rounds import Stopped

        if _stopping.is_set():
            raise Stopped("the tuner client is shutting down")
        if self._lost.is_set():
            raise Stopped("the shard's lease was lost (this client stalled past its TTL)")
        state = store.job_hash(redis(), self.job_id).state
        if state in ("failed", "cancelled"):
            raise Stopped(f"the job is {state}")
        if passed and time.time() - self.started > settings.shard_quantum_s:
            # fewer clients than shards: once each of its tasks has had a round, a client takes turns
            # with a shard that waits for a client, so every task of the job gets its first rounds
            waiting = [sh.shard for sh in store.shards(redis(), self.job_id).values()
                       if sh.state == "pending" and time.time() - sh.queued_at > 2.0]
            if waiting:
                raise Stopped(f"taking turns with shard {waiting[0]}, which no client has taken")

    def stop(self):
        self._done.set()


@app.task(name=names.INGEST_TASK)
def ingest_results(payload):
    from services.tuner import updater

    try:
        batch = TrainingBatch.parse(payload)
    except MessageError as err:
        store.dead_letter(redis(), names.COSTMODEL_QUEUE, str(err), json.dumps(payload, default=str)[:4096])
        return None
    up = UpdaterSettings()
    snap = updater.ingest(redis(), batch, up.warmup_rows, up.boost_rounds, window=up.train_window,
                          best_per_group=up.train_best_per_group, threads=up.train_threads or None)
    return {"rows": len(batch.rows), "version": snap.version if snap else None}

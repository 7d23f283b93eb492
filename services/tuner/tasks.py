"""The tuner service's only Celery boundary: plan (queue `plan`), tune shards and finish jobs (queue
`tune`) and the central cost-model updater (queue `costmodel`). Each runs in its own worker process
(`-Q` picks the role); the logic lives in planner.py, shard_runner.py (with search.py), updater.py and
reaper.py. Failures end the job with a message naming the problem; they are never raised back across
the queue. Here only: the worker's life (TunerWorker, on Celery's worker signals) builds, warms and stops its shard
runner, and each task parses its message, calls the core, and sends what follows."""
from __future__ import annotations

import json
import logging
import time

from celery import signals

from shared import names, store, timeouts
from shared.heartbeat import keep_beating
from shared.ids import worker_id
from services.celery_app import exits_if_it_fails, make_celery, use_broker
from shared.errors import MessageError
from shared.messages import JobRef, ShardPhase, ShardRef, TrainingBatch
from shared.settings import TunerSettings, UpdaterSettings
from services.tuner.shard_runner import ShardRunner, fail_job, left_to_lapse

log = logging.getLogger("sharetune.tuner")
app = make_celery("tuner")  # its broker is the worker's settings' Redis (TunerWorker.configure)
SERVICE_ROLES = {names.PLAN_QUEUE: "planner", names.COSTMODEL_QUEUE: "updater"}  # roles that keep a liveness key


def send(task_name: str, payload: dict, queue: str, priority: int = 0) -> None:
    """Publish one message: what the search, its lanes runner and its cost model are given to send with.
    `priority`: the broker's (0, served first, to 9; allocation.round_priority)."""
    from kombu.exceptions import OperationalError

    try:
        app.send_task(task_name, args=[payload], queue=queue, priority=priority or None)
    except OperationalError:
        if store.unreachable(WORKER.settings.redis_url, 1.0):  # the broker gave up on an outage, not on this message
            store.note_unreachable()
        raise


def send_shard(job_id: str, shard: int) -> None:
    app.send_task(names.TUNE_TASK, args=[ShardRef(job_id=job_id, shard=shard).model_dump(mode="json")],
                  queue=names.TUNE_QUEUE)


def send_finish(job_id: str) -> None:
    app.send_task(names.FINISH_TASK, args=[JobRef(job_id=job_id).model_dump(mode="json")], queue=names.TUNE_QUEUE)


class TunerWorker:
    """This worker process's life: its settings, read once as the worker starts; its shard runner, made before
    the worker consumes (a solo-pool worker: this process is the one that works, so its id names the client);
    its warm-up and liveness keys once it is ready; their end at the first shutdown signal, while a shard may
    still run."""

    def __init__(self):
        self.settings: TunerSettings | None = None
        self.updater_settings: UpdaterSettings | None = None
        self.lane_policy = None  # shared.lanes.LiveLanePolicy: how the planner waits for a job's lanes
        self.runner: ShardRunner | None = None
        self.liveness: list = []  # (role, the event that stops its beat), while the worker serves

    def configure(self, **_) -> None:
        """The first step of the worker's start, before it connects: read the settings, point the app at Redis."""
        self.settings, self.updater_settings = TunerSettings(), UpdaterSettings()
        self.lane_policy = self.settings.live_lane_policy()
        use_broker(app, self.settings.redis_url, self.settings.redis_outage_s)

    @property
    def redis(self):
        return self.runner.redis

    def build(self, **_) -> None:
        self.runner = ShardRunner(store.connect(self.settings.redis_url, self.settings.redis_outage_s), worker_id(),
                                  self.settings, send, send_shard, send_finish)

    def start(self, sender=None, **_) -> None:
        """A tuner client loads TVM and its targets' tensor intrinsics once, before it takes work, then
        keeps a liveness key and runs the reaper (services.tuner.shard_runner)."""
        consumer = (getattr(sender, "task_consumer", None)
                    or getattr(getattr(sender, "consumer", None), "task_consumer", None))
        queues = {q.name for q in consumer.queues} if consumer is not None else set()
        if names.PLAN_QUEUE in queues:
            from services.tuner.metaschedule import extract  # noqa: F401 - the planner's first job should not pay TVM's import
        self.keep_liveness(queues)
        if names.TUNE_QUEUE not in queues:
            return
        from services.tuner.metaschedule.intrinsics import load_tensor_intrinsics

        for kind in self.settings.warm_kinds.split(","):
            if kind.strip():
                load_tensor_intrinsics(kind.strip())
        self.runner.start()

    def keep_liveness(self, queues: set[str]) -> None:
        """A planner and an updater keep a liveness key each, beaten from a thread (so during a long plan
        too): a container's health probe finds it (services.healthcheck); a tuner client keeps its own
        (ShardRunner)."""
        me = worker_id()
        for queue, role in SERVICE_ROLES.items():
            if queue in queues:
                beat = lambda role=role: store.announce_service(self.redis, role, me)  # noqa: E731
                beat()
                self.liveness.append((role, keep_beating(beat, timeouts.HEARTBEAT_S, f"{role} liveness")))

    def stop(self, **_) -> None:
        self.runner.stop()  # the running shard is handed back at its next round
        while self.liveness:
            role, stop = self.liveness.pop()
            stop.set()
            try:
                store.retire_service(self.redis, role, worker_id())
            except Exception:  # noqa: BLE001 - Redis away: the key lapses on its own
                pass


WORKER = TunerWorker()
signals.celeryd_init.connect(exits_if_it_fails(WORKER.configure), weak=False)
signals.worker_init.connect(exits_if_it_fails(WORKER.build), weak=False)
signals.worker_ready.connect(exits_if_it_fails(WORKER.start), weak=False)
# at the signal, not once the worker has stopped: a running shard hands back at its next round
signals.worker_shutting_down.connect(WORKER.stop, weak=False)


def _parse(payload, source: str, contract=JobRef):
    """The message as its contract, or None after dead-lettering it."""
    try:
        return contract.parse(payload)
    except MessageError as err:
        store.dead_letter(WORKER.redis, source, str(err),
                          payload if isinstance(payload, str) else json.dumps(payload, default=str))
        log.error("rejected message on %s: %s", source, err)
        return None


@app.task(name=names.PLAN_TASK)
def plan_job(payload):
    from services.tuner import planner

    ref = _parse(payload, names.PLAN_QUEUE)
    if ref is None:
        return None
    r, me = WORKER.redis, worker_id()
    # a plan message redelivered an hour after its planner died, or one a reaper has replaced since
    if not store.plan_current(r, ref.job_id, ref.plan):
        return {"job_id": ref.job_id, "dropped": "an older plan message than the job's current one"}
    if not store.take_plan_lease(r, ref.job_id, me):
        return {"job_id": ref.job_id, "dropped": "another planner is planning it"}
    # a plan of a large model takes minutes: its lease outlives it, and lapses within seconds of a planner's death
    renewing = keep_beating(lambda: store.renew_plan_lease(r, ref.job_id, me), timeouts.PLAN_LEASE_RENEW_S,
                            "plan lease renewal")
    started = time.time()
    try:
        shards = planner.plan(r, ref.job_id, WORKER.lane_policy, WORKER.settings.pad_awkward == "all",
                              WORKER.settings.fold_norm_transposes)
    except planner.Parked as parked:  # look again later; the planner takes the next job meanwhile
        if ref.plan:
            store.plan_sent(r, ref.job_id, ref.plan)  # the same message again: not stranded
        app.send_task(names.PLAN_TASK, args=[ref.model_dump(mode="json")], queue=names.PLAN_QUEUE,
                      countdown=parked.retry_in)
        return {"job_id": ref.job_id, "parked": parked.waiting_for}
    except Exception as err:  # noqa: BLE001
        if store.outage_since(started, err):  # the plan lease lapses and the reaper sends the plan again
            return left_to_lapse(ref.job_id, "planning", err)
        fail_job(r, ref.job_id, "planning", err)
        store.planned(r, ref.job_id)
        return None
    finally:
        renewing.set()
        try:
            store.release_plan_lease(r, ref.job_id, me)
        except Exception as err:  # noqa: BLE001 - Redis away: the lease lapses on its own
            log.warning("job %s: plan lease not released: %s", ref.job_id, err)
    store.planned(r, ref.job_id)
    for sh in shards:
        if sh.state == ShardPhase.PENDING:
            send_shard(ref.job_id, sh.shard)
    return {"job_id": ref.job_id, "shards": len(shards)}


@app.task(name=names.TUNE_TASK)
def tune_shard(payload):
    ref = _parse(payload, names.TUNE_QUEUE, ShardRef)
    return None if ref is None else WORKER.runner.run(ref)


@app.task(name=names.FINISH_TASK)
def finish_job(payload):
    ref = _parse(payload, names.TUNE_QUEUE)
    return None if ref is None else WORKER.runner.finish(ref.job_id)


@app.task(name=names.INGEST_TASK)
def ingest_results(payload):
    from services.tuner import updater

    try:
        batch = TrainingBatch.parse(payload)
    except MessageError as err:
        store.dead_letter(WORKER.redis, names.COSTMODEL_QUEUE, str(err), json.dumps(payload, default=str)[:4096])
        return None
    up = WORKER.updater_settings
    queued = store.queue_length(WORKER.redis, names.COSTMODEL_QUEUE) > 0
    snap = updater.ingest(WORKER.redis, batch, up.warmup_rows, up.boost_rounds, window=up.train_window,
                          best_per_group=up.train_best_per_group, threads=up.train_threads or None,
                          best_rows=up.train_best_rows, keep_rows=up.train_keep_rows, more_queued=queued)
    return {"rows": len(batch.rows), "version": snap.version if snap else None, "more_queued": queued}

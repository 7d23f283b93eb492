"""Redis is the only shared state. These helpers read and write it through the contracts in
shared.messages; every write is idempotent (keys derive from content), so a re-delivered message or a
restarted process cannot duplicate or lose what is already recorded."""
from __future__ import annotations

import json
import time

import redis

from shared import names
from shared.errors import JobError
from shared.messages import (
    BuilderInfo,
    JobResult,
    JobSpec,
    JobTask,
    LaneBatch,
    LaneInfo,
    GpuFault,
    MeasureResult,
    Quarantined,
    Record,
    ShardState,
    TaskProgress,
    Workload,
)

RESULT_TTL_S = 24 * 3600


REDIS_OUTAGE_S = 60  # how long a restarting Redis is waited for before an operation gives up


def connect(url: str) -> redis.Redis:
    """A client that rides out a Redis restart: connection errors are retried for about REDIS_OUTAGE_S
    (the AOF brings back everything that was acknowledged). A password in the URL is used."""
    from redis.backoff import ExponentialBackoff
    from redis.retry import Retry

    retry = Retry(ExponentialBackoff(cap=1.0, base=0.05), retries=REDIS_OUTAGE_S + 6)
    return redis.Redis.from_url(url, decode_responses=False, health_check_interval=30, retry=retry,
                                retry_on_error=[redis.exceptions.ConnectionError, redis.exceptions.TimeoutError])


def _s(v) -> str | None:
    return v.decode() if isinstance(v, bytes) else v


# ---- jobs --------------------------------------------------------------------------------------------


def create_job(r: redis.Redis, spec: JobSpec, model_blob: bytes) -> None:
    with r.pipeline() as p:
        p.set(names.job_model_key(spec.job_id), model_blob)
        p.hset(
            names.job_key(spec.job_id),
            mapping={"spec": spec.model_dump_json(), "state": "queued", "updated_at": time.time()},
        )
        p.zadd(names.JOBS_KEY, {spec.job_id: spec.submitted_at})
        p.execute()


def job_spec(r: redis.Redis, job_id: str) -> JobSpec:
    raw = r.hget(names.job_key(job_id), "spec")
    if raw is None:
        raise JobError(f"no job {job_id!r} in the store")
    return JobSpec.parse(raw)


def job_model(r: redis.Redis, job_id: str) -> bytes:
    blob = r.get(names.job_model_key(job_id))
    if blob is None:
        raise JobError(f"job {job_id!r} has no model in the store")
    return blob


# A cancelled job stays cancelled: a planner or tuner still finishing a step must not overwrite it.
_SET_STATE = """
if redis.call('HGET', KEYS[1], 'state') == 'cancelled' then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV))
return 1
"""


def set_state(r: redis.Redis, job_id: str, state: str, error: str | None = None, **extra) -> bool:
    """Move a job to `state` (and stamp `<state>_at`, for ETAs and reports); False if it was cancelled."""
    now = time.time()
    mapping = {"state": state, "updated_at": now, f"{state}_at": now, **{k: str(v) for k, v in extra.items()}}
    if error is not None:
        mapping["error"] = error
    args = [str(x) for kv in mapping.items() for x in kv]
    return bool(r.eval(_SET_STATE, 1, names.job_key(job_id), *args))


_CANCEL = """
local state = redis.call('HGET', KEYS[1], 'state')
if not state then return false end
if state == 'done' or state == 'failed' or state == 'cancelled' then return state end
redis.call('SET', KEYS[2], ARGV[1])
redis.call('HSET', KEYS[1], 'state', 'cancelled', 'updated_at', ARGV[1], 'cancelled_at', ARGV[1])
return 'cancelled'
"""


def cancel_job(r: redis.Redis, job_id: str) -> str:
    """Ask a job to stop: the tuner leaves the search after the current round, lanes skip its batches.
    Returns the state the job is in afterwards (a finished job stays done or failed). Atomic, so a
    job that finishes at the same moment is either done or cancelled, never both."""
    state = r.eval(_CANCEL, 2, names.job_key(job_id), names.job_cancel_key(job_id), str(time.time()))
    if state is None:
        raise JobError(f"no job {job_id!r} in the store")
    return _s(state)


def job_cancelled(r: redis.Redis, job_id: str) -> bool:
    return bool(r.exists(names.job_cancel_key(job_id)))


def jobs(r: redis.Redis, limit: int = 50) -> list[str]:
    """Newest first."""
    return [_s(j) for j in r.zrevrange(names.JOBS_KEY, 0, limit - 1)]


def job_state(r: redis.Redis, job_id: str) -> dict:
    raw = r.hgetall(names.job_key(job_id))
    if not raw:
        raise JobError(f"no job {job_id!r} in the store")
    return {_s(k): _s(v) for k, v in raw.items()}


def set_result(r: redis.Redis, result: JobResult) -> None:
    r.hset(names.job_key(result.job_id), mapping={"result": result.model_dump_json()})


def job_result(r: redis.Redis, job_id: str) -> JobResult | None:
    raw = r.hget(names.job_key(job_id), "result")
    return JobResult.parse(raw) if raw else None


def put_tasks(r: redis.Redis, job_id: str, tasks: list[JobTask], reused: dict[str, int]) -> None:
    with r.pipeline() as p:
        p.delete(names.job_tasks_key(job_id))
        for t in tasks:
            p.hset(names.job_tasks_key(job_id), t.task_id, t.model_dump_json())
            prog = TaskProgress(task_id=t.task_id, name=t.name, reused_trials=reused.get(t.wkey, 0))
            p.hsetnx(names.job_progress_key(job_id), t.task_id, prog.model_dump_json())
        p.execute()


def job_tasks(r: redis.Redis, job_id: str) -> list[JobTask]:
    raw = r.hgetall(names.job_tasks_key(job_id))
    tasks = [JobTask.parse(v) for v in raw.values()]
    # heaviest first: when the budget is smaller than tasks x trials per round, the first rounds of
    # MetaSchedule's task scheduler go to the tasks that dominate the model's latency
    return sorted(tasks, key=lambda t: (-t.flops * t.weight, t.name, t.task_id))


def job_progress(r: redis.Redis, job_id: str) -> dict[str, TaskProgress]:
    raw = r.hgetall(names.job_progress_key(job_id))
    return {_s(k): TaskProgress.parse(v) for k, v in raw.items()}


def put_progress(r: redis.Redis, job_id: str, prog: TaskProgress) -> None:
    r.hset(names.job_progress_key(job_id), prog.task_id, prog.model_dump_json())


# ---- shards, the job-wide budget and the leases of tuner clients ---------------------------------------

# Claim up to ARGV[1] trials from the job's budget for shard ARGV[2]; returns how many were granted.
# Atomic, so concurrent clients never overspend; the claim stays on the shard until its records land.
_CLAIM = """
local left = tonumber(redis.call('GET', KEYS[1]) or '0')
local want = tonumber(ARGV[1])
local k = math.min(left, want)
if k > 0 then
  redis.call('DECRBY', KEYS[1], k)
  redis.call('HINCRBY', KEYS[2], ARGV[2], k)
end
return k
"""

# Hand back what a shard claimed but never recorded (its client died); returns the amount.
_REFUND = """
local k = tonumber(redis.call('HGET', KEYS[2], ARGV[1]) or '0')
if k > 0 then
  redis.call('INCRBY', KEYS[1], k)
  redis.call('HSET', KEYS[2], ARGV[1], 0)
end
return k
"""

# Take a shard's lease if free or already ours (a redelivered message of the same client).
_LEASE = """
local cur = redis.call('GET', KEYS[1])
if cur and cur ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
return 1
"""

# Renew a lease only while we hold it; 0 means it is lost (expired and taken by a replacement).
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('EXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
"""


def put_shards(r: redis.Redis, job_id: str, shards: list[ShardState], budget: int) -> None:
    """Write a job's shards and its budget once; a re-planned job keeps what it had."""
    with r.pipeline() as p:
        for sh in shards:
            p.hsetnx(names.job_shards_key(job_id), str(sh.shard), sh.model_dump_json())
        p.set(names.job_budget_key(job_id), int(budget), nx=True)
        p.sadd(names.ACTIVE_JOBS_KEY, job_id)
        p.execute()


def shards(r: redis.Redis, job_id: str) -> dict[int, ShardState]:
    raw = r.hgetall(names.job_shards_key(job_id))
    return {int(_s(k)): ShardState.parse(v) for k, v in raw.items()}


def put_shard(r: redis.Redis, job_id: str, sh: ShardState) -> None:
    r.hset(names.job_shards_key(job_id), str(sh.shard), sh.model_dump_json())


def budget_left(r: redis.Redis, job_id: str) -> int:
    return int(r.get(names.job_budget_key(job_id)) or 0)


def claim_trials(r: redis.Redis, job_id: str, shard: int, want: int) -> int:
    return int(r.eval(_CLAIM, 2, names.job_budget_key(job_id), names.job_claims_key(job_id), int(want), str(shard)))


def settle_claim(r: redis.Redis, job_id: str, shard: int, recorded: int, pipe=None) -> None:
    """Trials of a shard's claim whose records are now in the store are spent for good."""
    (pipe or r).hincrby(names.job_claims_key(job_id), str(shard), -int(recorded))


def refund_claim(r: redis.Redis, job_id: str, shard: int) -> int:
    return int(r.eval(_REFUND, 2, names.job_budget_key(job_id), names.job_claims_key(job_id), str(shard)))


def take_lease(r: redis.Redis, job_id: str, shard: int, owner: str, ttl_s: int = names.LEASE_TTL_S) -> bool:
    return bool(r.eval(_LEASE, 1, names.shard_lease_key(job_id, shard), owner, int(ttl_s)))


def renew_lease(r: redis.Redis, job_id: str, shard: int, owner: str, ttl_s: int = names.LEASE_TTL_S) -> bool:
    return bool(r.eval(_RENEW, 1, names.shard_lease_key(job_id, shard), owner, int(ttl_s)))


def lease_owner(r: redis.Redis, job_id: str, shard: int) -> str | None:
    return _s(r.get(names.shard_lease_key(job_id, shard)))


def release_lease(r: redis.Redis, job_id: str, shard: int, owner: str) -> None:
    if lease_owner(r, job_id, shard) == owner:
        r.delete(names.shard_lease_key(job_id, shard))


def push_history(r: redis.Redis, job_id: str, task_id: str, best_s: float) -> None:
    """Append a task's best latency after one of its rounds (one writer per task: its shard's client)."""
    key = names.job_history_key(job_id)
    hist = json.loads(_s(r.hget(key, task_id)) or "[]")
    hist.append(float(best_s))
    r.hset(key, task_id, json.dumps(hist))


def history(r: redis.Redis, job_id: str) -> dict[str, list[float]]:
    return {_s(k): json.loads(_s(v)) for k, v in r.hgetall(names.job_history_key(job_id)).items()}


# ---- workloads and records ------------------------------------------------------------------------------


def put_workload(r: redis.Redis, wl: Workload) -> bool:
    """Store a workload once; True when it was new."""
    return bool(r.set(names.workload_key(wl.wkey), wl.model_dump_json(), nx=True))


def workload(r: redis.Redis, wkey: str) -> Workload:
    raw = r.get(names.workload_key(wkey))
    if raw is None:
        raise JobError(f"workload {wkey} is not in the store")
    return Workload.parse(raw)


# What lanes and builders answer for the candidates of a cancelled job: not a measurement, so it is never
# stored as a record (services.tuner.metaschedule.records skips it).
CANCELLED = "job cancelled"


def valid_record(rec: Record) -> bool:
    """A measurement: no error and some figures. Only these answer a reuse lookup or count as reused."""
    return rec.error is None and bool(rec.run_secs)


# A record is kept once (idempotent), except that a valid measurement replaces an error record: a later
# job that measures a candidate which once failed (e.g. for a transient reason) leaves the measurement.
_PUT_RECORD = """
local old = redis.call('HGET', KEYS[1], ARGV[1])
if old and ARGV[3] == '1' then
  local o = cjson.decode(old)
  if (o['error'] == nil or o['error'] == cjson.null) and type(o['run_secs']) == 'table' and #o['run_secs'] > 0 then
    return 0
  end
elseif old then
  return 0
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return 1
"""


def put_record(r: redis.Redis, rec: Record) -> bool:
    """Idempotent: the candidate key is a hash of workload + trace, so a re-measured candidate keeps
    its first valid record. True when the record was written (on a pipeline: queued, returns False)."""
    return bool(r.eval(_PUT_RECORD, 1, names.records_key(rec.wkey), rec.candidate_key, rec.model_dump_json(),
                       "1" if valid_record(rec) else "0"))


def replace_record(r: redis.Redis, rec: Record) -> None:
    """Overwrite a record in place (re-timing adds figures; it never removes a record)."""
    r.hset(names.records_key(rec.wkey), rec.candidate_key, rec.model_dump_json())


def records(r: redis.Redis, wkey: str) -> list[Record]:
    return [Record.parse(v) for v in r.hvals(names.records_key(wkey))]


def record_count(r: redis.Redis, wkey: str) -> int:
    """The valid records of a workload: what a new job reuses (error records are measured again)."""
    return sum(1 for rec in records(r, wkey) if valid_record(rec))


def known_records(r: redis.Redis, wkey: str, keys: list[str]) -> dict[str, Record]:
    """The valid records the store holds for these candidate keys; an error record is not an answer."""
    if not keys:
        return {}
    raw = r.hmget(names.records_key(wkey), keys)
    found = {k: Record.parse(v) for k, v in zip(keys, raw) if v is not None}
    return {k: rec for k, rec in found.items() if valid_record(rec)}


# ---- lanes -------------------------------------------------------------------------------------------


def announce_lane(r: redis.Redis, info: LaneInfo) -> None:
    r.set(names.lane_key(info.queue, info.worker), info.model_dump_json(), ex=names.LANE_TTL_S)


def retire_lane(r: redis.Redis, info: LaneInfo) -> None:
    r.delete(names.lane_key(info.queue, info.worker))


def live_lanes(r: redis.Redis) -> list[LaneInfo]:
    lanes = []
    for key in r.scan_iter(match=names.LANES_PATTERN, count=500):
        raw = r.get(key)
        if raw:
            lanes.append(LaneInfo.parse(raw))
    return sorted(lanes, key=lambda l: l.queue)


def lane_alive(r: redis.Redis, queue: str) -> bool:
    """True while at least one worker of the lane keeps its liveness key."""
    return next(iter(r.scan_iter(match=names.lane_key(queue), count=500)), None) is not None


def announce_builder(r: redis.Redis, info: BuilderInfo) -> None:
    r.set(names.builder_key(info.family, info.worker), info.model_dump_json(), ex=names.LANE_TTL_S)


def retire_builder(r: redis.Redis, info: BuilderInfo) -> None:
    r.delete(names.builder_key(info.family, info.worker))


def live_builders(r: redis.Redis, family: str | None = None) -> list[BuilderInfo]:
    out = []
    for key in r.scan_iter(match=names.builder_key(family) if family else names.BUILDERS_PATTERN, count=500):
        raw = r.get(key)
        if raw:
            out.append(BuilderInfo.parse(raw))
    return sorted(out, key=lambda b: (b.family, b.worker))


def mark_batch_building(r: redis.Redis, batch_id: str, worker: str, alive_key: str, forwarded: bool = False) -> None:
    """A builder took the batch (its liveness key says whether it still lives), or forwarded it to its lane."""
    key = names.batch_results_key(batch_id)
    building = {"at": time.time(), "worker": worker, "alive_key": alive_key, "forwarded": forwarded}
    with r.pipeline() as p:
        p.hset(key, "_building", json.dumps(building))
        p.expire(key, RESULT_TTL_S)
        p.execute()


def claim_slot(r: redis.Redis, scope: str, slots: int, worker: str, ttl_s: int = names.LANE_TTL_S) -> int | None:
    """Claim the first free slot of a lane pool for `worker` (atomic per slot); None when all are taken.
    The claim lives while its owner refreshes it (the lane's heartbeat)."""
    for i in range(slots):
        if r.set(names.lane_claim_key(scope, i), worker, nx=True, ex=ttl_s):
            return i
    return None


# ---- measurement results -----------------------------------------------------------------------------


def mark_batch_started(r: redis.Redis, batch_id: str, lane: str, worker: str | None = None,
                       job_id: str = "", candidates: int = 0) -> None:
    key = names.batch_results_key(batch_id)
    started = {"at": time.time(), "lane": lane, "worker": worker, "job_id": job_id, "candidates": candidates}
    with r.pipeline() as p:
        p.hset(key, "_started", json.dumps(started))
        p.expire(key, RESULT_TTL_S)
        p.execute()


def put_result(r: redis.Redis, batch_id: str, res: MeasureResult) -> None:
    key = names.batch_results_key(batch_id)
    with r.pipeline() as p:
        p.hset(key, res.candidate_id, res.model_dump_json())
        p.expire(key, RESULT_TTL_S)
        p.execute()


def batch_results(r: redis.Redis, batch_id: str) -> tuple[dict | None, dict[str, MeasureResult]]:
    started, _, out = batch_progress(r, batch_id)
    return started, out


def batch_progress(r: redis.Redis, batch_id: str) -> tuple[dict | None, dict | None, dict[str, MeasureResult]]:
    """(lane started, builder building, results) of one batch."""
    raw = r.hgetall(names.batch_results_key(batch_id))
    started = building = None
    out = {}
    for k, v in raw.items():
        k = _s(k)
        if k == "_started":
            started = json.loads(v)
        elif k == "_building":
            building = json.loads(v)
        else:
            out[k] = MeasureResult.parse(v)
    return started, building, out


def log_lane_batch(r: redis.Redis, job_id: str, batch: LaneBatch) -> None:
    key = names.job_batches_key(job_id)
    with r.pipeline() as p:
        p.rpush(key, batch.model_dump_json())
        p.expire(key, 30 * RESULT_TTL_S)
        p.execute()


def lane_batches(r: redis.Redis, job_id: str) -> list[LaneBatch]:
    return [LaneBatch.parse(v) for v in r.lrange(names.job_batches_key(job_id), 0, -1)]


def dead_letter(r: redis.Redis, source: str, why: str, body: str) -> None:
    entry = json.dumps({"at": time.time(), "source": source, "why": why, "body": body[:4096]})
    r.rpush(names.DEADLETTER_KEY, entry)


# ---- poison candidates ---------------------------------------------------------------------------------


def candidate_hash(packed_mod: str) -> str:
    """A candidate's identity across batches, lanes and jobs: the hash of its scheduled module."""
    import hashlib

    return hashlib.sha1(packed_mod.encode()).hexdigest()[:24]


def crash_pending(r: redis.Redis, chash: str) -> int:
    """Counted before the candidate runs: if its process dies with it, the count stays."""
    return int(r.hincrby(names.CRASHES_KEY, chash, 1))


def crash_clear(r: redis.Redis, chash: str) -> None:
    """The candidate ran to an answer (a valid time or an ordinary error): it is not poison."""
    r.hdel(names.CRASHES_KEY, chash)


def crash_count(r: redis.Redis, chash: str) -> int:
    return int(r.hget(names.CRASHES_KEY, chash) or 0)


def quarantine(r: redis.Redis, entry: Quarantined) -> None:
    with r.pipeline() as p:
        p.hset(names.QUARANTINE_KEY, entry.candidate_hash, entry.model_dump_json())
        p.hdel(names.CRASHES_KEY, entry.candidate_hash)
        p.execute()


def quarantined(r: redis.Redis, chash: str) -> Quarantined | None:
    raw = r.hget(names.QUARANTINE_KEY, chash)
    return Quarantined.parse(raw) if raw else None


def quarantined_all(r: redis.Redis, job_id: str | None = None) -> list[Quarantined]:
    entries = [Quarantined.parse(v) for v in r.hvals(names.QUARANTINE_KEY)]
    return sorted((e for e in entries if job_id is None or e.job_id == job_id), key=lambda e: e.at)


def report_gpu_fault(r: redis.Redis, fault: GpuFault) -> None:
    key = names.gpu_faults_key(fault.gpu8)
    with r.pipeline() as p:
        p.rpush(key, fault.model_dump_json())
        p.ltrim(key, -1000, -1)
        p.execute()


def gpu_faults(r: redis.Redis, gpu8: str, since: float = 0.0) -> list[GpuFault]:
    faults = [GpuFault.parse(v) for v in r.lrange(names.gpu_faults_key(gpu8), 0, -1)]
    return [f for f in faults if f.at >= since]


# ---- GPUs given up ---------------------------------------------------------------------------------------


def give_up_gpu(r: redis.Redis, gpu8: str, error: str, lanes: list[str]) -> list[str]:
    """Record that the supervisor stopped recovering a GPU, and write the error to every active job that
    planned or ran lanes of it (its status shows it; the job may still finish on other GPUs' lanes).
    Returns those jobs' ids."""
    entry = {"gpu8": gpu8, "error": error, "lanes": sorted(set(lanes)), "at": time.time()}
    r.hset(names.GPUS_DOWN_KEY, gpu8, json.dumps(entry))
    hit = []
    for raw in r.smembers(names.ACTIVE_JOBS_KEY):
        job_id = _s(raw)
        planned = json.loads(_s(r.hget(names.job_key(job_id), "lanes")) or "[]")
        used = set(planned) | {b.lane for b in lane_batches(r, job_id)}
        if any(_lane_gpu(q) == gpu8 for q in used):
            r.hset(names.job_key(job_id), mapping={"gpu_error": error, "updated_at": time.time()})
            hit.append(job_id)
    return sorted(hit)


def gpus_down(r: redis.Redis) -> dict[str, dict]:
    """gpu8 -> {gpu8, error, lanes, at} for every GPU the supervisor gave up."""
    return {_s(k): json.loads(v) for k, v in r.hgetall(names.GPUS_DOWN_KEY).items()}


def _lane_gpu(queue: str) -> str | None:
    try:
        return names.LaneName.parse(queue).gpu
    except ValueError:
        return None

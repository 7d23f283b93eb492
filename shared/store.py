"""Redis is the only shared state, and this module its only client: every Redis command of the services,
the client and the CLI is one of the functions below (tests/test_store_races.py checks that no other
module calls Redis). They read and write through the contracts in shared.messages; every write is
idempotent (keys derive from content), so a re-delivered message or a restarted process cannot duplicate
or lose what is already recorded. Whatever is held by one owner (a shard's lease, a lane's claim, a GPU's
gate) is renewed and released only by its owner, atomically (a Lua compare-and-expire/delete): an owner
whose hold expired and was retaken never deletes its successor's. Callers pass the connection."""
from __future__ import annotations

import json
import time

from typing import Callable

import redis
from redis.commands.core import Script

from shared import lanes, names
from shared.errors import JobError, StoreFullError
from shared.messages import (
    FINAL_STATES,
    BuilderInfo,
    CostModelSnapshot,
    DefaultTiming,
    JobHash,
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
    TrainingRow,
    Workload,
)

RESULT_TTL_S = 24 * 3600
DEADLETTER_KEEP = 1000


REDIS_OUTAGE_S = 60  # how long a restarting Redis is waited for before an operation gives up


def connect(url: str) -> redis.Redis:
    """A client that rides out a Redis restart: connection errors are retried for about REDIS_OUTAGE_S
    (the AOF brings back everything that was acknowledged). A password in the URL is used."""
    from redis.backoff import ExponentialBackoff
    from redis.retry import Retry

    retry = Retry(ExponentialBackoff(cap=1.0, base=0.05), retries=REDIS_OUTAGE_S + 6)
    return redis.Redis.from_url(url, decode_responses=False, health_check_interval=30, retry=retry,
                                retry_on_error=[redis.exceptions.ConnectionError, redis.exceptions.TimeoutError])


def unreachable(url: str, timeout_s: float) -> str | None:
    """One ping with a connect timeout and no retries: None when Redis answers, else why not (one line).
    For a quick check before work starts, not for the services' connection (see connect)."""
    try:
        r = redis.Redis.from_url(url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s)
        try:
            r.ping()
        finally:
            r.close()
    except (redis.exceptions.RedisError, ValueError, OSError) as err:
        return (str(err).strip().splitlines() or [type(err).__name__])[0]
    return None


def _s(v) -> str | None:
    return v.decode() if isinstance(v, bytes) else v


def _script(source: str) -> Script:
    """A Lua script run by its SHA: the server loads it once (and again after a restart that lost it);
    it works on any connection or pipeline passed as `client`."""
    return Script(None, source.encode())


# ---- jobs --------------------------------------------------------------------------------------------


def create_job(r: redis.Redis, spec: JobSpec, model_blob: bytes) -> None:
    """Store a new job; StoreFullError (nothing written) when Redis is at its maxmemory."""
    try:
        with r.pipeline() as p:  # MULTI/EXEC: a store that is full refuses all of it
            p.set(names.job_model_key(spec.job_id), model_blob)
            p.hset(names.job_key(spec.job_id),
                   mapping=JobHash.dump_fields(spec=spec, state="queued", updated_at=time.time()))
            p.zadd(names.JOBS_KEY, {spec.job_id: spec.submitted_at})
            p.execute()
    except redis.exceptions.OutOfMemoryError:
        mem = memory(r)
        raise StoreFullError(
            f"the store is full: Redis uses {mem['used_bytes'] / 2**20:.1f} MiB of its maxmemory "
            f"{mem['max_bytes'] / 2**20:.1f} MiB; job {spec.job_id} was not submitted. Free space with "
            f"`python -m sharetune prune --older-than 7d` (ended jobs; tuning records stay), or raise "
            f"SHARETUNE_REDIS_MAXMEMORY") from None


def memory(r: redis.Redis) -> dict:
    """Redis's memory: used and max bytes (0: no limit), and how many keys it holds."""
    info = r.info("memory")
    return {"used_bytes": int(info.get("used_memory", 0)), "max_bytes": int(info.get("maxmemory", 0)),
            "keys": int(r.dbsize())}


def prune_jobs(r: redis.Redis, older_than_s: float, now: float | None = None, dry_run: bool = False) -> list[str]:
    """Delete every key of each job that ended (done, failed, cancelled) more than `older_than_s` ago, or
    whose status is gone; the workloads' records and defaults stay (the tuning knowledge: exports and later
    jobs reuse them). Returns the job ids pruned (would be, with `dry_run`)."""
    cutoff = (time.time() if now is None else now) - older_than_s
    gone = []
    for raw in r.zrange(names.JOBS_KEY, 0, -1):
        job_id = _s(raw)
        state, updated = (_s(v) for v in r.hmget(names.job_key(job_id), "state", "updated_at"))
        ended_at = float(updated) if updated else 0.0
        if state is None or (state in FINAL_STATES and ended_at < cutoff):
            gone.append(job_id)
    if not dry_run:
        for i in range(0, len(gone), 100):
            with r.pipeline() as p:
                for job_id in gone[i:i + 100]:
                    p.delete(*names.job_keys(job_id))
                    p.zrem(names.JOBS_KEY, job_id)
                    p.srem(names.ACTIVE_JOBS_KEY, job_id)
                    p.srem(names.PLANNING_JOBS_KEY, job_id)
                p.execute()
    return gone


# ---- plans: a job is planned once, by one planner; a plan message older than the job's current one is dropped


def plan_sent(r: redis.Redis, job_id: str, token: str) -> None:
    """A plan message with `token` was sent for the job: it is the current one, and the job awaits its plan."""
    with r.pipeline() as p:
        p.hset(names.job_plan_key(job_id), mapping={"token": token, "sent_at": repr(time.time())})
        p.sadd(names.PLANNING_JOBS_KEY, job_id)
        p.execute()


def plan_current(r: redis.Redis, job_id: str, token: str | None) -> bool:
    """Is a plan message with `token` the job's current one? (A message without a token, or a job without
    one, is: what older clients sent.)"""
    cur = r.hget(names.job_plan_key(job_id), "token")
    return token is None or cur is None or _s(cur) == token


_RESEND_PLAN = _script("""
if redis.call('EXISTS', KEYS[2]) == 1 then return 0 end
local sent = tonumber(redis.call('HGET', KEYS[1], 'sent_at') or '0')
if tonumber(ARGV[2]) - sent < tonumber(ARGV[3]) then return 0 end
redis.call('HSET', KEYS[1], 'token', ARGV[1], 'sent_at', ARGV[2])
return 1
""")


def replace_stranded_plan(r: redis.Redis, job_id: str, token: str, now: float, stranded_s: float) -> bool:
    """Atomically: when no planner holds the job and its plan message was sent over `stranded_s` ago, make
    `token` the current plan (the caller sends it; the old message, should it come back, is dropped)."""
    return bool(_RESEND_PLAN(keys=[names.job_plan_key(job_id), names.plan_lease_key(job_id)],
                             args=[token, repr(now), repr(stranded_s)], client=r))


def take_plan_lease(r: redis.Redis, job_id: str, who: str, ttl_s: int = names.PLAN_LEASE_TTL_S) -> bool:
    return bool(_TAKE(keys=[names.plan_lease_key(job_id)], args=[who, int(ttl_s)], client=r))


def renew_plan_lease(r: redis.Redis, job_id: str, who: str, ttl_s: int = names.PLAN_LEASE_TTL_S) -> bool:
    return bool(_RENEW(keys=[names.plan_lease_key(job_id)], args=[who, int(ttl_s)], client=r))


def release_plan_lease(r: redis.Redis, job_id: str, who: str) -> None:
    _RELEASE(keys=[names.plan_lease_key(job_id)], args=[who], client=r)


def planning_jobs(r: redis.Redis) -> list[str]:
    return [_s(j) for j in r.smembers(names.PLANNING_JOBS_KEY)]


def planned(r: redis.Redis, job_id: str) -> None:
    """The job needs no plan any more (planned, failed or cancelled)."""
    r.srem(names.PLANNING_JOBS_KEY, job_id)


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
_SET_STATE = _script("""
if redis.call('HGET', KEYS[1], 'state') == 'cancelled' then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV))
return 1
""")


def set_state(r: redis.Redis, job_id: str, state: str, error: str | None = None, **extra) -> bool:
    """Move a job to `state` (and stamp `<state>_at`, for ETAs and reports); False if it was cancelled.
    `extra` are other fields of the job (JobHash), validated before anything is written. A job that ends
    (done, failed) lets its transient state go (names.job_transient_keys)."""
    now = time.time()
    mapping = JobHash.dump_fields(**{"state": state, "updated_at": now, f"{state}_at": now, "error": error, **extra})
    args = [x for kv in mapping.items() for x in kv]
    moved = bool(_SET_STATE(keys=[names.job_key(job_id)], args=args, client=r))
    if moved and state in FINAL_STATES:
        expire_transient(r, job_id)
    return moved


# EXPIRE ... LT, which Redis 6 lacks: a key without a TTL gets this one, one set to go sooner keeps its own
_EXPIRE_LT = _script("""
for _, key in ipairs(KEYS) do
  local ttl = redis.call('PTTL', key)
  if ttl == -1 or ttl > tonumber(ARGV[1]) then redis.call('PEXPIRE', key, ARGV[1]) end
end
return 1
""")


def expire_transient(r: redis.Redis, job_id: str, ttl_s: int = names.ENDED_JOB_STATE_TTL_S) -> None:
    """An ended job's model, plan, budget... expire in `ttl_s` (sooner if already set to)."""
    _EXPIRE_LT(keys=names.job_transient_keys(job_id), args=[int(ttl_s * 1000)], client=r)


_FINAL_LUA = " or ".join(f"state == '{s}'" for s in FINAL_STATES)
_CANCEL = _script(f"""
local state = redis.call('HGET', KEYS[1], 'state')
if not state then return false end
if {_FINAL_LUA} then return state end
redis.call('SET', KEYS[2], ARGV[1])
redis.call('HSET', KEYS[1], 'state', 'cancelled', 'updated_at', ARGV[1], 'cancelled_at', ARGV[1])
return 'cancelled'
""")


def cancel_job(r: redis.Redis, job_id: str) -> str:
    """Ask a job to stop: the tuner leaves the search after the current round, lanes skip its batches.
    Returns the state the job is in afterwards (a finished job stays done or failed). Atomic, so a
    job that finishes at the same moment is either done or cancelled, never both."""
    state = _CANCEL(keys=[names.job_key(job_id), names.job_cancel_key(job_id)], args=[repr(time.time())], client=r)
    if state is None:
        raise JobError(f"no job {job_id!r} in the store")
    if _s(state) == "cancelled":
        expire_transient(r, job_id)
    return _s(state)


def job_cancelled(r: redis.Redis, job_id: str) -> bool:
    return bool(r.exists(names.job_cancel_key(job_id)))


def jobs(r: redis.Redis, limit: int = 50) -> list[str]:
    """Newest first."""
    return [_s(j) for j in r.zrevrange(names.JOBS_KEY, 0, limit - 1)]


def job_hash(r: redis.Redis, job_id: str) -> JobHash:
    """The job's hash, typed."""
    raw = r.hgetall(names.job_key(job_id))
    if not raw:
        raise JobError(f"no job {job_id!r} in the store")
    return JobHash.from_redis(raw)


def job_status(r: redis.Redis, job_id: str) -> str:
    """Only the job's state (one field: the tuner checks it every round, the reaper every pass)."""
    state = r.hget(names.job_key(job_id), "state")
    if state is None:
        raise JobError(f"no job {job_id!r} in the store")
    return _s(state)


def job_state(r: redis.Redis, job_id: str) -> dict[str, str]:
    """The job's hash as the store keeps it (field -> string): the client's plain view of a job."""
    return job_hash(r, job_id).to_redis()


def update_job(r: redis.Redis, job_id: str, **fields) -> None:
    """Write some fields of a job (JobHash's, validated); None leaves a field as it is."""
    mapping = JobHash.dump_fields(**fields)
    if mapping:
        r.hset(names.job_key(job_id), mapping=mapping)


def clear_job_fields(r: redis.Redis, job_id: str, *fields: str) -> None:
    JobHash.dump_fields(**{f: None for f in fields})  # only fields a job has
    r.hdel(names.job_key(job_id), *fields)


def parked_since(r: redis.Redis, job_id: str) -> float:
    """When the planner first parked the job (stamped now if this is the first time)."""
    with r.pipeline() as p:
        p.hsetnx(names.job_key(job_id), "parked_at", repr(time.time()))
        p.hget(names.job_key(job_id), "parked_at")
        _, at = p.execute()
    return float(at)


def active_jobs(r: redis.Redis) -> list[str]:
    """The jobs whose shards may be searched (the reaper's list)."""
    return [_s(j) for j in r.smembers(names.ACTIVE_JOBS_KEY)]


def deactivate_job(r: redis.Redis, job_id: str) -> None:
    r.srem(names.ACTIVE_JOBS_KEY, job_id)


def claim_finish(r: redis.Redis, job_id: str, who: str, ttl_s: int = 900) -> bool:
    """Exactly one process sends a job's finishing step (until the guard lapses, for a finish that died)."""
    return bool(r.set(names.job_finish_key(job_id), who, nx=True, ex=ttl_s))


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


# ---- the job-wide budget ---------------------------------------------------------------------------------

# Claim up to ARGV[1] trials from the job's budget for shard ARGV[2]; returns how many were granted.
# Atomic, so concurrent clients never overspend; the claim stays on the shard until its records land.
_CLAIM = _script("""
local left = tonumber(redis.call('GET', KEYS[1]) or '0')
local want = tonumber(ARGV[1])
local k = math.min(left, want)
if k > 0 then
  redis.call('DECRBY', KEYS[1], k)
  redis.call('HINCRBY', KEYS[2], ARGV[2], k)
end
return k
""")

# Hand back what a shard claimed but never recorded (its client died); returns the amount.
_REFUND = _script("""
local k = tonumber(redis.call('HGET', KEYS[2], ARGV[1]) or '0')
if k > 0 then
  redis.call('INCRBY', KEYS[1], k)
  redis.call('HSET', KEYS[2], ARGV[1], 0)
end
return k
""")


def budget_left(r: redis.Redis, job_id: str) -> int:
    return int(r.get(names.job_budget_key(job_id)) or 0)


def claim_trials(r: redis.Redis, job_id: str, shard: int, want: int) -> int:
    return int(_CLAIM(keys=[names.job_budget_key(job_id), names.job_claims_key(job_id)], args=[int(want), str(shard)],
                      client=r))


def settle_claim(r: redis.Redis, job_id: str, shard: int, recorded: int) -> None:
    """Trials of a shard's claim whose records are now in the store are spent for good (r may be a pipeline)."""
    r.hincrby(names.job_claims_key(job_id), str(shard), -int(recorded))


def refund_claim(r: redis.Redis, job_id: str, shard: int) -> int:
    return int(_REFUND(keys=[names.job_budget_key(job_id), names.job_claims_key(job_id)], args=[str(shard)], client=r))


def trial_accounting(r: redis.Redis, job_id: str) -> dict[str, int]:
    """The job's trials as the store knows them: `claimed` from its budget (refunds handed back),
    `outstanding` claimed by a round not yet recorded, `recorded` its records (results and errors), and
    `lost`: claimed, settled, yet without a record. A finished job has lost == outstanding == 0."""
    claimed = job_spec(r, job_id).trials - budget_left(r, job_id)
    outstanding = sum(max(0, int(v)) for v in r.hvals(names.job_claims_key(job_id)))
    recorded = sum(1 for t in job_tasks(r, job_id) for rec in records(r, t.wkey) if rec.job_id == job_id)
    return {"claimed": claimed, "outstanding": outstanding, "recorded": recorded,
            "lost": max(0, claimed - outstanding - recorded)}


# ---- leases, claims and gates: held by one owner, renewed and released by that owner only -------------------

# Take a key if it is free or already ours (a redelivered message of the same owner); 1 when held now.
_TAKE = _script("""
local cur = redis.call('GET', KEYS[1])
if cur and cur ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
return 1
""")

# Renew only while we hold it; 0 means it is lost (expired, perhaps taken by another owner).
_RENEW = _script("""
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('EXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
""")

# Delete only our own: one that expired and was taken by another owner stays theirs.
_RELEASE = _script("""
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
""")


def take_lease(r: redis.Redis, job_id: str, shard: int, owner: str, ttl_s: int = names.LEASE_TTL_S) -> bool:
    return bool(_TAKE(keys=[names.shard_lease_key(job_id, shard)], args=[owner, int(ttl_s)], client=r))


def renew_lease(r: redis.Redis, job_id: str, shard: int, owner: str, ttl_s: int = names.LEASE_TTL_S) -> bool:
    return bool(_RENEW(keys=[names.shard_lease_key(job_id, shard)], args=[owner, int(ttl_s)], client=r))


def lease_owner(r: redis.Redis, job_id: str, shard: int) -> str | None:
    return _s(r.get(names.shard_lease_key(job_id, shard)))


def release_lease(r: redis.Redis, job_id: str, shard: int, owner: str) -> bool:
    """True when it was ours and is released; a lease another owner holds now is left alone."""
    return bool(_RELEASE(keys=[names.shard_lease_key(job_id, shard)], args=[owner], client=r))


def claim_slot(r: redis.Redis, scope: str, slots: int, worker: str, ttl_s: int = names.LANE_TTL_S) -> int | None:
    """Claim the first free slot of a lane pool for `worker` (atomic per slot); None when all are taken.
    The claim lives while its owner refreshes it (the lane's heartbeat)."""
    for i in range(slots):
        if r.set(names.lane_claim_key(scope, i), worker, nx=True, ex=ttl_s):
            return i
    return None


def refresh_claim(r: redis.Redis, claim_key: str, worker: str, ttl_s: int = names.LANE_TTL_S) -> bool:
    """Keep a lane-pool claim (taken again if it lapsed and is still free); False when another replica
    holds it now, which is then left alone."""
    return bool(_TAKE(keys=[claim_key], args=[worker, int(ttl_s)], client=r))


def release_claim(r: redis.Redis, claim_key: str, worker: str) -> bool:
    return bool(_RELEASE(keys=[claim_key], args=[worker], client=r))


# A GPU's gate (isolation.GpuGate): a hash {holder, until}. Taken only if free or lapsed (its deadline lets a
# dead holder's gate go); the key's TTL follows the deadline.
_GATE_TAKE = _script("""
local now = tonumber(ARGV[2])
local holder = redis.call('HGET', KEYS[1], 'holder')
local until_ = tonumber(redis.call('HGET', KEYS[1], 'until') or '0')
if holder and holder ~= ARGV[1] and until_ > now then return 0 end
redis.call('HSET', KEYS[1], 'holder', ARGV[1], 'until', ARGV[3])
redis.call('EXPIRE', KEYS[1], math.ceil(tonumber(ARGV[3]) - now) + 1)
return 1
""")

_GATE_RELEASE = _script("""
if redis.call('HGET', KEYS[1], 'holder') == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
""")


def take_gpu_gate(r: redis.Redis, gpu8: str, worker: str, now: float, until: float) -> bool:
    return bool(_GATE_TAKE(keys=[names.gpu_gate_key(gpu8)], args=[worker, repr(now), repr(until)], client=r))


def release_gpu_gate(r: redis.Redis, gpu8: str, worker: str) -> bool:
    """True when the gate was ours and is released; a gate that lapsed and was taken by another stays."""
    return bool(_GATE_RELEASE(keys=[names.gpu_gate_key(gpu8)], args=[worker], client=r))


def enter_gpu_running(r: redis.Redis, gpu8: str, worker: str, until: float) -> tuple[str | None, float]:
    """Announce a candidate running on the GPU, then read its gate, in this order and one round trip;
    returns the gate's (holder, deadline)."""
    with r.pipeline(transaction=False) as p:
        p.hset(names.gpu_running_key(gpu8), worker, repr(until))
        p.hmget(names.gpu_gate_key(gpu8), "holder", "until")
        _, (holder, deadline) = p.execute()
    return _s(holder), float(deadline or 0)


def set_gpu_running(r: redis.Redis, gpu8: str, worker: str, until: float) -> None:
    r.hset(names.gpu_running_key(gpu8), worker, repr(until))


def leave_gpu_running(r: redis.Redis, gpu8: str, worker: str) -> None:
    r.hdel(names.gpu_running_key(gpu8), worker)


def clear_gpu_isolation(r: redis.Redis, gpu8: str) -> None:
    """Every lane of the GPU was ended (a recovery): no gate holder or running candidate of theirs stands,
    so a suspect of the restarted lanes never waits out a dead lane's deadline."""
    r.delete(names.gpu_gate_key(gpu8), names.gpu_running_key(gpu8))


def count_suspect_run(r: redis.Redis, gpu8: str, chash: str) -> None:
    r.hincrby(names.suspect_runs_key(gpu8), chash, 1)


def suspect_runs(r: redis.Redis, gpu8: str) -> dict[str, int]:
    """candidate hash -> times it ran alone on the GPU as a suspect."""
    return {_s(k): int(v) for k, v in r.hgetall(names.suspect_runs_key(gpu8)).items()}


def gpu_running(r: redis.Redis, gpu8: str) -> dict[str, float]:
    """worker -> deadline of every lane announcing a candidate on the GPU (lapsed entries included)."""
    return {_s(w): float(u) for w, u in r.hgetall(names.gpu_running_key(gpu8)).items()}


# ---- shards --------------------------------------------------------------------------------------------------

# Compare-and-set one shard's state: written only if it is still what the writer read (ARGV[2]; '' = absent),
# and, with an owner (ARGV[4]), only while that owner holds the shard's lease; ARGV[5] = '1' releases the
# lease in the same step. 1 written, 0 the shard changed meanwhile, -1 the lease is not ours.
_CAS_SHARD = _script("""
if ARGV[4] ~= '' and redis.call('GET', KEYS[2]) ~= ARGV[4] then return -1 end
local cur = redis.call('HGET', KEYS[1], ARGV[1])
if (cur or '') ~= ARGV[2] then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
if ARGV[5] == '1' then redis.call('DEL', KEYS[2]) end
return 1
""")


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


def update_shard(r: redis.Redis, job_id: str, shard: int, change: Callable[[ShardState], bool | None],
                 owner: str | None = None, release: bool = False, attempts: int = 5) -> ShardState | None:
    """Read a shard, let `change` modify it (returning False: leave it), and write it back only if nobody
    wrote it meanwhile (compare-and-set), so the reaper and a client never overwrite each other's newer
    state; on such a conflict `change` runs again on the newer state, up to `attempts` times. With `owner`,
    only while that owner holds the shard's lease (`release`: and the lease is released with the write).
    Returns the state written, or None: declined, the lease is not the owner's, or every attempt lost."""
    key, lease = names.job_shards_key(job_id), names.shard_lease_key(job_id, shard)
    for _ in range(attempts):
        raw = r.hget(key, str(shard))
        if raw is None:
            return None
        sh = ShardState.parse(raw)
        if change(sh) is False:
            return None
        got = _CAS_SHARD(keys=[key, lease], args=[str(shard), raw, sh.model_dump_json(), owner or "",
                                                  "1" if release else "0"], client=r)
        if got == 1:
            return sh
        if got == -1:
            return None
    return None


def finish_shard(r: redis.Redis, job_id: str, shard: int, owner: str) -> bool:
    """Mark a shard done and release its lease, atomically, only while `owner` still holds the lease
    (a client that lost it was replaced: the replacement's state stands). True when done by us."""
    def done(sh: ShardState) -> None:
        sh.state, sh.finished_at = "done", time.time()

    return update_shard(r, job_id, shard, done, owner=owner, release=True) is not None


def claim_requeue(r: redis.Redis, job_id: str, shard: int) -> bool:
    """One reaper re-sends a shard (for a lease's time)."""
    return bool(r.set(names.shard_requeue_key(job_id, shard), "1", nx=True, ex=names.LEASE_TTL_S))


# ---- a job's per-task history and per-shard time split ------------------------------------------------------


def push_history(r: redis.Redis, job_id: str, task_id: str, best_s: float) -> None:
    """Append a task's best latency after one of its rounds (one writer per task: its shard's client)."""
    key = names.job_history_key(job_id)
    hist = json.loads(_s(r.hget(key, task_id)) or "[]")
    hist.append(float(best_s))
    r.hset(key, task_id, json.dumps(hist))


def history(r: redis.Redis, job_id: str) -> dict[str, list[float]]:
    return {_s(k): json.loads(_s(v)) for k, v in r.hgetall(names.job_history_key(job_id)).items()}


def put_split(r: redis.Redis, job_id: str, shard: int, times: dict) -> None:
    """A shard's time split (search, build, run, ...), summed over shards in the job's result."""
    r.hset(names.job_splits_key(job_id), str(shard), json.dumps(times))


def splits(r: redis.Redis, job_id: str) -> list[dict]:
    return [json.loads(v) for v in r.hvals(names.job_splits_key(job_id))]


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
_PUT_RECORD = _script("""
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
""")


def put_record(r: redis.Redis, rec: Record) -> bool:
    """Idempotent: the candidate key is a hash of workload + trace, so a re-measured candidate keeps
    its first valid record. True when the record was written (on a pipeline: queued, returns False)."""
    return bool(_PUT_RECORD(keys=[names.records_key(rec.wkey)],
                            args=[rec.candidate_key, rec.model_dump_json(), "1" if valid_record(rec) else "0"], client=r))


def record_round(r: redis.Redis, job_id: str, shard: int, recs: list[Record], prog: TaskProgress, claimed: int) -> None:
    """One round of a shard in one transaction: its records, its task's progress and the settling of the
    shard's trial claim, so a client that dies mid-round leaves all of the round in the store or none."""
    with r.pipeline(transaction=True) as p:
        for rec in recs:
            put_record(p, rec)
        put_progress(p, job_id, prog)
        settle_claim(p, job_id, shard, claimed)
        p.execute()


def replace_record(r: redis.Redis, rec: Record) -> None:
    """Overwrite a record in place (re-timing adds figures; it never removes a record)."""
    r.hset(names.records_key(rec.wkey), rec.candidate_key, rec.model_dump_json())


def records(r: redis.Redis, wkey: str) -> list[Record]:
    return [Record.parse(v) for v in r.hvals(names.records_key(wkey))]


def record_count(r: redis.Redis, wkey: str) -> int:
    """The valid records of a workload: what a new job reuses (error records are measured again)."""
    return sum(1 for rec in records(r, wkey) if valid_record(rec))


def put_default(r: redis.Redis, timing: DefaultTiming) -> None:
    """A workload's default-schedule timing; a valid one is kept (a later failure never replaces it)."""
    old = default_timing(r, timing.wkey)
    if old is None or not old.run_secs:
        r.set(names.default_key(timing.wkey), timing.model_dump_json())


def default_timing(r: redis.Redis, wkey: str) -> DefaultTiming | None:
    return default_timings(r, [wkey])[wkey]


def default_timings(r: redis.Redis, wkeys: list[str]) -> dict[str, DefaultTiming | None]:
    """Each workload's default-schedule timing, in one round trip."""
    raws = r.mget([names.default_key(w) for w in wkeys]) if wkeys else []
    return {w: DefaultTiming.parse(raw) if raw else None for w, raw in zip(wkeys, raws)}


def known_records(r: redis.Redis, wkey: str, keys: list[str]) -> dict[str, Record]:
    """The valid records the store holds for these candidate keys; an error record is not an answer."""
    if not keys:
        return {}
    raw = r.hmget(names.records_key(wkey), keys)
    found = {k: Record.parse(v) for k, v in zip(keys, raw) if v is not None}
    return {k: rec for k, rec in found.items() if valid_record(rec)}


# ---- lanes, builders and tuner clients (liveness keys), queues ------------------------------------------------


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


def lane_worker_alive(r: redis.Redis, queue: str, worker: str) -> bool:
    """True while this worker of the lane keeps its liveness key."""
    return bool(r.exists(names.lane_key(queue, worker)))


def builder_alive(r: redis.Redis, alive_key: str) -> bool:
    """True while the builder whose liveness key this is keeps it (names.builder_key)."""
    return bool(r.exists(alive_key))


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


def announce_tuner(r: redis.Redis, worker: str) -> None:
    r.set(names.tuner_key(worker), "ready", ex=names.LANE_TTL_S)


def retire_tuner(r: redis.Redis, worker: str) -> None:
    r.delete(names.tuner_key(worker))


def live_tuners(r: redis.Redis) -> int:
    """How many tuner clients keep their liveness key."""
    return sum(1 for _ in r.scan_iter(match=names.TUNERS_PATTERN, count=500))


def queue_length(r: redis.Redis, queue: str) -> int:
    """Messages waiting in a Celery queue (its Redis list), not counting those a worker has taken."""
    return int(r.llen(queue))


# ---- measurement results -----------------------------------------------------------------------------


def mark_batch_started(r: redis.Redis, batch_id: str, lane: str, worker: str | None = None,
                       job_id: str = "", candidates: int = 0) -> None:
    key = names.batch_results_key(batch_id)
    started = {"at": time.time(), "lane": lane, "worker": worker, "job_id": job_id, "candidates": candidates}
    with r.pipeline() as p:
        p.hset(key, "_started", json.dumps(started))
        p.expire(key, RESULT_TTL_S)
        p.execute()


def put_result(r: redis.Redis, batch_id: str, res: MeasureResult) -> bool:
    """The first answer of a candidate in a batch stands (a lane's and its watchdog's, say, never both):
    True when this one was written."""
    key = names.batch_results_key(batch_id)
    with r.pipeline() as p:
        p.hsetnx(key, res.candidate_id, res.model_dump_json())
        p.expire(key, RESULT_TTL_S)
        written, _ = p.execute()
    return bool(written)


def batch_results(r: redis.Redis, batch_id: str) -> tuple[dict | None, dict[str, MeasureResult]]:
    started, _, out = batch_progress(r, batch_id)
    return started, out


def batch_started(r: redis.Redis, batch_id: str) -> dict | None:
    """Who started the batch and when (mark_batch_started), None before a lane has."""
    raw = r.hget(names.batch_results_key(batch_id), "_started")
    return json.loads(raw) if raw else None


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
    with r.pipeline() as p:
        p.rpush(names.DEADLETTER_KEY, entry)
        p.ltrim(names.DEADLETTER_KEY, -DEADLETTER_KEEP, -1)  # the newest: a flood of junk cannot fill the store
        p.execute()


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
            update_job(r, job_id, gpu_error=error, updated_at=time.time())
            hit.append(job_id)
    return sorted(hit)


def gpus_down(r: redis.Redis) -> dict[str, dict]:
    """gpu8 -> {gpu8, error, lanes, at} for every GPU the supervisor gave up."""
    return {_s(k): json.loads(v) for k, v in r.hgetall(names.GPUS_DOWN_KEY).items()}




def _lane_gpu(queue: str) -> str | None:
    return lanes.fault_domain(queue)  # here, where give_up_gpu's argument `lanes` hides the module


# ---- cost models ---------------------------------------------------------------------------------------------


def push_training_rows(r: redis.Redis, target_key: str, rows: list[TrainingRow], keep: int | None = None) -> None:
    """Append rows; with `keep`, only the newest `keep` rows of the family stay."""
    if rows:
        key = names.training_rows_key(target_key)
        with r.pipeline() as p:
            p.rpush(key, *[row.model_dump_json() for row in rows])
            if keep is not None:
                p.ltrim(key, -keep, -1)
            p.execute()


def training_row_count(r: redis.Redis, target_key: str) -> int:
    return int(r.llen(names.training_rows_key(target_key)))


def newest_training_rows(r: redis.Redis, target_key: str, n: int) -> list[TrainingRow]:
    return [TrainingRow.model_validate_json(raw) for raw in r.lrange(names.training_rows_key(target_key), -n, -1)]


def best_rows(r: redis.Redis, target_key: str, group: str) -> list[TrainingRow]:
    """A workload group's kept fastest rows, fastest first."""
    raw = r.hget(names.training_best_key(target_key), group)
    return [TrainingRow.model_validate(d) for d in json.loads(raw)] if raw else []


def put_best_rows(r: redis.Redis, target_key: str, group: str, rows: list[TrainingRow]) -> None:
    r.hset(names.training_best_key(target_key), group, json.dumps([row.model_dump() for row in rows]))


def best_rows_of(r: redis.Redis, target_key: str, groups: list[str]) -> dict[str, list[TrainingRow]]:
    """The kept fastest rows of these workload groups only (one read, however many groups the store has)."""
    if not groups:
        return {}
    raws = r.hmget(names.training_best_key(target_key), groups)
    return {g: [TrainingRow.model_validate(d) for d in json.loads(raw)] for g, raw in zip(groups, raws) if raw}


def next_snapshot_version(r: redis.Redis, target_key: str) -> int:
    return int(r.incr(names.snapshot_version_key(target_key)))


def put_snapshot(r: redis.Redis, snap: CostModelSnapshot) -> None:
    r.hset(names.snapshot_key(snap.target_key), mapping={"version": snap.version, "snapshot": snap.model_dump_json()})


def snapshot_version(r: redis.Redis, target_key: str) -> int:
    """The newest published version (0: none yet); cheap, for a client polling for a new model."""
    v = r.hget(names.snapshot_key(target_key), "version")
    return int(v) if v else 0


def snapshot(r: redis.Redis, target_key: str) -> CostModelSnapshot | None:
    raw = r.hget(names.snapshot_key(target_key), "snapshot")
    return CostModelSnapshot.parse(raw) if raw else None

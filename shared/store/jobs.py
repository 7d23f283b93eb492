"""Jobs: a job's spec and model, its state and typed hash, its plan (leased by one planner), its tasks and
progress, its job-wide trial budget, gradient history and time split; retention (expiry when it ends, prune)."""
from __future__ import annotations

import json
import time
from typing import cast

import redis

from shared import names, timeouts
from shared.errors import JobError, StoreFullError
from shared.messages import FINAL_STATES, JobHash, JobResult, JobSpec, JobState, JobTask, TaskProgress
from shared.store._redis import _s, _script
from shared.store.leases import _RELEASE, _RENEW, _TAKE


# ---- jobs --------------------------------------------------------------------------------------------


def create_job(r: redis.Redis, spec: JobSpec, model_blob: bytes) -> None:
    """Store a new job; StoreFullError (nothing written) when Redis is at its maxmemory."""
    try:
        with r.pipeline() as p:  # MULTI/EXEC: a store that is full refuses all of it
            p.set(names.job_model_key(spec.job_id), model_blob)
            p.hset(names.job_key(spec.job_id),
                   mapping=JobHash.dump_fields(spec=spec, state=JobState.QUEUED, updated_at=time.time()))
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
    """Redis's memory: used and max bytes (0: no limit), the data's share of it (used less the server's
    overhead: client buffers, the AOF buffer, replication), and how many keys it holds."""
    info = r.info("memory")
    return {"used_bytes": int(info.get("used_memory", 0)), "max_bytes": int(info.get("maxmemory", 0)),
            "dataset_bytes": int(info.get("used_memory_dataset", info.get("used_memory", 0))),
            "keys": int(r.dbsize())}


def prune_jobs(r: redis.Redis, older_than_s: float, now: float | None = None, dry_run: bool = False) -> list[str]:
    """Delete every key of each job that ended (done, failed, cancelled) more than `older_than_s` ago, or
    whose status is gone, and the results of the batches its lanes logged (already records); the workloads'
    records and defaults stay (the tuning knowledge: exports and later jobs reuse them). Returns the job ids
    pruned (would be, with `dry_run`)."""
    cutoff = (time.time() if now is None else now) - older_than_s
    gone = []
    for raw in cast(list[bytes], r.zrange(names.JOBS_KEY, 0, -1)):
        job_id = _s(raw)
        state, updated = (_s(v) for v in r.hmget(names.job_key(job_id), "state", "updated_at"))
        ended_at = float(updated) if updated else 0.0
        if state is None or (state in FINAL_STATES and ended_at < cutoff):
            gone.append(job_id)
    if not dry_run:
        for i in range(0, len(gone), 100):
            with r.pipeline() as p:
                for job_id in gone[i:i + 100]:
                    p.delete(*_prunable_keys(r, job_id))
                    p.zrem(names.JOBS_KEY, job_id)
                    p.srem(names.ACTIVE_JOBS_KEY, job_id)
                    p.srem(names.PLANNING_JOBS_KEY, job_id)
                p.execute()
    return gone


def _prunable_keys(r: redis.Redis, job_id: str) -> list[str]:
    batches = {json.loads(raw)["batch_id"] for raw in r.lrange(names.job_batches_key(job_id), 0, -1)}
    return names.job_keys(job_id) + [names.batch_results_key(b) for b in sorted(batches)]


def job_bytes(r: redis.Redis, job_ids: list[str]) -> int:
    """What pruning these jobs would free: Redis's own MEMORY USAGE of every key `prune_jobs` deletes."""
    total = 0
    for job_id in job_ids:
        keys = _prunable_keys(r, job_id)
        with r.pipeline() as p:
            for key in keys:
                p.memory_usage(key, samples=0)
            total += sum(int(n or 0) for n in p.execute())
    return total


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


def take_plan_lease(r: redis.Redis, job_id: str, who: str, ttl_s: int = timeouts.PLAN_LEASE_TTL_S) -> bool:
    return bool(_TAKE(keys=[names.plan_lease_key(job_id)], args=[who, int(ttl_s)], client=r))


def renew_plan_lease(r: redis.Redis, job_id: str, who: str, ttl_s: int = timeouts.PLAN_LEASE_TTL_S) -> bool:
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
    return cast(bytes, blob)


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


def expire_transient(r: redis.Redis, job_id: str, ttl_s: int = timeouts.ENDED_JOB_STATE_TTL_S) -> None:
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
    if _s(state) == JobState.CANCELLED:
        expire_transient(r, job_id)
    return _s(state)


def job_cancelled(r: redis.Redis, job_id: str) -> bool:
    return bool(r.exists(names.job_cancel_key(job_id)))


def jobs(r: redis.Redis, limit: int = 50) -> list[str]:
    """Newest first."""
    return [_s(j) for j in cast(list[bytes], r.zrevrange(names.JOBS_KEY, 0, limit - 1))]


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


def decide_ranked_first_rounds(r: redis.Redis, job_id: str, ranked: bool) -> bool:
    """Whether the central cost model ranks the job's first rounds, decided once: the first caller's `ranked` is
    kept (a client resumed after a crash, or one starting after the model was trained, reads the same)."""
    r.hsetnx(names.job_key(job_id), "ranked_first_rounds", JobHash.dump_fields(ranked_first_rounds=ranked)[
        "ranked_first_rounds"])
    return bool(job_hash(r, job_id).ranked_first_rounds)


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


def _per_running_job(r: redis.Redis, read) -> tuple[dict, float]:
    """({job: its reply to `read(pipeline, job_id)`} of the active jobs not yet in a final state, Redis's clock), in
    one round trip."""
    jobs = active_jobs(r)
    with r.pipeline(transaction=False) as p:
        for job_id in jobs:
            p.hget(names.job_key(job_id), "state")
            read(p, job_id)
        p.time()
        replies = p.execute()
    secs, micros = replies[-1]
    return {job_id: reply for job_id, state, reply in zip(jobs, replies[0:-1:2], replies[1:-1:2])
            if state is not None and _s(state) not in FINAL_STATES}, secs + micros / 1e6


def in_flight_by_job(r: redis.Redis) -> dict[str, int]:
    """The trials each running job has claimed and not yet recorded (its candidates being built or timed), by
    job: the active jobs not yet in a final state, a job with nothing in flight at 0."""
    claims, _ = _per_running_job(r, lambda p, job_id: p.hvals(names.job_claims_key(job_id)))
    return {job_id: sum(max(0, int(v)) for v in vals) for job_id, vals in claims.items()}


def measured_by_job(r: redis.Redis) -> dict[str, float]:
    """The trials of each running job measured and recorded lately, each halved every
    timeouts.MEASURED_HALF_LIFE_S (count_measured), by job, as in_flight_by_job: each job's recent share of the
    measurements, which only being measured raises (a job's rounds waiting in the queues do not), and in which a
    job submitted late is owed the last minute or so, not everything the others had."""
    counts, now = _per_running_job(r, lambda p, job_id: p.hmget(names.job_measured_recently_key(job_id), "v", "t"))
    return {job_id: float(v) * 0.5 ** (max(0.0, now - float(t)) / timeouts.MEASURED_HALF_LIFE_S) if v is not None
            else 0.0 for job_id, (v, t) in counts.items()}


# Add ARGV[1] to a decayed count (KEYS[1]: v as of t, halved every ARGV[2] seconds), on the server's clock.
_DECAYED_ADD = _script("""
local now = redis.call('TIME')
local t = tonumber(now[1]) + tonumber(now[2]) / 1000000
local v = tonumber(redis.call('HGET', KEYS[1], 'v') or '0')
local t0 = tonumber(redis.call('HGET', KEYS[1], 't') or tostring(t))
v = v * math.pow(0.5, math.max(0, t - t0) / tonumber(ARGV[2])) + tonumber(ARGV[1])
redis.call('HSET', KEYS[1], 'v', tostring(v), 't', tostring(t))
return tostring(v)
""")


def count_measured(r: redis.Redis, job_id: str, trials: int) -> None:
    """Add a round's recorded trials to the job's recent measurements (measured_by_job); r may be a pipeline."""
    _DECAYED_ADD(keys=[names.job_measured_recently_key(job_id)], args=[int(trials), timeouts.MEASURED_HALF_LIFE_S],
                 client=r)


def fair_loads(r: redis.Redis, measure: str) -> dict[str, float]:
    """What the running jobs' fair shares are counted in (TunerSettings.fair_measure): "measured"
    (measured_by_job) or "in_flight" (in_flight_by_job)."""
    return measured_by_job(r) if measure == "measured" else {j: float(n) for j, n in in_flight_by_job(r).items()}


def deactivate_job(r: redis.Redis, job_id: str) -> None:
    r.srem(names.ACTIVE_JOBS_KEY, job_id)


def claim_finish(r: redis.Redis, job_id: str, who: str, ttl_s: int = timeouts.FINISH_QUEUED_S) -> bool:
    """Exactly one process sends a job's finishing step (until the guard lapses, for a finish that died)."""
    return bool(r.set(names.job_finish_key(job_id), who, nx=True, ex=ttl_s))


# A finishing step sent (its guard still the send's: longer-lived than a running client's hold) that has waited
# past ARGV[3] ms is sent again by the caller: the guard is taken anew, so one caller does it, once a wait.
_RECLAIM_FINISH = _script("""
local left = redis.call('PTTL', KEYS[1])
if left <= tonumber(ARGV[4]) or tonumber(ARGV[2]) * 1000 - left < tonumber(ARGV[3]) then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
return 1
""")


def reclaim_stranded_finish(r: redis.Redis, job_id: str, who: str, after_s: float = timeouts.STRANDED_AFTER_S) -> bool:
    """A finishing step sent over `after_s` ago that no client has started (the guard is still the send's, not a
    client's hold) is claimed again, for the caller to send again. The caller knows it waits in no queue: a
    worker that took its message and was killed before it started leaves it unacknowledged for Redis's
    visibility timeout (an hour), and its guard would hold the job for FINISH_QUEUED_S."""
    return bool(_RECLAIM_FINISH(keys=[names.job_finish_key(job_id)],
                                args=[who, timeouts.FINISH_QUEUED_S, int(after_s * 1000),
                                      int(timeouts.FINISH_LEASE_TTL_S * 1000)], client=r))


def hold_finish(r: redis.Redis, job_id: str, who: str, ttl_s: float = timeouts.FINISH_LEASE_TTL_S) -> None:
    """The client running a job's finishing step holds its guard, renewed while it runs, so that the guard
    lapses soon after the client dies (and the reaper sends the step again), not after FINISH_QUEUED_S."""
    r.set(names.job_finish_key(job_id), who, ex=max(1, int(ttl_s)))


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
# Atomic, so concurrent clients never overspend; the claim stays on the shard until its records land. ARGV[3],
# when not empty: the task whose first round this is, added to the job's first rounds claimed.
_CLAIM = _script("""
if redis.call('HEXISTS', KEYS[3], 'stopped') == 1 then return 0 end
local left = tonumber(redis.call('GET', KEYS[1]) or '0')
local want = tonumber(ARGV[1])
local k = math.min(left, want)
if k > 0 then
  redis.call('DECRBY', KEYS[1], k)
  redis.call('HINCRBY', KEYS[2], ARGV[2], k)
  if ARGV[3] ~= '' then redis.call('SADD', KEYS[4], ARGV[3]) end
end
return k
""")

# Hand back what a shard claimed but never recorded (its client died); returns the amount. A stopped search's
# refund is unspent, not budget again. ARGV[2..]: the shard's tasks; one with no round in the history (KEYS[5]) is
# owed its first round again (out of the first rounds claimed, KEYS[4]).
_REFUND = _script("""
local k = tonumber(redis.call('HGET', KEYS[2], ARGV[1]) or '0')
if k > 0 then
  if redis.call('HEXISTS', KEYS[3], 'stopped') == 1 then
    redis.call('HINCRBY', KEYS[3], 'stopped_unspent', k)
  else
    redis.call('INCRBY', KEYS[1], k)
  end
  redis.call('HSET', KEYS[2], ARGV[1], 0)
  for i = 2, #ARGV do
    if redis.call('HEXISTS', KEYS[5], ARGV[i]) == 0 then redis.call('SREM', KEYS[4], ARGV[i]) end
  end
end
return k
""")

# End the job's search before its budget (ARGV[1]: why, ARGV[2]: now): what is left of the budget becomes
# unspent, so every client's next claim gets nothing and its shard ends after the rounds in flight, as when the
# budget is spent. Once only; returns 1 when this call stopped it.
_STOP = _script("""
if redis.call('HEXISTS', KEYS[2], 'stopped') == 1 then return 0 end
local left = tonumber(redis.call('GET', KEYS[1]) or '0')
if left > 0 then redis.call('DECRBY', KEYS[1], left) end
redis.call('HSET', KEYS[2], 'stopped', ARGV[1], 'stopped_at', ARGV[2], 'stopped_unspent', left)
return 1
""")

# Patience's mark (ARGV: the estimate in seconds, the job's trials, the fraction that counts as a gain): moved to
# this estimate when there is none yet or it is below the mark by the gain (shared.stopping.StopRules.marked, done
# atomically for every client of the job); returns the mark as it stands.
_MARK = _script("""
local mark = tonumber(redis.call('HGET', KEYS[1], 'estimate_mark_s') or '')
local est, gain = tonumber(ARGV[1]), tonumber(ARGV[3])
if mark == nil or est < mark * (1 - gain) then
  redis.call('HSET', KEYS[1], 'estimate_mark_s', ARGV[1], 'estimate_mark_trials', ARGV[2])
  return {ARGV[1], ARGV[2]}
end
return {tostring(mark), redis.call('HGET', KEYS[1], 'estimate_mark_trials')}
""")


def budget_left(r: redis.Redis, job_id: str) -> int:
    return int(r.get(names.job_budget_key(job_id)) or 0)


def claim_trials(r: redis.Redis, job_id: str, shard: int, want: int, first_round_of: str | None = None) -> int:
    """Up to `want` trials of the job's budget for the shard's next batch (0 once it is spent or the search
    stopped); `first_round_of`: the task whose first round the batch is (first_rounds_claimed)."""
    keys = [names.job_budget_key(job_id), names.job_claims_key(job_id), names.job_key(job_id),
            names.job_first_rounds_key(job_id)]
    return int(_CLAIM(keys=keys, args=[int(want), str(shard), first_round_of or ""], client=r))


def first_rounds_claimed(r: redis.Redis, job_id: str) -> set[str]:
    """The tasks whose first round some client claimed trials for, measured or still in flight."""
    return {_s(t) for t in r.smembers(names.job_first_rounds_key(job_id))}


def stop_search(r: redis.Redis, job_id: str, reason: str) -> bool:
    """End the job's search before its budget is spent (a time limit, patience): no client claims another trial,
    the rounds in flight are measured and the job finishes as usual. True when this call stopped it."""
    return bool(_STOP(keys=[names.job_budget_key(job_id), names.job_key(job_id)], args=[reason, repr(time.time())],
                      client=r))


def mark_estimate(r: redis.Redis, job_id: str, estimate_s: float, trials: int, gain: float) -> tuple[float, int]:
    """Patience's mark after this estimate of the model's latency at `trials` (moved when the estimate is
    below it by `gain`, a fraction): (the estimate at the last improvement, the job's trials then)."""
    mark, at = _MARK(keys=[names.job_key(job_id)], args=[repr(float(estimate_s)), int(trials), repr(float(gain))],
                     client=r)
    return float(_s(mark)), int(_s(at))


def settle_claim(r: redis.Redis, job_id: str, shard: int, recorded: int) -> None:
    """Trials of a shard's claim whose records are now in the store are spent for good (r may be a pipeline)."""
    r.hincrby(names.job_claims_key(job_id), str(shard), -int(recorded))


def refund_claim(r: redis.Redis, job_id: str, shard: int, task_ids: tuple[str, ...] | list[str] = ()) -> int:
    """Hand the shard's unrecorded claim back to the budget (a stopped search's: unspent); `task_ids`, the shard's
    tasks: one whose first round never came back is owed it again (the first-round reserve covers it)."""
    keys = [names.job_budget_key(job_id), names.job_claims_key(job_id), names.job_key(job_id),
            names.job_first_rounds_key(job_id), names.job_history_key(job_id)]
    return int(_REFUND(keys=keys, args=[str(shard), *task_ids], client=r))


# ---- a job's per-task history and per-shard time split ------------------------------------------------------


def push_history(r: redis.Redis, job_id: str, task_id: str, best_s: float) -> None:
    """Append a task's best latency after one of its rounds (one writer per task: its shard's client)."""
    key = names.job_history_key(job_id)
    hist = json.loads(_s(r.hget(key, task_id)) or "[]")
    hist.append(float(best_s))
    r.hset(key, task_id, json.dumps(hist))


def history(r: redis.Redis, job_id: str) -> dict[str, list[float]]:
    return {_s(k): json.loads(_s(v)) for k, v in r.hgetall(names.job_history_key(job_id)).items()}


def put_searched(r: redis.Redis, job_id: str, task_id: str, best_s: float) -> None:
    """A task's best searched latency (its default aside), after one of its rounds (one writer: its shard's client)."""
    r.hset(names.job_searched_key(job_id), task_id, repr(float(best_s)))


def searched(r: redis.Redis, job_id: str) -> dict[str, float]:
    return {_s(k): float(_s(v)) for k, v in r.hgetall(names.job_searched_key(job_id)).items()}


def put_split(r: redis.Redis, job_id: str, shard: int, times: dict) -> None:
    """A shard's time split (search, build, run, ...), summed over shards in the job's result."""
    r.hset(names.job_splits_key(job_id), str(shard), json.dumps(times))


def splits(r: redis.Redis, job_id: str) -> list[dict]:
    return [json.loads(v) for v in r.hvals(names.job_splits_key(job_id))]

"""Workloads and their measured records (idempotent, keyed by content), the defaults each was timed with,
and a job's trial accounting (claimed = recorded)."""
from __future__ import annotations

import redis

from shared import names
from shared.errors import JobError
from shared.messages import DefaultTiming, Record, TaskProgress, Workload, WorkloadShape
from shared.store._redis import _s, _script
from shared.store.jobs import (budget_left, count_measured, job_progress, job_result, job_spec, job_tasks,
                               put_progress, settle_claim)
from shared.store.results import resend_counts


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
    """A measurement: no error and some figures. Only these answer another job's reuse lookup."""
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


def record_round(r: redis.Redis, job_id: str, shard: int, recs: list[Record], prog: TaskProgress, claimed: int,
                 shape: tuple[str, WorkloadShape] | None = None) -> None:
    """One round of a shard in one transaction: its records, its task's progress, the settling of the shard's trial
    claim and the job's recent measurements (count_measured), so a client that dies mid-round leaves all of the
    round in the store or none.
    `shape` (target kind, the workload's shape): a round with a valid record enters the workload in the index
    of similar workloads (idempotent: the same field, the same value)."""
    with r.pipeline(transaction=True) as p:
        for rec in recs:
            put_record(p, rec)
        if shape is not None and any(valid_record(rec) for rec in recs):
            kind, sh = shape
            p.hset(names.similar_key(kind, sh.op), sh.wkey, sh.model_dump_json())
        put_progress(p, job_id, prog)
        settle_claim(p, job_id, shard, claimed)
        if recs:
            count_measured(p, job_id, len(recs))
        written = p.execute()[:len(recs)]
    _count_recorded_elsewhere(r, job_id, [rec for rec, w in zip(recs, written) if not w])


def _count_recorded_elsewhere(r: redis.Redis, job_id: str, dropped: list[Record]) -> None:
    """Of the round's records the store did not write, those whose candidate another job recorded first
    (two jobs of one workload measuring the same candidate at once): still this job's trials, recorded."""
    if not dropped:
        return
    kept = [r.hget(names.records_key(rec.wkey), rec.candidate_key) for rec in dropped]
    elsewhere = sum(1 for raw in kept if raw is not None and Record.parse(raw).job_id != job_id)
    if elsewhere:
        r.incrby(names.job_recorded_elsewhere_key(job_id), elsewhere)


def similar_workloads(r: redis.Redis, target_kind: str, op: str) -> list[WorkloadShape]:
    """The workloads of this operator kind on this target kind that have valid records."""
    return [WorkloadShape.parse(v) for v in r.hvals(names.similar_key(target_kind, op))]


def replace_record(r: redis.Redis, rec: Record) -> None:
    """Overwrite a record in place (re-timing adds figures; it never removes a record)."""
    r.hset(names.records_key(rec.wkey), rec.candidate_key, rec.model_dump_json())


def has_records(r: redis.Redis, wkey: str) -> bool:
    return bool(r.hlen(names.records_key(wkey)))


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


def put_reference(r: redis.Redis, wkey: str, packed_mod: str) -> None:
    """A workload's default-scheduled module, the reference the lanes check candidates' outputs against (the
    first one written is kept: the same workload and target give the same module)."""
    r.set(names.reference_key(wkey), packed_mod, nx=True)


def references(r: redis.Redis, wkeys: list[str]) -> dict[str, str | None]:
    """Each workload's reference module (packed), None where none is stored, in one round trip."""
    raws = r.mget([names.reference_key(w) for w in wkeys]) if wkeys else []
    return {w: (raw.decode() if isinstance(raw, bytes) else raw) for w, raw in zip(wkeys, raws)}


def default_timing(r: redis.Redis, wkey: str) -> DefaultTiming | None:
    return default_timings(r, [wkey])[wkey]


def default_timings(r: redis.Redis, wkeys: list[str]) -> dict[str, DefaultTiming | None]:
    """Each workload's default-schedule timing, in one round trip."""
    raws = r.mget([names.default_key(w) for w in wkeys]) if wkeys else []
    return {w: DefaultTiming.parse(raw) if raw else None for w, raw in zip(wkeys, raws)}


def known_records(r: redis.Redis, wkey: str, keys: list[str], job_id: str = "") -> dict[str, Record]:
    """The records the store holds that answer these candidate keys: the valid ones, and `job_id`'s own error
    records (measured again in the same job, a candidate fails again: the same code, limits and lanes). Another
    job's error record is not an answer: what failed then may build or run now."""
    if not keys:
        return {}
    raw = r.hmget(names.records_key(wkey), keys)
    found = {k: Record.parse(v) for k, v in zip(keys, raw) if v is not None}
    return {k: rec for k, rec in found.items() if valid_record(rec) or (job_id and rec.job_id == job_id)}

def trial_accounting(r: redis.Redis, job_id: str) -> dict | None:
    """The job's trials as the store knows them (the fields: shared.messages.TrialAccounting). A finished
    job has lost == outstanding == 0. Its budget is a running job's key: once that expired after the job
    ended, the accounting is the one its result kept (None before a result)."""
    if not r.exists(names.job_budget_key(job_id)):
        res = job_result(r, job_id)
        return res.accounting.model_dump() if res is not None and res.accounting is not None else None
    unspent = int(_s(r.hget(names.job_key(job_id), "stopped_unspent")) or 0)  # a search stopped early
    claimed = job_spec(r, job_id).trials - budget_left(r, job_id) - unspent
    outstanding = sum(max(0, int(v)) for v in r.hvals(names.job_claims_key(job_id)))
    recorded = sum(1 for t in job_tasks(r, job_id) for rec in records(r, t.wkey) if rec.job_id == job_id)
    recorded += int(r.get(names.job_recorded_elsewhere_key(job_id)) or 0)
    reused = sum(p.reused_trials for p in job_progress(r, job_id).values())
    kinds = resend_counts(r, job_id)
    return {"claimed": claimed, "outstanding": outstanding, "recorded": recorded,
            "lost": max(0, claimed - outstanding - recorded), "reused": reused, "resends": sum(kinds.values()),
            "resend_kinds": kinds}

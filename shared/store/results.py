"""Measurement results of a batch (the first answer stands), the lanes' batch log, dead letters, poison
candidates (crash counts, quarantine) and GPU fault reports."""
from __future__ import annotations

import json
import time

import redis

from shared import names
from shared.messages import GpuFault, LaneBatch, MeasureResult, Quarantined
from shared.store._redis import _s, _script
from shared.timeouts import RESULT_TTL_S


DEADLETTER_KEEP = 1000  # dead letters kept (the newest)


# ---- measurement results -----------------------------------------------------------------------------


def mark_batch_started(r: redis.Redis, batch_id: str, lane: str, worker: str | None = None,
                       job_id: str = "", candidates: int = 0) -> None:
    key = names.batch_results_key(batch_id)
    started = {"at": time.time(), "lane": lane, "worker": worker, "job_id": job_id, "candidates": candidates}
    with r.pipeline() as p:
        p.hset(key, "_started", json.dumps(started))
        p.expire(key, RESULT_TTL_S)
        p.execute()


LIVE_BEST_TTL_S = 6 * 3600

_LOWER = _script("""
local cur = redis.call('GET', KEYS[1])
if (not cur) or tonumber(ARGV[1]) < tonumber(cur) then redis.call('SET', KEYS[1], ARGV[1]) end
redis.call('EXPIRE', KEYS[1], ARGV[2])
return 1
""")


def live_bests(r: redis.Redis, bar_keys: list[str]) -> dict[str, float]:
    """The best fully timed seconds the lanes have measured so far for each of these tasks (those known)."""
    if not bar_keys:
        return {}
    got = r.mget([names.live_best_key(k) for k in bar_keys])
    return {k: float(v) for k, v in zip(bar_keys, got) if v is not None}


def lower_live_best(r: redis.Redis, bar_key: str, secs: float) -> None:
    """A task's live best becomes `secs` if that is lower (atomic: lanes time its candidates at once)."""
    _LOWER(keys=[names.live_best_key(bar_key)], args=[repr(float(secs)), LIVE_BEST_TTL_S], client=r)


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


def batch_progress(r: redis.Redis, batch_id: str, known=frozenset()) -> tuple[dict | None, dict | None,
                                                                             dict[str, MeasureResult]]:
    """(lane started, builder building, results) of one batch; the results of candidates in `known` (read
    before: a candidate's first answer stands) are left out, unparsed."""
    raw = r.hgetall(names.batch_results_key(batch_id))
    started = building = None
    out = {}
    for k, v in raw.items():
        k = _s(k)
        if k == "_started":
            started = json.loads(v)
        elif k == "_building":
            building = json.loads(v)
        elif k not in known:
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


RESENDS_KEPT = 200  # the newest re-sends of a job kept with their reasons (all are counted by kind)


def note_resend(r: redis.Redis, job_id: str, batch_id: str, to: str, kind: str, why: str) -> None:
    """A batch's unanswered candidates were sent again (to `to`) for `why`; `kind` names the cause."""
    entry = json.dumps({"at": time.time(), "batch": batch_id, "to": to, "kind": kind, "why": why[:500]})
    with r.pipeline() as p:
        p.rpush(names.job_resends_key(job_id), entry)
        p.ltrim(names.job_resends_key(job_id), -RESENDS_KEPT, -1)
        p.hincrby(names.job_resend_counts_key(job_id), kind, 1)
        p.execute()


def resends(r: redis.Redis, job_id: str) -> list[dict]:
    return [json.loads(e) for e in r.lrange(names.job_resends_key(job_id), 0, -1)]


def resend_counts(r: redis.Redis, job_id: str) -> dict[str, int]:
    return {_s(k): int(v) for k, v in r.hgetall(names.job_resend_counts_key(job_id)).items()}


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

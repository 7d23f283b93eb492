"""Retention on a real Redis: an ended job's model and running state expire, `prune` deletes ended jobs but
never the tuning records, 50 jobs in a row leave the store as it was, and a full store refuses a submit with
the reason and writes nothing."""
from __future__ import annotations

import time
import uuid

import pytest

from services.broker.server import EmbeddedRedis, default_maxmemory
from shared.settings import BrokerSettings
from shared import names, store, timeouts
from shared.errors import SpecError, StoreFullError
from shared.messages import JobSpec, LaneBatch, MeasureResult, Record


@pytest.fixture(scope="module")
def r(tmp_path_factory):
    with EmbeddedRedis(tmp_path_factory.mktemp("redis")) as srv:
        yield store.connect(srv.url)


def _job(r, blob_bytes: int = 1024) -> str:
    job_id = uuid.uuid4().hex[:12]
    store.create_job(r, JobSpec(job_id=job_id, target="llvm", trials=8), b"m" * blob_bytes)
    r.hset(names.job_budget_key(job_id), "left", 8)  # running state, as a planned job has
    r.hset(names.job_history_key(job_id), "t0", "[0.001]")
    r.hset(names.job_progress_key(job_id), "t0", "{}")
    return job_id


def _record(r, wkey: str, job_id: str) -> None:
    store.put_record(r, Record(wkey=wkey, candidate_key=uuid.uuid4().hex, job_id=job_id, run_secs=[1e-3],
                               trace="{}", target="llvm", args_info=[], share=100))


def test_an_ended_job_keeps_its_status_and_its_model_and_running_state_expire(r):
    job = _job(r, 1 << 20)
    store.set_state(r, job, "tuning")
    assert r.pttl(names.job_model_key(job)) == -1  # a running job keeps everything
    store.set_state(r, job, "done")
    for key in (names.job_model_key(job), names.job_budget_key(job), names.job_history_key(job)):
        assert 0 < r.pttl(key) <= timeouts.ENDED_JOB_STATE_TTL_S * 1000
    # what status, results and reports read stays
    assert r.pttl(names.job_key(job)) == -1 and r.pttl(names.job_progress_key(job)) == -1
    # a key already set to go sooner keeps its time
    other = _job(r)
    r.pexpire(names.job_model_key(other), 5000)
    assert store.cancel_job(r, other) == "cancelled"
    assert 0 < r.pttl(names.job_model_key(other)) <= 5000
    assert 0 < r.pttl(names.job_budget_key(other)) <= timeouts.ENDED_JOB_STATE_TTL_S * 1000


def test_prune_deletes_jobs_that_ended_long_ago_and_keeps_the_tuning_records(r):
    wkey = f"wl-{uuid.uuid4().hex[:8]}"
    old, recent, running = _job(r), _job(r), _job(r)
    for job in (old, recent, running):
        _record(r, wkey, job)
    store.set_state(r, old, "failed", error="x")
    store.set_state(r, recent, "done")
    store.set_state(r, running, "tuning")
    r.hset(names.job_key(old), "updated_at", repr(time.time() - 8 * 86400))
    r.hset(names.job_key(running), "updated_at", repr(time.time() - 8 * 86400))  # old, but not ended
    assert old in store.prune_jobs(r, 7 * 86400, dry_run=True) and r.exists(names.job_key(old))
    would_free = store.job_bytes(r, [old])
    used = store.memory(r)["used_bytes"]
    assert 1024 < would_free < used  # the job's keys, its 1 KiB model among them: not the whole store
    gone = store.prune_jobs(r, 7 * 86400)
    assert old in gone and recent not in gone and running not in gone
    assert not any(r.exists(k) for k in names.job_keys(old))
    assert r.zscore(names.JOBS_KEY, old) is None and r.zscore(names.JOBS_KEY, recent) is not None
    assert store.record_count(r, wkey) == 3  # every job's records stay: the tuning knowledge


def test_fifty_jobs_in_a_row_leave_the_store_as_it_was(r):
    """Each with a 512 KiB model, running state, progress and a record of one shared workload; ended and
    pruned: the store's memory and keys come back to where they were, records aside."""
    store.prune_jobs(r, 0, now=time.time() + 1)
    wkey = f"wl-{uuid.uuid4().hex[:8]}"
    base = store.memory(r)
    peak = 0
    for i in range(50):
        job = _job(r, 512 << 10)
        _record(r, wkey, job)
        batch = f"b-{job}"  # a batch a lane measured: its results (a hash with a day's TTL) and the job's log
        store.put_result(r, batch, MeasureResult(candidate_id="c0", run_secs=[1e-3]))
        store.log_lane_batch(r, job, LaneBatch(batch_id=batch, lane="measure.cpu.c0", worker="w", started_at=i,
                                               finished_at=i + 1, candidates=1))
        store.set_state(r, job, "done")
        peak = max(peak, store.memory(r)["dataset_bytes"])
        store.prune_jobs(r, 0, now=time.time() + 1)
    end = store.memory(r)
    # the data, not the server's buffers: a 512 KiB write's query buffer and the AOF buffer drain on their own
    assert end["keys"] == base["keys"] + 1  # the workload's records
    assert end["dataset_bytes"] < base["dataset_bytes"] + (1 << 20)  # 50 models of 512 KiB came and went
    assert peak < base["dataset_bytes"] + (4 << 20)  # never more than one job's state at a time


def test_a_full_store_refuses_a_submit_with_the_reason_and_writes_nothing(tmp_path):
    with EmbeddedRedis(tmp_path / "redis", maxmemory="4mb") as srv:
        import redis

        r = store.connect(srv.url)
        with pytest.raises(redis.exceptions.OutOfMemoryError):  # filled to the limit
            for i in range(64):
                r.set(f"filler:{i}", b"x" * (512 << 10))
        spec = JobSpec(job_id="refused00000", target="llvm", trials=8)
        with pytest.raises(StoreFullError, match="the store is full.*not submitted.*prune --older-than"):
            store.create_job(r, spec, b"m" * (1 << 20))  # a model as large as a small CNN's
        assert not r.exists(names.job_key("refused00000"), names.job_model_key("refused00000"))
        assert r.zscore(names.JOBS_KEY, "refused00000") is None
        assert store.prune_jobs(r, 0, now=time.time() + 1) == []  # nothing ended: nothing to prune


def test_durations_and_the_default_cap(monkeypatch):
    from sharetune.cli import parse_duration

    assert parse_duration("7d") == 7 * 86400 and parse_duration("12h") == 43200 and parse_duration("90") == 90
    for bad in ("soon", "-1d", ""):
        with pytest.raises(SpecError, match="--older-than"):
            parse_duration(bad)
    monkeypatch.setenv("SHARETUNE_REDIS_MAXMEMORY", "2gb")
    assert default_maxmemory(BrokerSettings().redis_maxmemory) == "2gb"
    monkeypatch.delenv("SHARETUNE_REDIS_MAXMEMORY")
    assert BrokerSettings().redis_maxmemory is None
    assert int(default_maxmemory()) >= 256 << 20

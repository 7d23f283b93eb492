"""Two jobs of one workload that measure the same candidate at once: the store keeps the first record, and the
second job's trial is counted as recorded elsewhere, not lost (shared/store/records.py)."""
from __future__ import annotations

import uuid


def _record(job_id: str, wkey: str, key: str):
    from shared.messages import Record

    return Record(candidate_key=key, wkey=wkey, trace="{}", run_secs=[1e-5], target="llvm", args_info=[], share=100,
                  job_id=job_id)


def test_a_candidate_recorded_by_another_job_first_counts_as_recorded_elsewhere(redis_conn):
    from shared import names, store
    from shared.messages import TaskProgress

    wkey, key = f"w-{uuid.uuid4().hex}", uuid.uuid4().hex
    first, second = f"a-{uuid.uuid4().hex[:8]}", f"b-{uuid.uuid4().hex[:8]}"
    prog = TaskProgress(task_id="t0", name="t0", trials=1)
    store.record_round(redis_conn, first, 0, [_record(first, wkey, key)], prog, 1)
    store.record_round(redis_conn, second, 0, [_record(second, wkey, key)], prog, 1)
    store.record_round(redis_conn, second, 0, [_record(second, wkey, uuid.uuid4().hex)], prog, 1)
    assert [r.job_id for r in store.records(redis_conn, wkey)].count(first) == 1
    assert redis_conn.get(names.job_recorded_elsewhere_key(second)) in (b"1", "1")
    assert redis_conn.get(names.job_recorded_elsewhere_key(first)) is None
    assert names.job_recorded_elsewhere_key(second) in names.job_transient_keys(second)


def test_a_failure_answers_a_lookup_only_in_the_job_that_measured_it(redis_conn):
    """A candidate that failed in this job is not measured again by it (a source over the size limit failed
    every time, and each time cost a trial that left no record of its own); another job measures it again."""
    from shared import store

    wkey, failed, ok = f"w-{uuid.uuid4().hex}", uuid.uuid4().hex, uuid.uuid4().hex
    job, later = f"a-{uuid.uuid4().hex[:8]}", f"b-{uuid.uuid4().hex[:8]}"
    bad = _record(job, wkey, failed).model_copy(update={"run_secs": None, "error": "build: source over the limit"})
    store.put_record(redis_conn, bad)
    store.put_record(redis_conn, _record(job, wkey, ok))
    assert set(store.known_records(redis_conn, wkey, [failed, ok], job)) == {failed, ok}
    assert set(store.known_records(redis_conn, wkey, [failed, ok], later)) == {ok}
    assert set(store.known_records(redis_conn, wkey, [failed, ok])) == {ok}

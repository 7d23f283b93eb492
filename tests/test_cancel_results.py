"""A cancelled job on the real stack (tests/conftest.py): its in-flight candidates are not stored as
records (the lanes' "job cancelled" answer is not a measurement), a later job proposing the same
candidates measures them, and the cancelled job's partial results (best so far, the exported database,
a compiled model) can be fetched, through the client and over HTTP, while its state stays "cancelled"."""
import io
import json
import os
import time
import zipfile

import pytest

from shared import names, store
from shared.errors import JobError

pytestmark = pytest.mark.e2e


def _batches_of(r, job_id: str) -> list[dict]:
    """The batch result hashes of a job: {"_started": {...}, candidate_id: MeasureResult JSON, ...}."""
    out = []
    for key in r.scan_iter(match=names.batch_results_key("*"), count=1000):
        raw = {k.decode(): v.decode() for k, v in r.hgetall(key).items()}
        if "_started" in raw and json.loads(raw["_started"]).get("job_id") == job_id:
            out.append(raw)
    return out


def _cancelled_answers(r, job_id: str) -> int:
    return sum(1 for b in _batches_of(r, job_id) for k, v in b.items()
               if not k.startswith("_") and json.loads(v).get("error") == store.CANCELLED)


def _wait_result(job, timeout_s: float = 600):
    deadline = time.time() + timeout_s
    while True:
        try:
            return job.result()
        except JobError as err:
            assert job.state()["state"] == "cancelled", err
            assert time.time() < deadline, f"no result for cancelled job {job.job_id}: {err}"
            time.sleep(0.5)


def _records(r, job) -> list:
    wkeys = {t.wkey for t in store.job_tasks(r, job.job_id)}
    return [rec for w in wkeys for rec in store.records(r, w)]


@pytest.fixture(scope="module")
def cancelled(client, redis_conn, lane_share):
    """A job cancelled while its first batches are on the lanes (seed 7, its own cost model: it samples
    the design space as a job with the same seed does again)."""
    job = client.submit("tiny", target="llvm", share=lane_share, trials=400, trials_per_iter=16, seed=77,
                        cost_model="per_client", untuned_baseline=False, name="cancel-me")
    deadline = time.time() + 600

    def started() -> set:
        return {k for k in redis_conn.scan_iter(match=names.batch_results_key("*"), count=1000)
                if json.loads((redis_conn.hget(k, "_started") or b"{}").decode()).get("job_id") == job.job_id}

    # its first batches time the tasks' default schedules (unless an earlier job did): wait for those,
    # then for a batch of candidates
    while True:
        tasks = store.job_tasks(redis_conn, job.job_id)
        if tasks and all(store.default_timing(redis_conn, t.wkey) for t in tasks):
            break
        assert job.state()["state"] not in ("failed", "done"), job.status()
        assert time.time() < deadline, "the job's default schedules were never timed"
        time.sleep(0.05)
    before = started()
    while not started() - before:
        assert job.state()["state"] not in ("failed", "done"), job.status()
        assert time.time() < deadline, "no batch of the job's candidates ever started"
        time.sleep(0.05)
    assert job.cancel() == "cancelled"
    return job


def test_a_cancelled_job_has_partial_results(cancelled, redis_conn):
    res = _wait_result(cancelled)
    assert cancelled.state()["state"] == "cancelled"  # finishing never overwrites the cancellation
    assert res.job_id == cancelled.job_id and {t.name for t in res.tasks} == {t.name for t in store.job_tasks(redis_conn, cancelled.job_id)}
    assert res.trials == sum(t.trials for t in res.tasks) and res.trials < 400
    assert any(t.best_us for t in res.tasks), res  # best so far: something was measured before the cancel
    assert os.path.isfile(os.path.join(res.database_dir, "database_workload.json"))
    assert os.path.isfile(os.path.join(res.database_dir, "database_tuning_record.json"))
    assert os.path.getsize(res.tuned_module_path) > 0
    import tvm

    tvm.runtime.load_module(res.tuned_module_path)  # a module TVM loads


def test_cancelled_candidates_are_not_records(cancelled, redis_conn):
    _wait_result(cancelled)
    print(f"{_cancelled_answers(redis_conn, cancelled.job_id)} candidates answered '{store.CANCELLED}'")
    recs = _records(redis_conn, cancelled)
    assert recs and not [r for r in recs if r.error == store.CANCELLED]
    assert sum(p.trials for p in store.job_progress(redis_conn, cancelled.job_id).values()) == \
        sum(1 for r in recs if r.job_id == cancelled.job_id)


def test_error_records_never_answer_a_reuse_lookup(cancelled, client, redis_conn, lane_share):
    """Records that carry the cancellation (as stored before this fix) or any error are measured again by
    a job that proposes the same candidates; the measurement replaces them, and status's reused counts
    only valid records."""
    _wait_result(cancelled)
    mine = [r for r in _records(redis_conn, cancelled) if r.job_id == cancelled.job_id and store.valid_record(r)]
    assert mine
    for rec in mine:  # poison them as the lanes' answers were stored before
        store.replace_record(redis_conn, rec.model_copy(update={"error": store.CANCELLED, "run_secs": None}))
    valid_before = {t.wkey: store.record_count(redis_conn, t.wkey) for t in store.job_tasks(redis_conn, cancelled.job_id)}
    again = client.submit("tiny", target="llvm", share=lane_share, trials=len(mine) + 16, trials_per_iter=16,
                          seed=77, cost_model="per_client", untuned_baseline=False, name="same-seed")
    assert again.wait(timeout_s=900)["state"] == "done", again.status()
    after = {(r.wkey, r.candidate_key): r for r in _records(redis_conn, again)}
    remeasured = [after[(r.wkey, r.candidate_key)] for r in mine]
    # the search is seeded but not bit-exact (threads draw samples), so a poisoned candidate the new job never
    # proposes keeps its poison; the new job itself never stores a cancellation as a record
    assert not [r for r in after.values() if r.error == store.CANCELLED and r.job_id == again.job_id]
    assert all(r.job_id == again.job_id and store.valid_record(r) for r in remeasured if r.error is None)
    assert sum(1 for r in remeasured if r.job_id == again.job_id and store.valid_record(r)) >= len(mine) // 2, \
        "the same seed proposes the same candidates: the poisoned ones are measured, not reused"
    progress = store.job_progress(redis_conn, again.job_id)
    for t in store.job_tasks(redis_conn, again.job_id):  # planned after the poisoning: errors are not reused
        assert progress[t.task_id].reused_trials == valid_before[t.wkey], (t.name, valid_before)


def test_partial_results_over_http(cancelled, client):
    from fastapi.testclient import TestClient

    import sharetune.api as api

    http = TestClient(api.make_app(client=client))
    res = _wait_result(cancelled)
    assert http.get(f"/jobs/{cancelled.job_id}").json()["state"] == "cancelled"
    assert http.get(f"/jobs/{cancelled.job_id}/results").json()["job_id"] == cancelled.job_id
    db = http.get(f"/jobs/{cancelled.job_id}/database")
    assert db.status_code == 200 and db.headers["content-type"] == "application/zip"
    with zipfile.ZipFile(io.BytesIO(db.content)) as zf:
        files = set(zf.namelist())
        assert {"database/database_workload.json", "database/database_tuning_record.json"} <= files
        assert zf.read("database/database_tuning_record.json") == \
            open(os.path.join(res.database_dir, "database_tuning_record.json"), "rb").read()
    mod = http.get(f"/jobs/{cancelled.job_id}/module")
    assert mod.status_code == 200 and mod.content == open(res.tuned_module_path, "rb").read()
    assert http.get("/jobs/nosuchjob/module").status_code == 404


def test_a_job_cancelled_before_its_plan_finishes_cleanly(redis_conn, stack):
    """Its finishing step has nothing to re-time or compile (no target resolved, no task): it is skipped,
    the job stays cancelled with no error."""
    from services.tuner.shard_runner import ShardRunner
    from shared.messages import JobSpec
    from shared.settings import TunerSettings

    spec = JobSpec(job_id=f"unplanned{time.time_ns()}", target="llvm", trials=4)
    store.create_job(redis_conn, spec, b"not a model: never read")
    assert store.cancel_job(redis_conn, spec.job_id) == "cancelled"
    settings = TunerSettings(work_dir=str(stack.work_dir))
    runner = ShardRunner(redis_conn, "test-finisher", settings, None, None, None)
    assert runner.finish(spec.job_id) == {"job_id": spec.job_id, "skipped": "cancelled before it was planned"}
    st = store.job_hash(redis_conn, spec.job_id)
    assert st.state == "cancelled" and not st.error

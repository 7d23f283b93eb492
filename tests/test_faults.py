"""Faults with real processes: a lane worker killed with SIGKILL in the middle of a batch, Redis stopped
and started again in the middle of a job, and twenty jobs at once on one stack. Each scenario also writes
its figures row for bench/faults.py (sharetune.testing.faults.record_row)."""
import os
import signal
import time

import pytest

from sharetune.testing import faults as faultlib
from conftest import LANES
from shared import names, store

pytestmark = pytest.mark.e2e


def test_lane_killed_mid_batch_loses_no_candidate(stack, client, redis_conn, lane_share, tuned_tiny, figures_out):
    before = set(redis_conn.scan_iter(match=f"{names.PREFIX}:batch:*"))
    restarts = len(stack.recoveries)
    job = client.submit("tiny", target="llvm", share=lane_share, trials=8, trials_per_iter=8, seed=3,
                        only_tasks=faultlib.conv_only(redis_conn, tuned_tiny))
    batch_key, info = faultlib.batch_in_flight(redis_conn, before, job.job_id)
    batch_id = (batch_key.decode() if isinstance(batch_key, bytes) else batch_key).rsplit(":", 1)[1]
    pid = int(info["worker"].rsplit(".", 1)[1])
    assert any(p.pid == pid for p in list(stack.procs.values()))
    os.kill(pid, signal.SIGKILL)
    killed_at = time.time()
    final = job.wait(timeout_s=300)
    assert final["state"] == "done", final
    st = job.status()
    assert sum(t["errors"] for t in st["tasks"]) == 0  # the dead lane's candidates were measured elsewhere
    recs = [r for t in store.job_tasks(redis_conn, job.job_id) for r in store.records(redis_conn, t.wkey)
            if r.job_id == job.job_id]
    assert len(recs) == st["trials"] == job.result().trials
    assert all(r.error is None for r in recs)
    accounting = store.trial_accounting(redis_conn, job.job_id)  # every claimed trial ended as one record
    assert accounting["claimed"] == accounting["recorded"] == len(recs) and accounting["lost"] == 0
    # the killed batch's re-send is on record, once, with its batch and reason, and the user sees it
    sent_again = store.resends(redis_conn, job.job_id)
    assert [e["kind"] for e in sent_again] == ["lane-died"] and sent_again[0]["batch"] == batch_id
    assert f"worker {info['worker']} died" in sent_again[0]["why"]
    assert accounting["resends"] == 1 and accounting["resend_kinds"] == {"lane-died": 1}
    assert st["accounting"]["resend_kinds"] == {"lane-died": 1}
    assert job.result().accounting.resends == 1 and job.result().accounting.lost == 0
    # the stack's supervisor started the lane again
    stack.wait_for_lanes(stack.lanes, 300)
    back = next(e for e in stack.recoveries[restarts:] if e["restarted"])
    assert back["exits"] and -signal.SIGKILL in back["exits"].values()
    figures = faultlib.job_figures(redis_conn, job, 8)
    assert figures["candidates_lost"] == 0 and figures["trials_respent"] <= 8  # at most the killed batch
    lane_back = max(l.started_at for l in store.live_lanes(redis_conn) if l.queue == info["lane"])
    faultlib.record_row(figures_out, {"scenario": "kill -9 a measurer lane mid-batch", **figures,
                                      "recovery_s": round(lane_back - killed_at, 1)})


def test_redis_stopped_and_started_mid_job_loses_nothing(stack, client, redis_conn, lane_share, tuned_tiny,
                                                        figures_out):
    if stack.redis_server is None:
        pytest.skip("the stack uses an external Redis")
    before = set(redis_conn.scan_iter(match=f"{names.PREFIX}:batch:*"))
    job = client.submit("tiny", target="llvm", share=lane_share, trials=8, trials_per_iter=4, seed=5,
                        only_tasks=faultlib.conv_only(redis_conn, tuned_tiny))
    faultlib.batch_in_flight(redis_conn, before, job.job_id)
    records_before = {k: redis_conn.hlen(k) for k in redis_conn.scan_iter(match=f"{names.PREFIX}:rec:*")}
    stopped_at = time.time()
    stack.redis_server.stop()  # SIGTERM: Redis flushes its AOF and exits
    time.sleep(2)  # an outage, not a timing assertion
    stack.redis_server.start()
    back_at = time.time()
    for key, n in records_before.items():  # everything acknowledged before the stop came back (AOF)
        assert redis_conn.hlen(key) >= n, key
    final = job.wait(timeout_s=600)
    assert final["state"] == "done", final
    stack.wait_for_lanes(stack.lanes, 120)
    figures = faultlib.job_figures(redis_conn, job, 8)
    assert figures["candidates_lost"] == 0 and figures["trials_respent"] <= 8
    faultlib.record_row(figures_out, {"scenario": "stop Redis mid-job and start it again", **figures,
                                      "recovery_s": round(back_at - stopped_at, 1)})


def test_redis_away_longer_than_the_services_wait_loses_nothing(tmp_path, monkeypatch):
    """Redis away longer than the services' window (SHARETUNE_REDIS_OUTAGE_S, 5 s here; 600 s by default):
    the operations that give up leave their step to its lease instead of failing the job (a failure would be
    written: Redis is back before the failing step's own wait ends), and once Redis is back the reapers send
    the steps again. An outage of minutes takes the same path with the default window."""
    from shared.settings import StackSettings
    from sharetune.client import Client
    from sharetune.stack.local import Stack

    monkeypatch.delenv("REDIS_URL", raising=False)
    monkeypatch.setenv("SHARETUNE_REDIS_OUTAGE_S", "5")
    monkeypatch.setenv("SHARETUNE_CORE_LOCK_DIR", str(tmp_path / "cores"))  # beside the session stack's lanes
    with Stack(tmp_path / "stack", lanes=LANES[:1], tuners=1, log_level="INFO", settings=StackSettings()) as st:
        r, client = store.connect(st.redis_url), Client(st.redis_url)
        before = set(r.scan_iter(match=f"{names.PREFIX}:batch:*"))
        job = client.submit("tiny", target="llvm", share=client.lanes()[0].share, trials=8, trials_per_iter=4,
                            seed=11, untuned_baseline=False)
        faultlib.batch_in_flight(r, before, job.job_id)
        st.redis_server.stop()
        time.sleep(8)  # an outage longer than the window, not a timing assertion
        st.redis_server.start()
        final = job.wait(timeout_s=600)
        assert final["state"] == "done", final
        figures = faultlib.job_figures(r, job, 8)
        assert figures["claimed"] == figures["recorded"] and figures["candidates_lost"] == 0, figures
        logs = "".join(f.read_text(errors="replace") for f in (tmp_path / "stack" / "logs").glob("tuner*.log"))
        assert "Redis was away" in logs  # the path under test was taken: some step gave up and was sent again


def _small_add_model(width: int) -> bytes:
    """An ONNX model of one elementwise add: one small task, a tiny design space, so a job is seconds of
    search and compile rather than minutes (a distinct width is a distinct workload)."""
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, width])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, width])
    graph = helper.make_graph([helper.make_node("Add", ["x", "x"], ["y"])], f"add{width}", [x], [y])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def test_twenty_small_jobs_at_once(client, redis_conn, lane_share, figures_out):
    t0 = time.time()
    jobs = [client.submit(_small_add_model(40 + i), target="llvm", share=lane_share, trials=2, trials_per_iter=2,
                          seed=100 + i, untuned_baseline=False) for i in range(20)]
    finals = [job.wait(timeout_s=1800) for job in jobs]
    assert all(f["state"] == "done" for f in finals), [f for f in finals if f["state"] != "done"]
    figures = [faultlib.job_figures(redis_conn, job, 2) for job in jobs]
    assert sum(f["candidates_lost"] for f in figures) == 0
    assert all(f["trials"] >= 1 for f in figures)  # an add has one or two distinct schedules
    faultlib.record_row(figures_out, {"scenario": "20 small jobs at once on one stack",
                                      "jobs_completed": sum(f["jobs_completed"] for f in figures),
                                      "candidates_lost": sum(f["candidates_lost"] for f in figures),
                                      "trials_respent": sum(f["trials_respent"] for f in figures),
                                      "trials": sum(f["trials"] for f in figures),
                                      "recovery_s": None, "wall_s": round(time.time() - t0, 1)})

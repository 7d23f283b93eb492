"""Poison candidates on real lanes: a build that segfaults, a run that segfaults, a run that hangs. Each
kills (or outlasts) only the lane's sandbox child: the lane process lives on, the candidate is retried at
most max_crashes (2) times in all, then quarantined and answered without running."""
import time

import pytest

from sharetune.testing import faults as faultlib
from shared import names, store

pytestmark = pytest.mark.e2e


def _lane(client):
    return sorted(client.lanes(), key=lambda l: l.queue)[0]


@pytest.mark.parametrize("kind", ["build", "run"])
def test_segfaulting_candidate_is_quarantined_and_the_lane_survives(client, redis_conn, kind):
    lane = _lane(client)
    worker = faultlib.lane_worker(redis_conn, lane.queue)
    salt = int(time.time() * 1000) % 100000
    bad = (faultlib.segv_at_build if kind == "build" else faultlib.segv_at_run)("bad", salt)
    batch = [faultlib.good("ok1", salt), bad, faultlib.good("ok2", salt + 1)]
    faultlib.send_batch(client, lane, batch, f"segv-{kind}-{salt}")
    res = faultlib.wait_results(redis_conn, f"segv-{kind}-{salt}", ["ok1", "bad", "ok2"])
    assert res["ok1"].error is None and res["ok2"].error is None  # the good ones either side were measured
    assert res["bad"].fault == "crash"
    assert "SIGSEGV" in res["bad"].error and "quarantined after 2 crashes" in res["bad"].error
    entry = store.quarantined(redis_conn, store.candidate_hash(bad.mod))
    assert entry is not None and entry.crashes == 2 and "SIGSEGV" in entry.error and entry.lane == lane.queue
    assert faultlib.lane_worker(redis_conn, lane.queue) == worker  # the same lane process, still alive

    # sent again (another batch, another lane): answered at once, without running
    other = sorted(client.lanes(), key=lambda l: l.queue)[-1]
    faultlib.send_batch(client, other, [bad.model_copy(update={"candidate_id": "again"})], f"segv-{kind}-{salt}-2")
    again = faultlib.wait_results(redis_conn, f"segv-{kind}-{salt}-2", ["again"])["again"]
    assert again.fault == "quarantined" and "SIGSEGV" in again.error
    assert store.quarantined_all(redis_conn, job_id="faults")


def test_hanging_candidate_times_out_and_the_lane_survives(client, redis_conn):
    lane = _lane(client)
    worker = faultlib.lane_worker(redis_conn, lane.queue)
    salt = int(time.time() * 1000) % 100000
    hang = faultlib.hang_at_run("hang", salt)
    faultlib.send_batch(client, lane, [hang, faultlib.good("ok", salt)], f"hang-{salt}", timeout_s=5)
    res = faultlib.wait_results(redis_conn, f"hang-{salt}", ["hang", "ok"])
    assert res["hang"].fault == "timeout" and "timed out" in res["hang"].error
    assert res["ok"].error is None
    chash = store.candidate_hash(hang.mod)
    assert store.crash_count(redis_conn, chash) == 1 and store.quarantined(redis_conn, chash) is None
    # a hang is not retried in the same batch (it would cost another timeout); its second hang quarantines it
    faultlib.send_batch(client, lane, [hang.model_copy(update={"candidate_id": "hang2"})], f"hang-{salt}-2", timeout_s=5)
    res2 = faultlib.wait_results(redis_conn, f"hang-{salt}-2", ["hang2"])
    assert res2["hang2"].fault == "timeout" and "quarantined after 2 crashes" in res2["hang2"].error
    assert store.quarantined(redis_conn, chash) is not None
    assert faultlib.lane_worker(redis_conn, lane.queue) == worker


def test_a_candidate_that_completes_has_no_crash_count(client, redis_conn):
    lane = _lane(client)
    salt = int(time.time() * 1000) % 100000
    cand = faultlib.good("fine", salt)
    chash = store.candidate_hash(cand.mod)
    redis_conn.hset(names.CRASHES_KEY, chash, 1)  # as left by a lane that died with it
    faultlib.send_batch(client, lane, [cand], f"fine-{salt}")
    assert faultlib.wait_results(redis_conn, f"fine-{salt}", ["fine"])["fine"].error is None
    assert store.crash_count(redis_conn, chash) == 0


def test_a_job_completes_while_poison_candidates_crash_and_hang_its_lanes(client, redis_conn, lane_share, tuned_tiny,
                                                                           figures_out):
    before = set(redis_conn.scan_iter(match=f"{names.PREFIX}:batch:*"))
    job = client.submit("tiny", target="llvm", share=lane_share, trials=8, trials_per_iter=4, seed=1707,
                        only_tasks=faultlib.conv_only(redis_conn, tuned_tiny))
    faultlib.batch_in_flight(redis_conn, before, job.job_id)
    lanes = sorted(client.lanes(), key=lambda l: l.queue)
    salt = int(time.time() * 1000) % 100000
    segv, hang = faultlib.segv_at_build("segv", salt), faultlib.hang_at_run("hang", salt)
    t0 = time.time()
    faultlib.send_batch(client, lanes[0], [segv], f"job-segv-{salt}")
    faultlib.send_batch(client, lanes[-1], [hang], f"job-hang-{salt}", timeout_s=5)
    segv_res = faultlib.wait_results(redis_conn, f"job-segv-{salt}", ["segv"])["segv"]
    segv_s = time.time() - t0
    hang_res = faultlib.wait_results(redis_conn, f"job-hang-{salt}", ["hang"])["hang"]
    hang_s = time.time() - t0
    assert segv_res.fault == "crash" and "quarantined" in segv_res.error
    assert hang_res.fault == "timeout"
    final = job.wait(timeout_s=600)
    assert final["state"] == "done", final
    figures = faultlib.job_figures(redis_conn, job, 8)
    assert figures["candidates_lost"] == 0 and figures["trials_respent"] == 0
    assert figures["claimed"] == figures["recorded"]  # from the store: every claimed trial has its record
    assert sum(t["errors"] for t in job.status()["tasks"]) == 0  # the job's own candidates were unharmed
    faultlib.record_row(figures_out, {"scenario": "a candidate whose build segfaults (beside a running job)",
                                      **figures, "recovery_s": round(segv_s, 1)})
    faultlib.record_row(figures_out, {"scenario": "a candidate whose run hangs (5 s timeout, beside a running job)",
                                      **figures, "recovery_s": round(hang_s, 1)})

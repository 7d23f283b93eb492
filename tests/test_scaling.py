"""Horizontal scaling: a second group of lanes, started mid-job as another host would start it (its own
process group and session, `sharetune up --join REDIS_URL`), takes work; stopping it loses nothing."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shared import store

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.e2e


def _cli(*args, env, timeout=300):
    out = subprocess.run([sys.executable, "-m", "sharetune", *args], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def test_a_second_lane_group_joins_mid_job_and_leaves_without_loss(stack, client, lane_share, redis_conn, tmp_path,
                                                                   tuned_tiny):
    env = {**os.environ, "REDIS_URL": stack.redis_url}
    conv = [t.name for t in store.job_tasks(redis_conn, tuned_tiny.job_id) if "conv2d" in t.name]
    job = client.submit("tiny", target="llvm", share=lane_share, trials=40, trials_per_iter=8, seed=11, only_tasks=conv)
    deadline = time.time() + 600
    while job.state()["state"] != "tuning":
        assert job.state()["state"] not in ("failed", "done", "cancelled"), job.state()
        assert time.time() < deadline
        time.sleep(0.2)
    group = tmp_path / "host2"
    _cli("up", "--join", stack.redis_url, "--lanes", stack.lanes[-1], "--work-dir", str(group), env=env)
    joined = set(json.loads((group / "stack.json").read_text())["pids"].values())
    stopped = False
    try:
        took = []
        while not took:  # the job's batches, by worker: wait for one measured by the joined group
            took = [b for b in store.lane_batches(redis_conn, job.job_id) if int(b.worker.rsplit(".", 1)[1]) in joined]
            assert job.state()["state"] == "tuning", "the job ended before the joined lane took any work"
            time.sleep(0.2)
        _cli("down", "--work-dir", str(group), env=env)  # mid-job, as a host leaving
        stopped = True
        assert job.wait(timeout_s=900)["state"] == "done"
    finally:
        if not stopped:
            _cli("down", "--work-dir", str(group), env=env)
    st = job.status()
    # nothing lost with the group that left: a candidate whose lane vanished would come back as an error
    assert sum(t["errors"] for t in st["tasks"]) == 0 and st["trials"] == job.result().trials > 0
    # every trial claimed from the budget was recorded (a batch lost with the group would stay claimed); the job
    # may end before 40 when its search proposes only candidates stored by the earlier job of these tasks
    assert st["trials"] + store.budget_left(redis_conn, job.job_id) == 40
    recs = [r for t in store.job_tasks(redis_conn, job.job_id) for r in store.records(redis_conn, t.wkey)
            if r.job_id == job.job_id]
    # records are kept once per candidate across jobs: one this job proposed again keeps its first job's id
    assert recs and all(r.error is None for r in recs) and len(recs) <= st["trials"]
    batches = store.lane_batches(redis_conn, job.job_id)
    assert sum(b.candidates - b.errors for b in batches) >= st["trials"]  # every trial measured by some lane

"""Faults with real processes: a lane worker killed with SIGKILL in the middle of a batch."""
import json
import os
import signal
import time

import pytest

from shared import names, store

pytestmark = pytest.mark.e2e


def test_lane_killed_mid_batch_loses_no_candidate(stack, client, redis_conn, lane_share, tuned_tiny):
    before = set(redis_conn.scan_iter(match=f"{names.PREFIX}:batch:*"))
    job = client.submit("tiny", target="llvm", share=lane_share, trials=8, trials_per_iter=8, seed=3,
                        only_tasks=[t.name for t in store.job_tasks(redis_conn, tuned_tiny.job_id) if "conv2d" in t.name])
    victim = None
    deadline = time.time() + 300
    while victim is None and time.time() < deadline:
        for key in set(redis_conn.scan_iter(match=f"{names.PREFIX}:batch:*")) - before:
            started = redis_conn.hget(key, "_started")
            if started and redis_conn.hlen(key) - 1 < 2:  # started, at most one result written
                info = json.loads(started)
                pid = int(info["worker"].rsplit(".", 1)[1])
                name = next(n for n, p in stack.procs.items() if p.pid == pid)
                os.kill(pid, signal.SIGKILL)
                stack.procs.pop(name).wait()
                victim = (info["lane"], key)
                break
        time.sleep(0.005)
    assert victim is not None, "no batch was seen in flight"
    try:
        final = job.wait(timeout_s=300)
        assert final["state"] == "done", final
        st = job.status()
        assert sum(t["errors"] for t in st["tasks"]) == 0  # the dead lane's candidates were measured elsewhere
        recs = [r for t in store.job_tasks(redis_conn, job.job_id) for r in store.records(redis_conn, t.wkey)
                if r.job_id == job.job_id]
        assert len(recs) == st["trials"] == job.result().trials
        assert all(r.error is None for r in recs)
    finally:
        stack.start_lane(victim[0])  # the session's other tests expect both lanes
        stack.wait_for_lanes(stack.lanes, 300)

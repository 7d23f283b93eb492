"""A live tuner client keeps its shard while the host is overloaded: busy processes (three per core) beside
the session stack for a whole job, and no shard is handed back or started twice."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from shared import store

pytestmark = pytest.mark.e2e


@pytest.fixture
def busy_host():
    n = 3 * (os.cpu_count() or 1)
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield n
    finally:
        for p in procs:  # only the processes this fixture started
            p.kill()
            p.wait()


def test_no_live_client_loses_its_lease_under_cpu_stress(busy_host, client, redis_conn, lane_share):
    job = client.submit("tiny", target="llvm", share=lane_share, trials=16, trials_per_iter=8, seed=11)
    final = job.wait(timeout_s=900)
    assert final["state"] == "done", final
    shards = store.shards(redis_conn, job.job_id)
    assert shards and all(sh.state == "done" for sh in shards.values())
    assert all(sh.attempts == 1 and sh.refunded == 0 for sh in shards.values()), \
        {sh.shard: (sh.attempts, sh.refunded) for sh in shards.values()}

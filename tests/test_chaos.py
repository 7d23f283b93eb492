"""The chaos soak, short (bench/chaos.py): sixty seconds of SIGKILLs of random service processes (one every
4-9 s: about as many kills as ninety seconds at 5-12 s gave, ~9) and junk on random queues (one every 1.5 s,
~40) beside a stream of jobs, on a stack of its own. Nothing is lost or counted twice, every job ends done or
failed with its reason, and no worker is given up. (Forty-five seconds at a kill every 2.5-6 s left both lanes
dead for long stretches: two jobs, at the floor below, and once a junk entry missing from the dead letters, the
race a kill can win against a junk entry twice as often.)"""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.e2e


def test_a_short_chaos_run_loses_nothing(tmp_path):
    from bench.chaos import soak

    result = soak(tmp_path / "stack", duration_s=60, seed=7, kill_every_s=(4.0, 9.0), junk_every_s=1.5,
                  trials=8, drain_s=600)
    s = result["summary"]
    assert s["kills"] >= 3 and s["junk_entries"] >= 20, s
    odd = [a for a in result["jobs"] if a["job_id"] in result["unaccounted"]]
    assert s["jobs"] >= 2 and s["jobs_unaccounted"] == 0, (odd, s)
    assert s["lost"] == 0 and s["duplicated"] == 0, result["jobs"]
    assert s["workers_given_up"] == 0, result["given_up"]
    assert s["dead_letters"] >= s["junk_entries"]  # every junk entry popped, refused and kept

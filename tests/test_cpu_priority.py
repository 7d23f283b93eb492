"""Lanes time kernels at the host's normal CPU priority; every other worker gives way to them
(shared/cpu_priority.py, CommonSettings.batch_priority): real processes of the session's stack, and a
job's result saying how widely its full timings' repeats spread (shared.ranking)."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from shared.ranking import repeat_spread, spread_summary

BATCH_ROLES = ("builder.", "planner", "tuner", "updater")


def _in_child(priority: str) -> str:
    code = ("from shared.cpu_priority import yield_cpu, current\n"
            f"got = yield_cpu({priority!r})\n"
            "assert got == current(), (got, current())\n"
            "print(got)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's")
def test_each_priority_is_what_the_process_gets():
    assert _in_child("idle") == "idle"
    assert _in_child("low") == "low"
    assert _in_child("normal") == "normal"


def test_an_unknown_priority_is_refused_by_the_settings():
    from pydantic import ValidationError

    from shared.settings import CommonSettings

    with pytest.raises(ValidationError, match="batch_priority"):
        CommonSettings(batch_priority="realtime")


def _worker_name(pid: int) -> str | None:
    """The Celery node name (-n) a worker process runs under."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().decode().split("\0")
    except OSError:
        return None
    return argv[argv.index("-n") + 1] if "-n" in argv else None


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE") or not os.path.isdir("/proc"), reason="Linux's scheduler")
def test_the_stack_runs_lanes_normal_and_every_other_worker_idle(stack):
    """(A builder's own: tests/test_builders.py.)"""
    from shared.cpu_priority import current

    seen: dict[str, str] = {}
    deadline = time.time() + 120  # a worker execs Celery after its entry point has set its priority
    while time.time() < deadline:
        seen = {}
        for proc in stack.procs.values():
            name = proc.poll() is None and _worker_name(proc.pid)
            if name:
                seen[name] = current(proc.pid)
        if any(n.startswith("lane.") for n in seen) and any(n.startswith("tuner") for n in seen):
            break
        time.sleep(1)
    lanes = {n: p for n, p in seen.items() if n.startswith("lane.")}
    batch = {n: p for n, p in seen.items() if n.startswith(BATCH_ROLES)}
    assert lanes and set(lanes.values()) == {"normal"}, seen
    assert {n.split(".")[0].rstrip("0123456789") for n in batch} >= {"planner", "tuner", "updater"}, seen
    assert set(batch.values()) == {"idle"}, seen


def test_repeat_spread():
    assert repeat_spread([1.0, 1.1, 0.9]) == pytest.approx(0.2)
    assert repeat_spread([2e-6]) is None and repeat_spread(None) is None and repeat_spread([0.0, 0.0]) is None
    assert spread_summary([]) == {}
    summary = spread_summary([0.01 * i for i in range(1, 11)])
    assert summary == {"timings": 10, "p50": 0.06, "p90": 0.1}


def test_a_job_counts_the_spread_of_its_own_full_timings(redis_conn):
    """Only the job's valid full timings count, as the search measured them (a re-timed record's first figures)."""
    import uuid

    from services.tuner.search import timing_counts
    from shared import store
    from shared.messages import JobTask, Record

    job, wkey = f"spread-{uuid.uuid4().hex[:8]}", f"spread-w-{uuid.uuid4().hex[:8]}"

    def put(run_secs, **kw):
        store.put_record(redis_conn, Record(wkey=wkey, candidate_key=uuid.uuid4().hex, run_secs=run_secs, trace="{}",
                                            target="llvm", args_info=[], share=100, **{"job_id": job, **kw}))

    put([1e-5, 1.02e-5, 1e-5])  # a short kernel: 0.02
    put([1.0, 1.5, 1.1], shared_run_secs=[2.0, 2.0, 2.2], retimed_at=1.0)  # counted as measured: 0.1
    put([5.0, 9.0, 5.0], timing="brief")
    put(None, error="run failed: x")
    put([1.0, 2.0, 3.0], job_id="another job")
    put([3e-6])  # one repeat: no spread
    timings, spread = timing_counts(redis_conn, job, [JobTask(task_id=wkey, name="t", weight=1, wkey=wkey)])
    assert timings == {"full": 3, "brief": 1}
    assert spread == {"timings": 2, "p50": 0.1, "p90": 0.1, "short_timings": 1, "short_p50": 0.02, "short_p90": 0.02}


def test_the_timing_line_says_how_widely_the_repeats_spread_and_when_that_is_noisy():
    from types import SimpleNamespace

    from sharetune.progress import timing_line

    quiet = SimpleNamespace(timings={"full": 3, "brief": 1}, timing_spread={"timings": 3, "p50": 0.001, "p90": 0.004})
    assert timing_line(quiet).endswith("repeats within 0.1 % (median), 0.4 % (p90)")
    noisy = SimpleNamespace(timings={"full": 3, "brief": 1}, timing_spread={"timings": 3, "p50": 0.04, "p90": 0.4})
    assert "40.0 % (p90) - noisy" in timing_line(noisy)
    one_repeat = SimpleNamespace(timings={"full": 3, "brief": 0}, timing_spread={})  # a CPU lane: one repeat
    assert timing_line(one_repeat) == "timing: 3 candidates timed fully, 0 screened out after a brief timing (0 %)"

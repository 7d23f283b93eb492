"""The operator's side (issue 14, part 2): a missing Redis, bad numbers, the default share, a job
waiting for lanes, budget advice, and the end-to-end latency in `sharetune results`."""
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cli(*args, redis_url: str, timeout: float = 60):
    env = {**os.environ, "REDIS_URL": redis_url}
    t0 = time.time()
    out = subprocess.run([sys.executable, "-m", "sharetune", *args], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=timeout)
    return out, time.time() - t0


def test_submit_without_redis_fails_fast_with_one_line():
    url = f"redis://127.0.0.1:{_unused_port()}/0"
    out, elapsed = _cli("submit", "tiny", redis_url=url)
    assert elapsed < 30, elapsed  # it gives up at once, not after the services' 60 s outage window
    assert out.returncode != 0
    assert "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and url in lines[0] and "cannot reach Redis" in lines[0], out.stderr


BAD_NUMBERS = [(["--trials", "0"], "--trials"), (["--trials", "-3"], "--trials"), (["--per-iter", "0"], "--per-iter"),
               (["--clients", "0"], "--clients"), (["--retime-top-k", "-1"], "--retime-top-k")]


def test_bad_numbers_are_one_line_before_the_model_is_converted(stack):
    # a model name that would fail conversion: the number's error is what is reported, so it came first
    for args, flag in BAD_NUMBERS:
        out, _ = _cli("submit", "no_such_model_anywhere", *args, redis_url=stack.redis_url)
        assert out.returncode == 2, out.stderr
        assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
        assert flag in out.stderr and "no_such_model" not in out.stderr, out.stderr


def test_bad_numbers_through_the_client(client):
    import pytest

    from shared.errors import SpecError

    with pytest.raises(SpecError, match="trials per round"):
        client.submit("no_such_model_anywhere", trials=8, trials_per_iter=0)


def test_default_share_is_the_live_lanes_share(client, lane_share):
    job = client.submit("tiny", trials=4, trials_per_iter=4, seed=11)
    assert job.status()["share"] == lane_share
    job.cancel()


def test_a_share_no_lane_serves_is_refused_naming_the_served_shares(stack, client, lane_share):
    import pytest

    from shared.errors import ShareError

    unserved = 7 if lane_share != 7 else 9
    with pytest.raises(ShareError, match=rf"no live cpu lane serves {unserved} %.*serve {lane_share} %"):
        client.submit("no_such_model_anywhere", share=unserved, trials=4)  # refused before conversion
    out, _ = _cli("submit", "tiny", "--share", str(unserved), redis_url=stack.redis_url)
    assert out.returncode == 2 and "Traceback" not in out.stderr and f"serve {lane_share} %" in out.stderr, out.stderr


SMALL_BUDGET_JOB = []  # the parking test's second job (4 trials at 4 a round), reused below


def test_a_job_parked_for_lanes_does_not_block_the_next(client, lane_share):
    unserved = 7 if lane_share != 7 else 9
    parked = client.submit("tiny", share=unserved, trials=4, trials_per_iter=4, wait_for_lanes=True)
    deadline = time.time() + 120
    while not parked.status()["waiting_for"]:
        assert time.time() < deadline, parked.state()
        time.sleep(0.5)
    assert parked.status()["waiting_for"] == f"a live cpu lane at {unserved} %"
    nxt = client.submit("tiny", trials=4, trials_per_iter=4, seed=12)
    assert nxt.wait(timeout_s=600)["state"] == "done"
    SMALL_BUDGET_JOB.append(nxt)
    assert parked.state()["state"] == "planning"  # still waiting, while the other job was planned and done
    assert parked.cancel() == "cancelled"
    time.sleep(4)  # the parked plan message comes back once more and is dropped
    assert parked.state()["state"] == "cancelled"


def test_budget_advice_rule():
    from services.tuner.planner import budget_advice

    assert budget_advice(64, 16, 4) is None
    assert budget_advice(32, 16, 10) == ("32 trials at 16 a round give each of the 10 tasks a first round of "
                                         "3 candidates; 160 trials (--trials 160) give every task a full round")
    assert "reach 3 of the 5 tasks with one candidate each" in budget_advice(3, 4, 5)


def test_small_budget_is_advised_and_results_show_end_to_end_latency(stack, client, lane_share):
    job = SMALL_BUDGET_JOB[0] if SMALL_BUDGET_JOB else client.submit("tiny", trials=4, trials_per_iter=4, seed=12)
    assert job.wait(timeout_s=600)["state"] == "done"
    st = job.status()
    n = len(st["tasks"])
    assert n >= 2  # tiny: a conv and a matmul
    assert st["advice"] and f"--trials {4 * n}" in st["advice"], st
    out, _ = _cli("results", job.job_id, redis_url=stack.redis_url, timeout=300)
    assert out.returncode == 0, out.stderr
    assert f"budget advice: 4 trials at 4 a round give each of the {n} tasks a first round of {4 // n} candidate" in out.stdout, out.stdout
    # the small budget left no task out (a task whose schedules an earlier job measured reuses them)
    assert all(t["trials"] >= 1 or t["reused_trials"] >= 1 for t in st["tasks"]), st["tasks"]
    line = next(l for l in out.stdout.splitlines() if l.startswith("end-to-end latency"))
    assert "tuned" in line and "untuned" in line and line.endswith("x"), line
    lat = job.latency_us()  # kept in the job's state: the same figures again
    assert lat["tuned"] > 0 and lat["untuned"] > 0 and lat["cores"] >= 1
    status, _ = _cli("status", job.job_id, redis_url=stack.redis_url)
    assert "budget advice" in status.stdout
    from fastapi.testclient import TestClient

    from sharetune.api import make_app

    assert TestClient(make_app(client=client)).get(f"/jobs/{job.job_id}").json()["advice"] == st["advice"]

"""The node agent as compose, Kubernetes and `up --join` run it: its own process against a real Redis, real
lane and builder processes. It restarts a lane and a builder killed with SIGKILL, keeps its liveness key, and
on SIGTERM stops what it started. (Its GPU recovery, the same code under `up` and alone:
tests/test_gpu_recovery.py.)"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from services.measurer.agent import alive as _alive
from shared import store

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _until(what, check, timeout_s=240.0):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def redis_url(tmp_path):
    from services.broker.server import EmbeddedRedis

    server = EmbeddedRedis(tmp_path / "redis").start()
    try:
        yield server.url
    finally:
        server.stop()


def test_the_agent_restarts_a_killed_lane_and_builder_and_stops_what_it_started(tmp_path, redis_url):
    r = store.connect(redis_url)
    lane = "measure.cpu.c1" if (os.cpu_count() or 1) >= 2 else "measure.cpu.c0"
    env = dict(os.environ, REDIS_URL=redis_url, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    agent = subprocess.Popen([sys.executable, "-m", "services.measurer.agent", "--lanes", lane, "--builders", "1",
                              "--work-dir", str(tmp_path / "agent")], cwd=REPO, env=env, start_new_session=True,
                             stdout=open(tmp_path / "agent.log", "wb"), stderr=subprocess.STDOUT)
    try:
        info = _until("the agent's liveness key", lambda: next(iter(store.live_agents(r)), None))
        assert info.pid == agent.pid and len(info.lanes) == 1 and info.builders == 1
        old_lane = _until("its lane", lambda: next(iter(store.live_lanes(r)), None))
        old_builder = _until("its builder", lambda: next(iter(store.live_builders(r)), None))

        # both killed at once: the agent starts each again (they come back side by side, not one after the other)
        os.kill(old_lane.pid, signal.SIGKILL)
        os.kill(old_builder.pid, signal.SIGKILL)
        new_lane = _until("the lane started again", lambda: next(
            (l.pid for l in store.live_lanes(r) if l.pid != old_lane.pid), None))
        # the dead lane's key went when the agent saw it exit, not at its TTL (30 s after its last beat)
        assert not store.lane_worker_alive(r, old_lane.queue, old_lane.worker)
        new_builder = _until("the builder started again", lambda: next(
            (b.pid for b in store.live_builders(r) if b.pid != old_builder.pid), None))
        assert old_builder.worker not in {b.worker for b in store.live_builders(r)}
        assert _until("the agent counting both restarts",
                      lambda: next((a for a in store.live_agents(r) if a.restarts >= 2), None))

        agent.send_signal(signal.SIGTERM)
        assert agent.wait(60) == 0
        assert store.live_agents(r) == []  # retired at once, not left to its TTL
        assert not _alive(new_lane) and not _alive(new_builder)
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
            agent.wait()
        print((tmp_path / "agent.log").read_text()[-3000:])


def test_a_dead_workers_liveness_keys_are_forgotten_and_no_others(redis_url):
    from shared.messages import BuilderInfo, LaneInfo

    r = store.connect(redis_url)
    for pid in (11, 12):
        store.announce_lane(r, LaneInfo(queue="measure.cpu.c0", kind="cpu", share=50, target="{}", host="h", pid=pid,
                                        started_at=time.time()))
        store.announce_builder(r, BuilderInfo(family="llvm.x86-64", host="h", pid=pid, started_at=time.time()))
    assert len(store.forget_worker(r, "h.11")) == 2
    assert [l.pid for l in store.live_lanes(r)] == [12] and [b.pid for b in store.live_builders(r)] == [12]
    assert store.forget_worker(r, "h.11") == []


def test_an_agent_without_redis_or_with_a_bad_lane_spec_says_why(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    out = subprocess.run([sys.executable, "-m", "services.measurer.agent", "--lanes", "cpu"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "no Redis URL" in out.stderr
    out = subprocess.run([sys.executable, "-m", "services.measurer.agent", "--lanes", "3x50",
                          "--redis-url", "redis://127.0.0.1:1/0"], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode != 0 and "agent:" in out.stderr


def test_stop_all_terms_every_group_at_once_and_kills_one_that_outlives_the_wait(tmp_path):
    """Every process group gets its SIGTERM before any is waited for; one that ignores it is SIGKILLed once the
    wait is over, and nothing is left behind."""
    from services.measurer.agent.processes import NodeConfig, ProcessSupervisor

    sup = ProcessSupervisor(NodeConfig(tmp_path, None), lambda: dict(os.environ))
    stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(600)"
    sup.spawn("plain", [sys.executable, "-c", "import time; time.sleep(600)"])
    sup.spawn("stubborn", [sys.executable, "-c", stubborn])
    procs = dict(sup.procs)
    _until("the stubborn one ignoring SIGTERM", lambda: "ready" in (tmp_path / "logs" / "stubborn.log").read_text(),
           timeout_s=60)
    sup.stop_all(timeout_s=2.0)
    assert procs["plain"].returncode == -signal.SIGTERM and procs["stubborn"].returncode == -signal.SIGKILL
    assert sup.procs == {} and not any(_alive(p.pid) for p in procs.values())

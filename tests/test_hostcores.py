"""Core ownership on this host: a lane's cores are held while its process lives (flock), and a second timer
on them is refused with the holder named (or, with the "warn" policy, told)."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

from shared import hostcores


def test_a_held_core_is_refused_with_its_holder_and_free_again_once_released(tmp_path):
    first = hostcores.claim([0, 1], "lane measure.cpu.local.p50.c0-1 (pid 1 on a)", tmp_path)
    with pytest.raises(hostcores.CoresTaken, match=r"core 1 held by lane measure.cpu.local.p50.c0-1 \(pid 1 on a\)"):
        hostcores.claim([1, 2], "lane b", tmp_path)
    assert hostcores.claim([2], "lane c", tmp_path).cores == [2]  # the refused claim kept nothing
    assert hostcores.holders([0, 1, 2, 3], tmp_path).keys() == {0, 1}  # lane c's claim was dropped with its object
    warned = hostcores.claim([1, 3], "lane d", tmp_path, policy="warn")
    assert warned.cores == [3] and list(warned.overlaps) == [1]
    first.release()
    assert hostcores.claim([0, 1], "lane e", tmp_path).cores == [0, 1]


def test_a_killed_holder_leaves_no_stale_claim(tmp_path):
    code = ("import sys, time; from shared import hostcores; "
            f"c = hostcores.claim([5], 'lane x', {str(tmp_path)!r}); print('held', flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        assert hostcores.holders([5], tmp_path) == {5: "lane x"}
    finally:
        proc.kill()
        proc.wait()
    assert hostcores.holders([5], tmp_path) == {}  # the kernel dropped the lock with the process
    assert hostcores.claim([5], "lane y", tmp_path).cores == [5]


def test_a_stack_on_held_cores_is_refused_before_it_starts_anything(tmp_path, monkeypatch):
    from shared.settings import StackSettings
    from sharetune.stack.local import Stack

    monkeypatch.setenv("SHARETUNE_CORE_OVERLAP", "refuse")
    monkeypatch.setenv("SHARETUNE_CORE_LOCK_DIR", str(tmp_path / "locks"))
    held = hostcores.claim([0], "lane measure.cpu.local.p50.c0 (pid 7 on h)", tmp_path / "locks")
    st = Stack(tmp_path / "stack", lanes=["measure.cpu.c0"], settings=StackSettings())
    with pytest.raises(hostcores.CoresTaken, match="another process holds: core 0 held by lane .*pid 7"):
        st.start()
    assert st.redis_server is None and not st.procs  # nothing was started
    with pytest.raises(hostcores.CoresTaken, match="both time on core 1"):
        Stack(tmp_path / "two", lanes=["measure.cpu.c1", "measure.cpu.c1"], settings=StackSettings()).start()
    held.release()
    monkeypatch.setenv("SHARETUNE_CORE_OVERLAP", "warn")  # told by the lanes, not refused
    Stack(tmp_path / "three", lanes=["measure.cpu.c1", "measure.cpu.c1"], settings=StackSettings()).check_cores()


def test_a_lane_takes_its_cores_before_it_measures(tmp_path, monkeypatch):
    """The lane process's own step (services.measurer.worker.LaneWorker.start): refused on a held core."""
    from services.measurer.worker import LaneWorker
    from shared import lanes
    from shared.settings import LaneSettings

    held = hostcores.claim([0], "lane other (pid 9 on h)", tmp_path)
    s = LaneSettings(core_lock_dir=str(tmp_path), core_overlap="refuse", warmup=False)
    worker = LaneWorker(s, lanes.parse("measure.cpu.c0", s.host()), redis=None, sandboxed=False)
    with pytest.raises(hostcores.CoresTaken, match="lane other"):
        worker.start()
    held.release()


@pytest.fixture
def redis_url(tmp_path):
    from services.broker.server import EmbeddedRedis

    server = EmbeddedRedis(tmp_path / "redis").start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.mark.e2e
def test_a_lane_process_on_held_cores_exits_with_the_reason_before_it_serves(tmp_path, redis_url):
    """The whole lane process (`python -m services.measurer`): a start-up step that fails ends the worker,
    it does not go on consuming its queue without its cores."""
    import os
    import sys

    from shared import store

    held = hostcores.claim([0], "lane other (pid 9 on h)", tmp_path)
    env = {**os.environ, "REDIS_URL": redis_url, "SHARETUNE_CORE_LOCK_DIR": str(tmp_path),
           "SHARETUNE_CORE_OVERLAP": "refuse"}
    try:
        out = subprocess.run([sys.executable, "-m", "services.measurer", "--lane", "measure.cpu.c0"], env=env,
                             capture_output=True, text=True, timeout=120)
    finally:
        held.release()
    assert out.returncode == 3, out.stderr[-2000:]
    assert "start-up failed, exiting: CoresTaken" in out.stderr and "lane other" in out.stderr
    r = store.connect(redis_url)
    assert not [l for l in store.live_lanes(r) if l.queue.endswith(".c0")]  # never announced


@pytest.mark.e2e
def test_a_lane_slot_is_never_served_twice(tmp_path, redis_url):
    """Replicas of one CPU lane service (`python -m services.measurer`, no lane named) on a one-core pool: the
    first claims the slot and serves; a second is refused with the reason; once another replica holds the
    first one's slot (its claim lapsed unseen), the first exits at once (shared.exits.CLAIM_LOST)."""
    import os
    import socket
    import sys

    from shared import exits, names, store

    env = {**os.environ, "REDIS_URL": redis_url, "SHARETUNE_CORE_LOCK_DIR": str(tmp_path),
           "SHARETUNE_LANE_CORES": "1", "SHARETUNE_NODE": "slot-test", "SHARETUNE_WARMUP": "0"}
    env.pop("SHARETUNE_LANE", None)
    one_core = min(os.sched_getaffinity(0))

    def replica(**kw):
        return subprocess.Popen([sys.executable, "-m", "services.measurer"], env=env, text=True,
                                preexec_fn=lambda: os.sched_setaffinity(0, {one_core}), **kw)

    r = store.connect(redis_url)
    claim = names.lane_claim_key("cpu-slot-test", 0)
    first = replica(stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        me = f"{socket.gethostname()}.{first.pid}"
        deadline = time.time() + 120
        while not any(l.pid == first.pid for l in store.live_lanes(r)) and time.time() < deadline:
            assert first.poll() is None, first.stderr.read()[-2000:]
            time.sleep(0.5)
        assert r.get(claim) in (me, me.encode())
        second = replica(stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        out, _ = second.communicate(timeout=120)
        assert second.returncode not in (0, None) and "held by live replicas" in out, out[-2000:]
        r.set(claim, "another-host.1", ex=120)  # a replica that took the slot while this one's claim had lapsed
        first.wait(timeout=60)
        err = first.stderr.read()
        assert first.returncode == exits.CLAIM_LOST, err[-2000:]
        assert "held by another replica now" in err
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()

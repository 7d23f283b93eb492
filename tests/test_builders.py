"""Builder workers: stateless processes that build candidates for a target family and forward them to the
lanes, which then only time them. Real Redis, real Celery workers, real TVM builds."""
from __future__ import annotations

import base64
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shared import lanes, names, store
from shared.messages import Artifact, Candidate, MeasureBatch, TimingConfig

REPO = Path(__file__).resolve().parent.parent


def _start_builder(stack, tmp_path, family="llvm") -> subprocess.Popen:
    """A builder joining the stack the way one on another host would: its own process group, only the
    stack's REDIS_URL."""
    env = dict(os.environ, REDIS_URL=stack.redis_url, PYTHONPATH=str(REPO))
    log = open(tmp_path / "builder.log", "ab")
    return subprocess.Popen([sys.executable, "-m", "services.measurer", "--builder", family, "--loglevel", "INFO"],
                            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _wait_builder(r, proc, timeout_s=300.0):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        mine = [b for b in store.live_builders(r) if b.pid == proc.pid]
        if mine:
            return mine[0]
        assert proc.poll() is None, "the builder exited at start"
        time.sleep(0.3)
    raise AssertionError("the builder did not come up")


def _end(proc):
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)


def _retire(redis_conn, proc) -> None:
    for b in store.live_builders(redis_conn):  # its liveness key, so later tests build on their lanes
        if b.pid == proc.pid:
            store.retire_builder(redis_conn, b)


@pytest.fixture(scope="module")
def builder(stack, redis_conn, tmp_path_factory):
    """One builder process for the module's builder tests (the last of them kills it)."""
    proc = _start_builder(stack, tmp_path_factory.mktemp("builder"))
    try:
        yield proc, _wait_builder(redis_conn, proc)
    finally:
        _end(proc)
        _retire(redis_conn, proc)


def _records(r, job):
    return [rec for t in store.job_tasks(r, job.job_id) for rec in store.records(r, t.wkey) if rec.job_id == job.job_id]


def test_a_builder_on_its_own_builds_for_the_cpu_lanes(builder, client, redis_conn, lane_share):
    proc, info = builder
    assert info.family == lanes.target_family(client.lanes()[0].target)
    if hasattr(os, "SCHED_IDLE"):  # it builds on the CPU the lanes leave (CommonSettings.batch_priority)
        from shared.cpu_priority import current

        assert current(proc.pid) == "idle"
    job = client.submit("tiny", target="llvm", share=lane_share, trials=12, trials_per_iter=6, seed=3)
    assert job.wait(timeout_s=600)["state"] == "done"
    recs = _records(redis_conn, job)
    assert len(recs) == 12
    assert sum(r.error is None for r in recs) >= 10
    after = next(b for b in store.live_builders(redis_conn) if b.pid == proc.pid)
    assert after.built >= 10  # the lanes timed what the builder built


def test_a_builder_killed_mid_batch_loses_no_candidate(builder, client, redis_conn, lane_share):
    proc, _ = builder
    before = next(b for b in store.live_builders(redis_conn) if b.pid == proc.pid).built  # the earlier test's builds
    job = client.submit("tiny", target="llvm", share=lane_share, trials=16, trials_per_iter=8, seed=4)
    deadline = time.time() + 300
    while time.time() < deadline:  # kill it once it has built something of this job and more is queued or building
        mine = [b for b in store.live_builders(redis_conn) if b.pid == proc.pid]
        if mine and mine[0].built > before:
            break
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)
    try:
        assert job.wait(timeout_s=600)["state"] == "done"
    finally:
        _retire(redis_conn, proc)  # the dead builder's key, once its candidates have gone elsewhere: not into the next test
    recs = _records(redis_conn, job)
    assert len(recs) == 16  # every claimed trial recorded
    assert not [r for r in recs if r.error and "builder" in r.error]  # re-sent to a lane, which built it


def test_without_a_builder_the_lane_builds_itself(client, redis_conn, lane_share):
    assert not store.live_builders(redis_conn)
    job = client.submit("tiny", target="llvm", share=lane_share, trials=4, trials_per_iter=4, seed=5)
    assert job.wait(timeout_s=600)["state"] == "done"
    assert sum(r.error is None for r in _records(redis_conn, job)) >= 3


def _artifact_batch(redis_conn, client):
    """Two built candidates of a trivial kernel for the first lane: (lane queue, batch)."""
    import tvm

    from services.measurer.metaschedule.candidate_codec import dump_ir
    from services.measurer.metaschedule.build import build_artifact, trivial_kernel
    from services.measurer.metaschedule.targets import target_from_json

    lane = client.lanes()[0]
    target = target_from_json(lane.target)
    mod = dump_ir(trivial_kernel(target))
    args = [["TENSOR", "float32", [64]], ["TENSOR", "float32", [64]]]
    cands = []
    for cid in ("good", "corrupt", "oversized"):
        art, err, _ = build_artifact(Candidate(candidate_id=cid, mod=mod, args_info=args), target)
        assert err is None, err
        cands.append(Candidate(candidate_id=cid, mod=mod, args_info=args, artifact=art))
    data = bytearray(base64.b64decode(cands[1].artifact.data))
    data[len(data) // 2] ^= 0xFF  # one flipped byte in transit
    cands[1].artifact.data = base64.b64encode(bytes(data)).decode()
    cands[2].artifact.size = 64 * 1024 * 1024
    batch = MeasureBatch(batch_id=f"artifacts-{time.time_ns()}", job_id="artifact-test", target=lane.target,
                         timing=TimingConfig(number=1, repeat=1, min_repeat_ms=0, timeout_s=60), candidates=cands)
    return lane.queue, batch, tvm


def test_a_corrupted_or_oversized_artifact_is_that_candidates_error(stack, client, redis_conn):
    from services.celery_app import make_celery

    queue, batch, _ = _artifact_batch(redis_conn, client)
    make_celery("test-artifacts", stack.redis_url).send_task(names.MEASURE_TASK, args=[batch.model_dump(mode="json")],
                                                             queue=queue)
    deadline = time.time() + 300
    results = {}
    while time.time() < deadline and len(results) < 3:
        _, results = store.batch_results(redis_conn, batch.batch_id)
        time.sleep(0.2)
    assert results["good"].error is None and results["good"].run_secs
    assert "checksum mismatch" in results["corrupt"].error and results["corrupt"].error.startswith("artifact refused")
    assert "exceeds the limit" in results["oversized"].error


def test_artifact_checks_name_the_problem():
    from services.measurer.metaschedule.artifact import artifact_bytes

    data = b"\x7fELF not really a library"
    ok = Artifact(data=base64.b64encode(data).decode(), size=len(data), sha256=__import__("hashlib").sha256(data).hexdigest())
    assert artifact_bytes(ok) == data
    with pytest.raises(ValueError, match="not valid base64"):
        artifact_bytes(ok.model_copy(update={"data": "@@@"}))
    with pytest.raises(ValueError, match="header says"):
        artifact_bytes(ok.model_copy(update={"size": 3}))


def test_families_and_queues():
    assert lanes.target_family('{"kind": "cuda", "arch": "sm_90", "max_threads_per_block": 1024}') == "cuda.sm_90"
    assert names.build_queue(lanes.target_family({"kind": "llvm", "mcpu": "Znver4"})) == "build.llvm.znver4"
    with pytest.raises(ValueError, match="explicit arch"):
        lanes.target_family({"kind": "cuda"})
    with pytest.raises(ValueError, match="not a build family"):
        names.build_queue("rocm.gfx90a")


def test_lane_utilisation_is_each_lanes_busy_clock():
    from shared.messages import LaneBatch, lane_utilisation

    b = lambda lane, w, s, e, n=1: LaneBatch(batch_id=f"{lane}{s}", lane=lane, worker=w, started_at=s, finished_at=e,  # noqa: E731
                                            candidates=n)
    stats = lane_utilisation([b("a", "h.1", 0, 2), b("a", "h.1", 6, 10, 3), b("b", "h.2", 1, 2)])
    assert stats["span_s"] == 10
    assert stats["per_lane"]["a/h.1"] == {"busy_s": 6.0, "busy_frac": 0.6, "candidates": 4}
    assert stats["per_lane"]["b/h.2"]["busy_frac"] == 0.1
    assert stats["mean_busy_frac"] == 0.35
    assert lane_utilisation([]) == {}

"""A suspect candidate runs alone on its GPU (services.measurer.isolation), on real Redis: lanes are threads
here, each with its own gate, as lane processes of one GPU would be."""
import threading
import time
import uuid

import pytest

from services.measurer.isolation import GpuGate, attribute, judge, runs_alone
from shared import names


def _gpu() -> str:
    return uuid.uuid4().hex[:8]


def test_a_suspect_never_overlaps_a_neighbours_candidate(redis_conn):
    gpu = _gpu()
    spans, lock, stop = [], threading.Lock(), threading.Event()

    def neighbour(i):
        gate = GpuGate(redis_conn, gpu, f"lane{i}", hold_s=30, poll_s=0.001)
        while not stop.is_set():
            with gate.ordinary():
                t0 = time.monotonic()
                time.sleep(0.003)
                with lock:
                    spans.append(("ordinary", t0, time.monotonic()))

    threads = [threading.Thread(target=neighbour, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    suspect = GpuGate(redis_conn, gpu, "suspect", hold_s=30, poll_s=0.001)
    alone = []
    try:
        for _ in range(5):
            with suspect.alone():
                t0 = time.monotonic()
                time.sleep(0.02)
                alone.append((t0, time.monotonic()))
            time.sleep(0.01)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert len(spans) > 10 and len(alone) == 5
    overlapping = [(a, s) for a in alone for s in spans if s[1] < a[1] and a[0] < s[2]]
    assert not overlapping, overlapping[:3]
    assert not redis_conn.exists(names.gpu_gate_key(gpu))  # the gate is given back
    assert not redis_conn.hgetall(names.gpu_running_key(gpu))


def test_neighbours_hold_back_while_a_suspect_runs(redis_conn):
    gpu = _gpu()
    order = []
    entered = threading.Event()

    def later():
        entered.wait()
        with GpuGate(redis_conn, gpu, "lane1", hold_s=30, poll_s=0.001).ordinary():
            order.append("neighbour")

    t = threading.Thread(target=later)
    t.start()
    with GpuGate(redis_conn, gpu, "lane0", hold_s=30, poll_s=0.001).alone():
        entered.set()
        time.sleep(0.2)
        order.append("suspect done")
    t.join()
    assert order == ["suspect done", "neighbour"]


def test_a_dead_lanes_gate_and_running_entry_lapse(redis_conn):
    gpu = _gpu()
    past = time.time() - 1
    # a lane that died holding the gate, another that died mid-candidate: both deadlines are past
    redis_conn.hset(names.gpu_gate_key(gpu), mapping={"holder": "dead0", "until": past})
    redis_conn.hset(names.gpu_running_key(gpu), "dead1", past)
    with GpuGate(redis_conn, gpu, "lane0", hold_s=30).ordinary():
        pass
    with GpuGate(redis_conn, gpu, "lane1", hold_s=30).alone() as g:
        assert g.waited_s < 5
    # a live running entry is waited for, and only for its lane's candidate
    redis_conn.hset(names.gpu_running_key(gpu), "busy", time.time() + 30)
    done = threading.Event()
    t = threading.Thread(target=lambda: (GpuGate(redis_conn, gpu, "lane2", hold_s=30).alone().__enter__(), done.set()))
    t.start()
    assert not done.wait(0.3)
    redis_conn.hdel(names.gpu_running_key(gpu), "busy")
    assert done.wait(5)
    t.join()


def test_a_suspect_that_faults_alone_is_the_culprit():
    assert attribute("unknown", ran_alone=True) == "culprit"
    assert attribute("unknown", ran_alone=False) == "unknown"  # in flight beside others: only a suspect
    assert attribute("victim", ran_alone=True) == "victim"  # an error naming an outside fault: no blame
    assert attribute("culprit", ran_alone=False) == "culprit"  # the GPU's only lane: its own kernel
    # beside other lanes of its GPU the same error 700 reaches every MPS client: only a suspect, re-run alone
    assert attribute("culprit", ran_alone=False, shared_gpu=True) == "unknown"
    assert attribute("culprit", ran_alone=True, shared_gpu=True) == "culprit"
    assert attribute(None, ran_alone=True) is None


ERROR_700 = "run failed: CUDA: an illegal memory access was encountered (700)"


@pytest.mark.parametrize("culprit", range(4))
def test_attribution_finds_the_culprit_in_at_most_four_solo_runs_and_clears_the_rest(culprit):
    """Pure policy, a fake GPU: four lanes of one GPU each had a candidate in flight when the GPU faulted,
    and under MPS all four saw the same error 700. Re-sent, each runs alone; the culprit faults only then."""
    from services.measurer.gpu.faults import classify_cuda_error

    suspects = [f"s{i}" for i in range(4)]
    bad, max_crashes = suspects[culprit], 2
    counts, quarantined, answered = {}, set(), {}

    def outcome(s: str, alone: bool, shared_gpu: bool, error: str | None):
        counts[s] = counts.get(s, 0) + 1  # raised before it runs, as the lane does
        v = judge(classify_cuda_error(error), alone, shared_gpu, counts[s], max_crashes)
        if v.clear:
            counts.pop(s)
        if v.quarantine:
            quarantined.add(s)
        if v.answer:
            answered[s] = error
        return v

    # the incident: every lane's context died with error 700, none of them ran alone
    first = [outcome(s, runs_alone(1), True, ERROR_700) for s in suspects]
    assert all(v.role == "unknown" and not v.answer and v.lane_ends for v in first)
    assert counts == dict.fromkeys(suspects, 1) and not quarantined

    resent, solo_runs = list(suspects), 0
    while resent:
        s = resent.pop(0)
        alone = runs_alone(counts[s] + 1)
        assert alone  # every suspect re-runs alone
        solo_runs += 1
        v = outcome(s, alone, True, ERROR_700 if s == bad else None)
        if not v.answer:
            resent.append(s)
        assert solo_runs <= 4
    assert quarantined == {bad}
    assert answered == {**{s: None for s in suspects if s != bad}, bad: ERROR_700}
    assert counts == {bad: max_crashes}  # innocents cleared; the culprit reached the cap


def test_the_policy_never_quarantines_on_a_shared_fault_and_clears_victims():
    # in flight beside other lanes, however often: a suspect, re-sent, never quarantined
    v = judge("culprit", ran_alone=False, shared_gpu=True, crashes=5, max_crashes=2)
    assert v.role == "unknown" and not v.quarantine and not v.answer and not v.clear
    # alone, below the cap: answered as a crash, its count kept; at the cap: quarantined
    below = judge("unknown", ran_alone=True, shared_gpu=True, crashes=2, max_crashes=3)
    assert below.role == "culprit" and below.answer and not below.quarantine and not below.clear
    assert judge("unknown", ran_alone=True, shared_gpu=True, crashes=3, max_crashes=3).quarantine
    victim = judge("victim", ran_alone=False, shared_gpu=True, crashes=1, max_crashes=2)
    assert victim.clear and not victim.answer and victim.lane_ends
    ok = judge(None, ran_alone=True, shared_gpu=True, crashes=2, max_crashes=2)
    assert ok.answer and ok.clear and not ok.lane_ends
    assert runs_alone(2) and not runs_alone(1)

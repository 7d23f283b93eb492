"""Recovering a faulted GPU without a GPU: which PIDs are ended (a fake process table and a fake MPS
control daemon), when a recovery counts as failed and when a GPU is given up, the hung-kernel watchdog's
decision; and the supervisor end to end on a real Redis with fake lane processes."""
from __future__ import annotations

import json
import signal
import time

import pytest

from services.measurer.gpu.daemon import CommandResult, MpsDaemon, parse_pids
from services.measurer.gpu.faults import Watchdog, run_hung
from shared.timeouts import watchdog_allowance_s
from services.measurer.gpu.recovery import (
    GpuAttempt,
    ProcEntry,
    end_processes,
    give_up_gpu,
    judge_recovery,
    plan_gpu_reset,
    process_family,
)
from shared import names, store
from shared.messages import GpuFault, JobSpec, LaneInfo
from fakes import FakeHost, FakeMps, FakeProc

GPU_A, GPU_B = "3f2a1c9b", "b7c40e52"
UUID_A = "GPU-3f2a1c9b-5d7e-4a10-9c21-6b8e0f4d2a17"
UUID_B = "GPU-b7c40e52-19af-4c3d-8e60-2d5f7a9b1c08"
LANE_A, LANE_B = f"measure.{GPU_A}.p25", f"measure.{GPU_B}.p50"
ME = 50


def _table(*rows):
    return {pid: ProcEntry(pid, ppid, pgid, sid) for pid, ppid, pgid, sid in rows}


# lanes 100, 200 on GPU A (session leaders); 300 on GPU B. 101, 102: 100's build pool; 201: a pool worker of
# lane 200 re-parented to init when 200 exited (same session); 301: 300's pool; 900: a client nobody here
# started; 1: init; 50: the supervisor itself.
TABLE = _table((1, 0, 1, 1), (ME, 1, ME, ME), (100, ME, 100, 100), (101, 100, 100, 100), (102, 100, 100, 100),
               (201, 1, 200, 200), (300, ME, 300, 300), (301, 300, 300, 300), (900, 1, 900, 900),
               (1000, 1, 1000, 1000))
SERVER = 4000


def test_the_family_of_a_lane_holds_its_pool_and_orphans_of_its_session():
    assert process_family(TABLE, [100, 200]) == {100, 101, 102, 201}
    assert process_family(TABLE, [300]) == {300, 301}
    grandchild = {**TABLE, 103: ProcEntry(103, 101, 103, 103)}  # a pool worker that made its own session
    assert 103 in process_family(grandchild, [100])


def test_a_server_of_that_gpu_alone_loses_every_client_and_is_killed():
    reset = plan_gpu_reset(TABLE, [100, 200], [], {SERVER: [100, 101, 201, 900]}, daemon_is_ours=True, me=ME)
    assert reset.end == (100, 101, 102, 201, 900)  # lanes, pools, orphan, the server's unknown client
    assert reset.kill_servers == (SERVER,) and reset.quit_daemon and reset.kept == ()


def test_a_server_shared_with_another_gpus_lanes_keeps_them_and_itself():
    reset = plan_gpu_reset(TABLE, [100, 200], [300], {SERVER: [100, 101, 300, 301, 900, ME]}, daemon_is_ours=True, me=ME)
    assert reset.end == (100, 101, 102, 201)
    assert not set(reset.end) & {300, 301, ME, 1, 1000}
    assert reset.kill_servers == () and reset.kept == (SERVER,) and not reset.quit_daemon


def test_per_gpu_servers_only_the_faulted_ones_goes():
    servers = {4000: [100, 101], 5000: [300, 301]}
    reset = plan_gpu_reset(TABLE, [100, 200], [300], servers, daemon_is_ours=True, me=ME)
    assert reset.kill_servers == (4000,) and reset.kept == (5000,) and not reset.quit_daemon
    assert reset.end == (100, 101, 102, 201)


def test_a_daemon_found_running_is_never_quit():
    assert not plan_gpu_reset(TABLE, [100], [], {SERVER: [100]}, daemon_is_ours=False, me=ME).quit_daemon


def test_the_daemon_reports_servers_and_their_clients(tmp_path):
    calls = []

    def runner(argv, env, stdin, timeout):
        calls.append(stdin)
        assert env["CUDA_MPS_PIPE_DIRECTORY"] == str(tmp_path / "pipe")
        if stdin == "get_server_list\n":
            return CommandResult(0, "4000\n5000\n")
        if stdin.startswith("get_client_list "):
            return CommandResult(0, {"4000": "100\n101\n", "5000": ""}[stdin.split()[1]])
        raise AssertionError(stdin)

    daemon = MpsDaemon(tmp_path / "pipe", tmp_path / "log", runner=runner)
    assert daemon.servers() == {4000: [100, 101], 5000: []}
    assert calls == ["get_server_list\n", "get_client_list 4000\n", "get_client_list 5000\n"]
    assert MpsDaemon(tmp_path / "pipe", tmp_path / "log", runner=lambda *a: CommandResult(1, "", "no daemon")).servers() == {}
    assert parse_pids("Server 12\n4000\n\n 77 \n") == [4000, 77]


def test_processes_get_sigterm_then_sigkill_after_the_grace():
    alive = {100: True, 101: True, 102: True}
    stubborn, immortal = {101, 102}, {102}
    sent = []

    def send(pid, sig):
        sent.append((pid, sig))
        if sig == signal.SIGTERM and pid not in stubborn or sig == signal.SIGKILL and pid not in immortal:
            alive[pid] = False

    clock = iter(range(1000))
    out = end_processes([101, 100, 102, 100], grace_s=3, send=send, alive=lambda p: alive[p], sleep=lambda s: None,
                        clock=lambda: next(clock))
    assert out == {"terminated": [100], "killed": [101], "survivors": [102]}
    assert [p for p, s in sent if s == signal.SIGTERM] == [100, 101, 102]
    assert [p for p, s in sent if s == signal.SIGKILL] == [101, 102]


def test_judging_a_recovery():
    a = GpuAttempt(GPU_A, restarted_at=100.0)
    assert judge_recovery(a, 150.0) == "pending"
    assert judge_recovery(a, 500.0, come_back_s=300) == "failed"  # lanes never came back
    assert judge_recovery(a, 110.0, faulted_again_at=110.0) == "failed"  # faulted before lanes were live
    live = GpuAttempt(GPU_A, restarted_at=100.0, live_at=130.0)
    assert judge_recovery(live, 135.0, settle_s=20) == "pending"
    assert judge_recovery(live, 135.0, faulted_again_at=135.0, settle_s=20) == "failed"  # at once
    assert judge_recovery(live, 151.0, settle_s=20) == "ok"
    measuring = GpuAttempt(GPU_A, restarted_at=100.0, live_at=130.0, measured_at=132.0)
    assert judge_recovery(measuring, 133.0) == "ok"
    assert judge_recovery(measuring, 140.0, faulted_again_at=140.0) == "ok"  # a new fault, a new incident
    assert not give_up_gpu(1) and give_up_gpu(2)


def test_the_watchdogs_decision():
    assert not run_hung(100.0, 60.0, 165.0, margin_s=10)
    assert run_hung(100.0, 60.0, 170.5, margin_s=10)
    assert watchdog_allowance_s(60, builds_in_pool=True) == 120 and watchdog_allowance_s(60, False) == 60
    now = [0.0]
    hung = []
    dog = Watchdog(hung.append, margin_s=5, clock=lambda: now[0])
    dog._thread = object()  # no thread: the test drives check() itself
    dog.arm(10, chash="c1")
    now[0] = 14.0
    assert dog.check() is None
    now[0] = 15.5
    assert dog.check()["chash"] == "c1" and dog.check() is None  # reported once
    dog.arm(10, chash="c2")
    dog.disarm()
    now[0] = 100.0
    assert dog.check() is None


def test_the_watchdog_thread_calls_back_on_a_hang():
    hung = []
    dog = Watchdog(hung.append, margin_s=0.05, poll_s=0.01)
    dog.arm(0.05, chash="spins")
    deadline = time.time() + 5
    while not hung and time.time() < deadline:
        time.sleep(0.01)
    assert [h["chash"] for h in hung] == ["spins"]


# ---- the supervisor, on a real Redis --------------------------------------------------------------------

@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    from services.broker.server import EmbeddedRedis

    server = EmbeddedRedis(tmp_path_factory.mktemp("redis")).start()
    try:
        yield server.url
    finally:
        server.stop()


def _stack(tmp_path, redis_url, monkeypatch, layout="up"):
    """`up`: the agent a local stack holds beside its central services; `agent`: the node agent alone, as
    compose and Kubernetes GPU nodes run it. One recovery code path serves both. Its lane processes are fakes
    (spawned by name, never started), the host's process table and signals too."""
    from services.measurer.agent import NodeAgent, NodeConfig
    from shared.settings import AgentSettings
    from sharetune.stack.local import Stack

    lanes = [LANE_A] * 2 + [LANE_B] * 2
    st = (Stack(tmp_path, redis_url=redis_url, lanes=lanes).agent if layout == "up"
          else NodeAgent(NodeConfig(tmp_path, redis_url), AgentSettings(), lanes, supervise=False))
    st.gpus.uuids = {GPU_A: UUID_A, GPU_B: UUID_B}
    pids = iter(range(10_000, 20_000, 10))
    started, ended = [], []

    def spawn(name, args, env=None):
        st.procs[name] = FakeProc(pid=next(pids))
        started.append(name)
        return st.procs[name]

    def table():  # every lane with a two-worker build pool; pool pids are the lane's + 1, + 2
        rows = [(ME, 1, ME, ME), (777, 1, 777, 777)]
        for p in st.procs.values():
            rows += [(p.pid, ME, p.pid, p.pid), (p.pid + 1, p.pid, p.pid, p.pid), (p.pid + 2, p.pid, p.pid, p.pid)]
        return _table(*rows)

    monkeypatch.setattr(st.processes, "spawn", spawn)
    st.gpus.host = FakeHost(table, lambda pids, grace_s=3.0: ended.append(sorted(pids)) or {"terminated": sorted(pids)})
    monkeypatch.setattr("os.getpid", lambda: ME)
    st.gpus.mps = FakeMps(lambda: {SERVER: sorted(p for q in st.procs.values() for p in (q.pid, q.pid + 1)) + [777]})
    for i, q in enumerate(lanes):
        st.start_lane(q, lanes[:i].count(q))
    started.clear()
    return st, started, ended


def _fault(r, lane, at=None, role="culprit"):
    f = GpuFault(gpu8=lane.split(".")[1], lane=lane, worker="h.1", candidate_hash="bad", role=role,
                 error="run failed: CUDA: an illegal memory access was encountered")
    if at is not None:
        f = f.model_copy(update={"at": at})
    store.report_gpu_fault(r, f)


def _announce(r, st, names_, batches=1):
    for n in names_:
        q = st.lane_procs[n][0]
        store.announce_lane(r, LaneInfo(queue=q, kind="gpu", share=25, target="{}", host="h", pid=st.procs[n].pid,
                                        started_at=time.time(), batches=batches))


@pytest.mark.parametrize("layout", ["up", "agent"])
def test_a_fault_ends_that_gpus_clients_only_and_restarts_its_lanes(tmp_path, redis_url, monkeypatch, layout):
    r = store.connect(redis_url)
    r.flushdb()
    st, started, ended = _stack(tmp_path, redis_url, monkeypatch, layout)
    a = [n for n in st.lane_procs if GPU_A in n]
    b_pids = {st.procs[n].pid for n in st.lane_procs if GPU_B in n}
    a_family = {st.procs[n].pid + k for n in a for k in (0, 1, 2)}
    st.procs[a[0]].returncode = names.EXIT_GPU_FAULT  # the culprit's lane left; its pool still runs
    _fault(r, LANE_A)
    since = st.recover_once(0.0)
    assert sorted(started) == sorted(a)  # GPU B's lanes were not restarted
    ended_clients = set(ended[0])
    assert ended_clients == a_family  # lanes + pools (the exited lane's too); not 777: the server is shared
    assert not ended_clients & ({p + k for p in b_pids for k in (0, 1, 2)} | {ME})
    assert st.mps.calls == []  # the server serves GPU B's lanes too: kept, not quit
    event = st.recoveries[-1]
    assert event["gpus"] == [GPU_A] and event["gpu_resets"][GPU_A]["kept_servers"] == [SERVER]
    # the lanes come back and measure: the recovery is judged good, nothing else happens
    _announce(r, st, a)
    st.recover_once(since)
    assert GPU_A not in st.gpus.attempts and st.gpus.failures[GPU_A] == 0 and len(st.recoveries) == 1


def test_a_gpu_that_faults_again_at_once_twice_is_given_up_and_others_go_on(tmp_path, redis_url, monkeypatch):
    r = store.connect(redis_url)
    r.flushdb()
    spec = JobSpec(job_id="job1", target="cuda", share=25, trials=16)
    store.create_job(r, spec, b"model")
    store.put_shards(r, "job1", [], 16)
    store.set_state(r, "job1", "tuning", lanes=[LANE_A])
    st, started, ended = _stack(tmp_path, redis_url, monkeypatch)
    b_names = [n for n in st.lane_procs if GPU_B in n]
    since = 0.0
    for round_ in range(3):  # the first fault, then two restarts whose lanes die at once (805)
        for n in [n for n in st.lane_procs if GPU_A in n]:
            st.procs[n].returncode = names.EXIT_GPU_FAULT
        since = st.recover_once(since)
    event = st.recoveries[-1]
    assert event["gpus_given_up"] == [GPU_A] and event["gpus"] == []
    assert len([e for e in st.recoveries if e["gpus"] == [GPU_A]]) == 2  # restarted twice, then no more
    assert GPU_A in st.gpus.given_up and not [n for n in st.lane_procs if GPU_A in n]
    assert sorted(n for n in st.lane_procs if GPU_B in n) == sorted(b_names)
    assert all(st.procs[n].poll() is None for n in b_names) and not [n for n in started if GPU_B in n]
    down = store.gpus_down(r)[GPU_A]
    assert "given up" in down["error"] and UUID_A in down["error"] and down["lanes"] == [LANE_A]
    assert store.job_state(r, "job1")["gpu_error"] == down["error"]
    # nothing more is done for that GPU, whatever its old lanes report
    _fault(r, LANE_A)
    n_events = len(st.recoveries)
    st.recover_once(since)
    assert len(st.recoveries) == n_events

    from sharetune.client import Client, Job

    client = Client(redis_url)
    status = Job(client, "job1").status()
    assert status["error"] == down["error"] and status["state"] == "tuning"
    assert client.gpus_down() == {GPU_A: down}
    # a later stack whose lanes of that GPU live again: no longer shown as down
    store.announce_lane(r, LaneInfo(queue=LANE_A, kind="gpu", share=25, target="{}", host="h", pid=1,
                                    started_at=time.time() + 1))
    assert client.gpus_down() == {}


def test_the_lanes_view_shows_a_given_up_gpu(redis_url, capsys, monkeypatch):
    from sharetune import cli

    r = store.connect(redis_url)
    r.flushdb()
    store.give_up_gpu(r, GPU_A, "GPU X given up: 2 recoveries in a row failed", [LANE_A])
    monkeypatch.setenv("REDIS_URL", redis_url)
    assert cli.main(["lanes"]) == 0
    assert f"GPU {GPU_A} DOWN" in capsys.readouterr().out
    assert cli.main(["lanes", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows == [{"queue": LANE_A, "kind": "gpu", "down": True, "error": "GPU X given up: 2 recoveries in a row failed",
                     "down_since": pytest.approx(time.time(), abs=60)}]


def test_a_hung_candidate_is_reported_answered_and_the_lane_exits(redis_url, monkeypatch):
    from services.measurer import worker as lane_worker
    from shared import lanes
    from shared.settings import LaneSettings

    r = store.connect(redis_url)
    r.flushdb()
    lane = lane_worker.LaneWorker(LaneSettings(max_crashes=2), lanes.parse(LANE_A), r)  # never started
    exits = []

    def exit_(code):
        exits.append(code)
        raise SystemExit(code)

    monkeypatch.setattr("os._exit", exit_)
    for crashes, batch in ((1, "b1"), (2, "b2")):
        r.hset(names.CRASHES_KEY, "spin", crashes)  # raised before it ran, as the lane does
        armed = {"batch_id": batch, "candidate_id": "c", "chash": "spin", "crashes": crashes, "job_id": "j",
                 "timeout_s": 60.0, "allowance_s": 120.0, "started_at": 0.0}
        with pytest.raises(SystemExit):
            lane.in_process.on_hung_candidate(armed)
        if crashes == 1:
            assert store.crash_count(r, "spin") == 1 and store.quarantined(r, "spin") is None  # count kept
    assert exits == [names.EXIT_GPU_FAULT] * 2
    faults = store.gpu_faults(r, GPU_A)
    assert [f.role for f in faults] == ["culprit", "culprit"] and "hung" in faults[0].error
    first = store.batch_results(r, "b1")[1]["c"]
    assert first.fault == "crash" and "hung" in first.error
    second = store.batch_results(r, "b2")[1]["c"]
    assert second.error.startswith("quarantined after 2 crashes") and store.quarantined(r, "spin").crashes == 2


def test_lanes_restarted_with_their_gpu_are_never_given_up_by_the_crash_loop_budget():
    from services.measurer.gpu.recovery import LaneExit, plan_recovery

    # one GPU recovery per attributed fault: many restarts in the window, each of them progress
    history = {"lane-a": [float(t) for t in range(10)], "lane-c": [float(t) for t in range(10)]}
    exits = [LaneExit("lane-a", LANE_A, names.EXIT_GPU_FAULT, 20.0), LaneExit("lane-c", "measure.cpu.c0", 1, 20.0)]
    plan = plan_recovery(exits, [], history, now=20.0, max_restarts=5, gpu_fault_code=names.EXIT_GPU_FAULT)
    assert plan.gpus == (GPU_A,) and plan.given_up == ("lane-c",) and plan.restart == ()


def test_a_fault_reported_with_a_candidate_after_the_restart_is_a_new_incident():
    from services.measurer.gpu.recovery import measured_by_fault

    restarted = GpuAttempt(GPU_A, restarted_at=100.0)
    fault = GpuFault(gpu8=GPU_A, lane=LANE_A, worker="h.1", candidate_hash="next-suspect", role="culprit",
                     error="run failed: CUDA: an illegal memory access was encountered").model_copy(update={"at": 105.0})
    seen = measured_by_fault(restarted, [fault])
    assert seen.live_at == 105.0 and seen.measured_at == 105.0
    assert judge_recovery(seen, 105.0, faulted_again_at=105.0) == "ok"
    before = fault.model_copy(update={"at": 99.0})  # the incident that caused the restart
    assert measured_by_fault(restarted, [before]) == restarted
    no_candidate = fault.model_copy(update={"candidate_hash": ""})
    assert judge_recovery(measured_by_fault(restarted, [no_candidate]), 105.0, faulted_again_at=105.0) == "failed"


def test_a_recovery_records_its_phases_and_forgets_the_ended_lanes(tmp_path, redis_url, monkeypatch):
    r = store.connect(redis_url)
    r.flushdb()
    st, started, ended = _stack(tmp_path, redis_url, monkeypatch)
    a = [n for n in st.lane_procs if GPU_A in n]
    _announce(r, st, a, batches=0)  # the old lanes, still announced when the GPU faults
    r.hset(names.gpu_running_key(GPU_A), "h.dead", time.time() + 60)  # a dead lane's candidate
    st.procs[a[0]].returncode = names.EXIT_GPU_FAULT
    old = {st.procs[n].pid for n in a}
    _fault(r, LANE_A)
    since = st.recover_once(0.0)
    phases = st.recoveries[-1]["phases"][GPU_A]
    assert phases["fault_at"] <= phases["detected_at"] <= phases["clients_ended_at"] <= phases["lanes_started_at"]
    assert "mps_restarted_at" in phases  # None here: the server serves GPU B too
    assert not [l for l in store.live_lanes(r) if lanes_of_gpu(l, GPU_A)]  # retired: re-sent without the TTL
    assert not r.exists(names.gpu_running_key(GPU_A))
    _announce(r, st, a, batches=1)
    st.recover_once(since)
    assert phases["lanes_live_at"] >= phases["lanes_started_at"] and phases["first_batch_at"]
    assert not old & {st.procs[n].pid for n in a}


def lanes_of_gpu(info, gpu8):
    return info.queue.split(".")[1] == gpu8


def test_a_gpu_lane_clears_the_suspects_that_answer_alone_and_quarantines_the_one_that_faults(redis_url, monkeypatch):
    """The lane's own code path on a fake GPU: four suspects of an earlier incident (count 1 each) are
    re-sent; each runs alone, the culprit faults, the lane ends, and its unanswered suspect runs alone on
    a restarted lane."""
    import uuid

    from services.measurer import in_process
    from services.measurer import worker as lane_worker
    from shared import lanes
    from shared.messages import Candidate, MeasureBatch, MeasureResult, TimingConfig
    from shared.settings import LaneSettings

    r = store.connect(redis_url)
    r.flushdb()
    salt = uuid.uuid4().hex
    cands = [Candidate(candidate_id=f"c{i}", mod=f"{salt}-{i}", args_info=[]) for i in range(4)]
    hashes = [store.candidate_hash(c.mod) for c in cands]
    bad = "c2"
    for h in hashes:
        r.hset(names.CRASHES_KEY, h, 1)  # in flight when the GPU faulted beside its neighbours
    monkeypatch.setattr(in_process, "cuda_alive", lambda: True)

    def run_on(lane, batch):
        lane.in_process.gpu_shared = lambda: True
        fake_gpu = (MeasureResult(candidate_id=c.candidate_id, run_secs=None if c.candidate_id == bad else [1e-3],
                                  error="run failed: CUDA: an illegal memory access was encountered"
                                  if c.candidate_id == bad else None,
                                  error_kind="run" if c.candidate_id == bad else None) for c in batch.candidates)
        guard = dict(max_crashes=2, lane=LANE_A, job_id="j", batch_id=batch.batch_id)
        return {res.candidate_id: res for res in lane.in_process.measure(batch, fake_gpu, {}, guard)}

    batch = MeasureBatch(batch_id="b1", job_id="j", target="", timing=TimingConfig(timeout_s=30), candidates=cands)
    first = lane_worker.LaneWorker(LaneSettings(max_crashes=2), lanes.parse(LANE_A), r)
    answered = run_on(first, batch)
    assert sorted(answered) == ["c0", "c1", "c2"] and first.gpu_fault  # c3 unanswered: the lane's context died
    assert answered["c2"].error.startswith("quarantined after 2 crashes") and answered["c0"].error is None
    assert [store.quarantined(r, h) is not None for h in hashes] == [False, False, True, False]
    assert store.crash_count(r, hashes[0]) == 0 and store.crash_count(r, hashes[3]) == 1
    assert [f.role for f in store.gpu_faults(r, GPU_A)] == ["culprit"]  # faulted alone: named
    resent = batch.model_copy(update={"batch_id": "b2", "candidates": [cands[3]]})
    again = run_on(lane_worker.LaneWorker(LaneSettings(max_crashes=2), lanes.parse(LANE_A), r), resent)
    assert again["c3"].error is None and store.crash_count(r, hashes[3]) == 0
    assert sum(store.suspect_runs(r, GPU_A).values()) == 4  # each suspect ran alone once


def test_a_suspect_whose_lane_lost_its_context_while_it_waited_is_not_run_nor_blamed(redis_url, monkeypatch):
    """On the H200 the culprit, running alone, took the MPS server down; a neighbour lane then took the gate
    for its own suspect and ran it on the dead context: it faulted alone and an innocent was quarantined.
    The lane looks at its context once it has the gate: dead, the suspect is left unrun with its count."""
    import uuid

    from services.measurer import in_process
    from services.measurer import worker as lane_worker
    from shared import lanes
    from shared.messages import Candidate, MeasureBatch, TimingConfig
    from shared.settings import LaneSettings

    r = store.connect(redis_url)
    r.flushdb()
    cand = Candidate(candidate_id="c0", mod=f"{uuid.uuid4().hex}-innocent", args_info=[])
    chash = store.candidate_hash(cand.mod)
    r.hset(names.CRASHES_KEY, chash, 1)  # a suspect of the first fault
    monkeypatch.setattr(in_process, "cuda_alive", lambda: False)  # the culprit's fault reached this lane
    ran = []

    def fake_gpu():
        ran.append(True)
        yield from ()

    lane = lane_worker.LaneWorker(LaneSettings(max_crashes=2), lanes.parse(LANE_A), r)
    lane.in_process.gpu_shared = lambda: True
    batch = MeasureBatch(batch_id="b1", job_id="j", target="", timing=TimingConfig(timeout_s=30), candidates=[cand])
    answered = list(lane.in_process.measure(batch, fake_gpu(), {}, dict(max_crashes=2, lane=LANE_A, job_id="j",
                                                                  batch_id="b1")))
    assert answered == [] and not ran and lane.gpu_fault  # unanswered (re-sent), never run, the lane ends
    assert store.crash_count(r, chash) == 1 and store.quarantined(r, chash) is None
    assert [f.role for f in store.gpu_faults(r, GPU_A)] == ["victim"]

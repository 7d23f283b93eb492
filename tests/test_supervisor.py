"""The stack's supervisor wiring, without processes or a GPU: fake process handles, a recorded GPU fault
report, a fake MPS daemon. (Real lanes killed with SIGKILL: tests/test_faults.py.)"""
import time

from fakes import FakeHost, FakeMps, FakeProc

from sharetune.stack.local import Stack
from shared import lanes as lane_kinds
from shared import names
from shared.messages import GpuFault

UUID = "GPU-3f2a1c9b-5d7e-4a10-9c21-6b8e0f4d2a17"
GPU_LANE = "measure.3f2a1c9b.p25"
# CPU lanes' processes, named for this host (node and share) as the agent names them
C0, C1 = (f"lane-{lane_kinds.parse(q, lane_kinds.Host.this('local')).queue}" for q in ("measure.cpu.c0", "measure.cpu.c1"))


def _stack(tmp_path, lanes, monkeypatch, local_redis=None):
    """A stack whose processes are fakes, spawned by name and never started: its agent's supervisor is
    driven round by round."""
    st = Stack(tmp_path, redis_url="redis://127.0.0.1:1/0", lanes=lanes, local_redis=local_redis)
    started = []

    def spawn(name, args, env=None):
        st.procs[name] = FakeProc()
        started.append(name)
        return st.procs[name]

    monkeypatch.setattr(st.agent.processes, "spawn", spawn)
    if GPU_LANE in lanes:
        st.agent.gpus.uuids = {"3f2a1c9b": UUID}
    # never the host's real processes: an empty process table, nothing signalled, no live lane
    st.agent.gpus.host = FakeHost()
    monkeypatch.setattr("shared.store.live_lanes", lambda r: [])
    monkeypatch.setattr("shared.store.clear_gpu_isolation", lambda r, gpu8: None)
    for i, q in enumerate(st.lanes):
        st.start_lane(q, st.lanes[:i].count(q))
    started.clear()
    return st, started


def test_a_dead_cpu_lane_is_started_again(tmp_path, monkeypatch):
    st, started = _stack(tmp_path, ["measure.cpu.c0", "measure.cpu.c1"], monkeypatch)
    st.procs[C1].returncode = -9
    st.agent.recover_once(0.0)
    assert started == [C1]
    assert st.recoveries[-1]["exits"] == {C1: -9}
    st.agent.recover_once(0.0)  # nothing new: nothing done
    assert started == [C1] and len(st.recoveries) == 1


def test_a_gpu_fault_restarts_mps_and_every_lane_of_that_gpu(tmp_path, monkeypatch):
    st, started = _stack(tmp_path, [GPU_LANE] * 4, monkeypatch)
    st.agent.gpus.mps = FakeMps(servers=lambda: {4000: []})
    st.agent.gpus.host = FakeHost(end=lambda pids, grace_s=3.0: st.mps.calls.append(("end", sorted(pids))) or {})
    fault = GpuFault(gpu8="3f2a1c9b", lane=GPU_LANE, worker="h.1", candidate_hash="abc", role="culprit",
                     error="run failed: CUDA: an illegal memory access was encountered", at=50.0)
    monkeypatch.setattr("shared.store.gpu_faults", lambda r, g, since=0.0: [f for f in [fault] if f.at >= since])
    st.procs[f"lane-{GPU_LANE}"].returncode = names.EXIT_GPU_FAULT  # the culprit's lane left; the others still run
    since = st.agent.recover_once(0.0)
    # the daemon serves this GPU alone: its server ended by PID first (a faulted server holds a 'quit' for its
    # timeout), then the daemon quit and started again
    assert st.mps.calls[-3:] == [("end", [4000]), "stop", "start"]
    assert sorted(started) == sorted([f"lane-{GPU_LANE}"] + [f"lane-{GPU_LANE}-{i}" for i in (1, 2, 3)])
    assert st.recoveries[-1]["gpus"] == ["3f2a1c9b"]
    assert since > fault.at
    st.agent.recover_once(since)  # the same report is not acted on twice
    assert st.mps.calls[-2:] == ["stop", "start"] and len(st.recoveries) == 1 and st.mps.calls.count("stop") == 1


def test_default_tuners_follow_the_gpu_lanes_and_the_cores():
    from sharetune.stack.local import default_tuners

    cpu = ["measure.cpu.c0", "measure.cpu.c1"]
    assert default_tuners(cpu, 2) == 1  # CPU lanes: the search shares their cores
    assert default_tuners([GPU_LANE] * 4, 16) == 4  # one per GPU lane, as measured best on the H200
    assert default_tuners([GPU_LANE] * 4 + ["measure.4c1d2e3f.p25"] * 4, 16) == 4  # 4 cores each at least
    assert default_tuners([GPU_LANE] * 4, 2) == 1
    assert default_tuners([GPU_LANE], 16) == 4  # one lane at 100 %: four clients still search, as benchmarked
    assert default_tuners([GPU_LANE], 8) == 2
    assert default_tuners([GPU_LANE] * 8, 64) == 8  # one per lane where the cores allow
    from shared.settings import physical_cores

    assert Stack("/tmp/unused", lanes=[GPU_LANE] * 2, tuners=None).tuners == default_tuners([GPU_LANE] * 2,
                                                                                             physical_cores())
    assert Stack("/tmp/unused", lanes=[GPU_LANE] * 2, tuners=3).tuners == 3


def test_a_dead_tuner_comes_back_with_back_off_and_one_that_keeps_dying_is_given_up(tmp_path, monkeypatch):
    from services.measurer.agent import MAX_RESTARTS, restart_backoff_s

    st, _ = _stack(tmp_path, ["measure.cpu.c0"], monkeypatch)
    starts = []

    def start_tuner():
        starts.append(time_now[0])
        st.procs["tuner0"] = FakeProc()
        return st.procs["tuner0"]

    st.agent.processes.restartable["tuner0"] = start_tuner
    st.procs["tuner0"] = FakeProc()
    time_now = [1000.0]
    assert st.agent.restart_services(time_now[0]) == []  # alive: nothing done
    deaths = 0
    while "tuner0" not in st.agent.given_up:
        st.procs["tuner0"].returncode = -9  # it dies again at once
        deaths += 1
        waited = 0.0
        while not st.agent.restart_services(time_now[0]) and "tuner0" not in st.agent.given_up:
            time_now[0] += 0.5
            waited += 0.5
            assert waited < 60
        if "tuner0" not in st.agent.given_up:
            assert waited >= restart_backoff_s(len(starts) - 1) if starts else waited == 0.0
    assert len(starts) == MAX_RESTARTS and deaths == MAX_RESTARTS + 1
    assert restart_backoff_s(0) == 0.0 and restart_backoff_s(1) == 1.0 and restart_backoff_s(4) == 8.0
    row = next(r for r in st.services() if r["name"] == "tuner0")
    assert row["given_up"] and row["alive"] is False and row["restarts"] == MAX_RESTARTS and row["kind"] == "tuner"
    assert "tuner0" not in st.procs and "tuner0" not in st.agent.processes.restartable


def test_a_cpu_lane_dying_again_waits_its_back_off(tmp_path, monkeypatch):
    st, started = _stack(tmp_path, ["measure.cpu.c0"], monkeypatch)
    now = time.time()
    st.procs[C0].returncode = -9
    st.agent.recover_once(0.0, now)
    assert started == [C0]  # the first time at once
    st.procs[C0].returncode = -9
    st.agent.recover_once(0.0, now)
    assert started == [C0]  # died again within a second: it waits
    st.agent.recover_once(0.0, now + 1.5)
    assert started == [C0] * 2
    assert {r["name"]: r["restarts"] for r in st.services()}[C0] == 2


def test_a_redis_restart_is_in_the_supervisors_log(tmp_path, monkeypatch, caplog):
    """Every restart in one log: the embedded Redis's too (an `up` stack's supervisor starts it again)."""
    import logging

    from sharetune.stack.local import LocalRedis

    st, _ = _stack(tmp_path, ["measure.cpu.c0"], monkeypatch, LocalRedis(restart=True))

    class FakeRedisServer:
        def __init__(self):
            self.proc = FakeProc(code=-9, pid=4242)

        def start(self):
            self.proc = FakeProc(code=None, pid=4343)
            return self

    st.redis_server = FakeRedisServer()
    with caplog.at_level(logging.WARNING, logger="sharetune.stack"):
        for now in (100.0, 200.0):  # seen dead, then started after its back-off
            st.agent.restart_services(now)
    assert st.redis_server.proc.pid == 4343
    assert "redis (pid 4242) exited with -9: started again as pid 4343" in caplog.text

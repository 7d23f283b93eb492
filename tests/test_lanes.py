"""The lane kinds (shared.lanes): share <-> placement, names that carry the share, the one live-lane policy,
a record's share taken from its lane, and a new kind plugged in from this file alone."""
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shared import lanes
from shared.errors import LaneError, ShareError
from shared.lanes import Host, Lane, LaneKind, LiveLanePolicy
from shared.lanes.cpu import cores_for_share, share_of_cores
from shared.messages import LaneInfo, MeasureResult, Record

ROOT = Path(__file__).resolve().parent.parent
CPU, GPU = lanes.kind("cpu"), lanes.kind("gpu")


def _info(queue: str, pid: int = 1, target: str = '{"kind": "llvm"}') -> LaneInfo:
    """A lane's liveness entry as its worker announces it (the share from the lane's name)."""
    lane = lanes.parse(queue)
    return LaneInfo(queue=queue, kind=lane.kind, share=lane.share, cores=list(lane.cores), target=target,
                    host="h", pid=pid, started_at=time.time())


# ---- share <-> placement ----------------------------------------------------------------------------


@pytest.mark.parametrize("host_cores", range(1, 65))
def test_cpu_share_rounding_is_a_whole_cores_fraction(host_cores):
    for n in range(1, host_cores + 1):
        share = share_of_cores(n, host_cores)
        assert share == max(1, round(100 * n / host_cores))  # the lane share every stored record was made at
        assert cores_for_share(share, host_cores) == n
        assert CPU.lane_at(share, Host(host_cores)).cores == tuple(range(n))


def test_shares_that_are_no_whole_number_of_cores_are_refused():
    with pytest.raises(ShareError, match="whole number of cores.*30 %"):
        CPU.lane_at(30, Host(2))
    assert CPU.lanes_fit(25, Host(8)) == 4 and CPU.lane_at(25, Host(8), index=3).cores == (6, 7)
    GPU.check_shares([7, 33], Host(2))  # any whole percentage is an MPS share
    assert GPU.lanes_fit(25, Host(2)) == 4


def test_each_kind_owns_its_target_isolation_and_fault_domain():
    assert (CPU.target_kind, GPU.target_kind) == ("llvm", "cuda")
    assert lanes.for_target("llvm") is CPU and lanes.for_target('{"kind": "cuda", "arch": "sm_90"}') is GPU
    assert CPU.sandboxed and not GPU.sandboxed
    gpu_lane = GPU.lane("GPU-3f2a1c9b-0a1b", 50)
    assert lanes.fault_domain(gpu_lane.queue) == "3f2a1c9b" and lanes.fault_domain("measure.cpu.c0") is None
    assert lanes.fault_domain("plan") is None
    assert GPU.timing() == {"number": 3, "repeat": 3, "min_repeat_ms": 50, "settle_ms": 10} and CPU.timing() == {}
    assert lanes.target_family({"kind": "llvm", "mcpu": "Znver4"}) == "llvm.znver4"


# ---- the queue names carry the share: a joining host with other cores gets its own queue --------------


def test_a_lane_joining_from_a_host_with_other_cores_gets_its_own_queue():
    from services.measurer.agent import default_cpu_lanes

    here, there = default_cpu_lanes(2), default_cpu_lanes(4)
    assert here[0] != there[0]  # core 0 is 50 % here and 25 % there: two queues
    assert lanes.parse(here[0]).share == 50 and lanes.parse(there[0]).share == 25
    assert default_cpu_lanes(4) == default_cpu_lanes(4)  # hosts of one size (and node) share queues: scaling out


def test_the_tuner_sends_a_job_only_to_queues_of_its_share(tmp_path):
    """Real Redis: lanes of two hosts (2 and 4 cores) live at once; the lanes serving a 50 % job are only
    the 2-core host's, and each of their queues names 50 %, so no batch reaches a 25 % lane."""
    from services.broker.server import EmbeddedRedis
    from shared import store

    server = EmbeddedRedis(tmp_path / "redis").start()
    try:
        r = store.connect(server.url)
        for queue, pid in [(lanes.parse("measure.cpu.c0", Host(2)).queue, 1),
                           (lanes.parse("measure.cpu.c0", Host(4)).queue, 2),
                           (lanes.parse("measure.cpu.c1", Host(4)).queue, 3)]:
            store.announce_lane(r, _info(queue, pid))
        serving = lanes.serving(store.live_lanes(r), "cpu", 50)
        assert [l.pid for l in serving] == [1]
        assert all(lanes.parse(l.queue).share == 50 for l in serving)
        assert lanes.shares_served(store.live_lanes(r), "cpu") == [25, 50]
    finally:
        server.stop()


def test_a_lane_named_for_another_host_is_refused():
    other = 25 if share_of_cores(1, os.cpu_count()) != 25 else 10
    queue = f"measure.cpu.local.p{other}.c0"
    with pytest.raises(LaneError, match=rf"serves {other} %"):
        CPU.check(lanes.parse(queue), Host(os.cpu_count()))
    out = subprocess.run([sys.executable, "-m", "services.measurer", "--lane", queue], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode != 0 and f"serves {other} %" in out.stderr, out.stderr


# ---- a record's share is the share its lane measured at --------------------------------------------


def test_a_record_takes_the_share_its_lane_reports():
    from services.tuner.metaschedule.records import measured_share

    assert measured_share(MeasureResult(candidate_id="c", run_secs=[1e-3], share=25), job_share=50) == 25
    assert measured_share(MeasureResult(candidate_id="c", error="cancelled", error_kind="cancelled"), job_share=50) == 50  # no share reported
    assert measured_share(None, job_share=50) == 50  # never measured


def test_records_and_lanes_stored_before_still_load():
    old = {"candidate_key": "k", "wkey": "w", "trace": "t", "run_secs": [1e-3], "target": '{"kind": "llvm"}',
           "args_info": [], "share": 50, "lane": "measure.cpu.c0"}
    assert Record.model_validate_json(json.dumps(old)).share == 50
    assert MeasureResult.model_validate_json('{"candidate_id": "c", "run_secs": [0.001]}').share is None
    info = LaneInfo.model_validate_json(json.dumps({"queue": "measure.cpu.c0", "kind": "cpu", "share": 50,
                                                    "target": "{}", "host": "h", "pid": 1, "started_at": 0}))
    assert info.kind == "cpu"


# ---- one live-lane policy ---------------------------------------------------------------------------


def test_the_client_refuses_and_the_planner_parks_by_one_policy():
    policy = LiveLanePolicy(park_s=120, recheck_s=3, give_up_s=60)
    assert policy.share_at_submit([50], "cpu", None, wait=False) == 50
    with pytest.raises(ShareError, match="no live cpu lane serves 7 %.*serve 50 %"):
        policy.share_at_submit([50], "cpu", 7, wait=False)
    assert policy.share_at_submit([50], "cpu", 7, wait=True) == 7
    with pytest.raises(ShareError, match="serve 25, 50 %: give one"):
        policy.share_at_submit([25, 50], "cpu", None, wait=False)
    assert policy.parks(119, wait=False) and not policy.parks(121, wait=False) and policy.parks(1e9, wait=True)
    err = policy.unserved("cpu", 7, 121, [_info("measure.cpu.local.p50.c0")])
    assert "no live measurer lane serves cpu at 7 %" in str(err) and "measure.cpu.local.p50.c0 (cpu 50 %)" in str(err)


def test_the_policy_comes_from_the_settings(monkeypatch):
    from shared.settings import LaneWaitSettings, TunerSettings

    monkeypatch.setenv("SHARETUNE_LANE_WAIT_S", "5")
    monkeypatch.setenv("SHARETUNE_LANE_GIVE_UP_S", "7")
    assert LaneWaitSettings().live_lane_policy() == LiveLanePolicy(park_s=5, recheck_s=3, give_up_s=7)
    assert TunerSettings().live_lane_policy() == LiveLanePolicy(park_s=5, recheck_s=3, give_up_s=7)


def test_the_tuner_gives_up_waiting_for_lanes_by_the_policy(tmp_path):
    from services.broker.server import EmbeddedRedis
    from services.tuner.metaschedule.lane_runner import BatchRules, CandidateStash, JobLanes, LaneRunner, TimeSplit
    from shared import store
    from shared.messages import TimingConfig

    server = EmbeddedRedis(tmp_path / "redis").start()
    try:
        runner = LaneRunner(lambda *a: None, store.connect(server.url), JobLanes("job", "cpu", 50, '{"kind": "llvm"}'),
                            CandidateStash(), TimeSplit(), BatchRules(TimingConfig(), policy=LiveLanePolicy(give_up_s=0.3)))
        t0 = time.time()
        with pytest.raises(RuntimeError, match="no live measurer lane serves cpu at 50 %"):
            runner.dispatch([])
        assert time.time() - t0 < 10
    finally:
        server.stop()


# ---- a new kind of lane is one module: here, this test file --------------------------------------------


class RemoteCpuLanes(LaneKind):
    """CPU lanes on a remote board reached over RPC, timed with TVM's C target: a whole board per lane."""

    name = "cpu-remote"
    target_kind = "c"
    sandboxed = True

    def queue(self, lane: Lane) -> str:
        return f"measure.remote.{lane.node}.p{lane.share}"

    def parse(self, queue: str, host: Host | None = None) -> Lane | None:
        m = re.fullmatch(r"measure\.remote\.(?P<board>[a-z0-9-]+)\.p(?P<pct>\d+)", queue)
        return Lane(self.name, int(m["pct"]), node=m["board"]) if m else None

    def lane_at(self, share: int, host: Host, index: int = 0, device: str | None = None) -> Lane:
        if share != 100:
            raise ShareError("a remote board is measured whole")
        return Lane(self.name, share, node=device or host.node)

    def lanes_fit(self, share: int, host: Host) -> int:
        return 1

    def family(self, target: dict) -> str:
        return f"c.{target.get('mcpu', 'generic')}"


@pytest.fixture
def remote_kind(monkeypatch):
    from shared.lanes import base

    monkeypatch.setattr(base, "_KINDS", dict(base._KINDS))  # registered for this test only
    lanes.register(RemoteCpuLanes)
    return lanes.kind("cpu-remote")


def test_a_new_lane_kind_plugs_in_through_the_registry(remote_kind):
    from shared.messages import JobSpec, lane_kind
    from sharetune.experiments.share_matrix import Placement

    lane = lanes.parse("measure.remote.board7.p100")
    assert lanes.of(lane) is remote_kind and lane.queue == "measure.remote.board7.p100"
    assert lane_kind("c") == "cpu-remote" and lanes.for_target({"kind": "c"}) is remote_kind
    assert JobSpec(job_id="j", target="c", share=100, trials=4).target == "c"
    live = [_info("measure.remote.board7.p100"), _info(lanes.parse("measure.cpu.c0", Host(2)).queue, pid=2)]
    assert [l.queue for l in lanes.serving(live, "cpu-remote", 100)] == ["measure.remote.board7.p100"]
    assert LiveLanePolicy().share_at_submit(lanes.shares_served(live, "cpu-remote"), "cpu-remote", None, False) == 100
    assert lanes.fault_domain(lane.queue) is None and lanes.target_family('{"kind": "c"}') == "c.generic"
    assert Placement("cpu-remote", gpu_uuid="board7").lanes([100]) == ["measure.remote.board7.p100"]

"""The MPS lane manager without a GPU: daemon command lines and environment through a fake runner that
plays the control daemon, the refusal without MPS, and lane plans on recorded inventories."""
from __future__ import annotations

import time

import pytest

from services.measurer.gpu.daemon import CommandResult, DaemonWait, MpsDaemon, run_command
from services.measurer.gpu.plan import find_gpu, gpu_for_lane, parse_share_spec, plan_gpu_lanes
from services.measurer.observers.inventory import GpuInfo
from shared.errors import LaneError, ShareError
from shared import lanes

BIN = "nvidia-cuda-mps-control"

# Recorded from `nvidia-smi -L` / NVML on H200 hosts (UUIDs as reported).
H200 = GpuInfo(0, "GPU-3f2a1c9b-5d7e-4a10-9c21-6b8e0f4d2a17", "NVIDIA H200", 143771, 132, (9, 0))
FOUR_H200 = [
    H200,
    GpuInfo(1, "GPU-b7c40e52-19af-4c3d-8e60-2d5f7a9b1c08", "NVIDIA H200", 143771, 132, (9, 0)),
    GpuInfo(2, "GPU-0e9d6a31-7b24-4f8c-a5d3-91c2e4f60b7a", "NVIDIA H200", 143771, 132, (9, 0)),
    GpuInfo(3, "GPU-c15f8b07-3e62-4d9a-b0f4-58a7d3e2c916", "NVIDIA H200", 143771, 132, (9, 0)),
]


class FakeControl:
    """Plays nvidia-cuda-mps-control: '-d' creates the control pipe, 'get_server_list' answers while the
    daemon runs, 'quit' ends it. Records every call (argv, env, stdin)."""

    def __init__(self, pipe_dir, running=False, start_rc=0, honours_quit=True):
        self.pipe_dir = pipe_dir
        self.calls: list[tuple[list[str], dict, str | None]] = []
        self.start_rc = start_rc
        self.honours_quit = honours_quit
        if running:
            self._up()

    alive = False  # a daemon answers (its control pipe may exist without one: a stale pipe)

    @property
    def running(self):
        return self.alive and (self.pipe_dir / "control").exists()

    def _up(self):
        self.pipe_dir.mkdir(parents=True, exist_ok=True)
        (self.pipe_dir / "control").write_text("")
        self.alive = True

    def __call__(self, argv, env, input, timeout):
        self.calls.append((list(argv), dict(env), input))
        assert argv[0] == BIN and timeout > 0
        assert env["CUDA_MPS_PIPE_DIRECTORY"] == str(self.pipe_dir)
        if argv[1:] == ["-d"]:
            if self.start_rc:
                return CommandResult(self.start_rc, "", "An instance of this daemon is already running")
            self._up()
            return CommandResult(0)
        if input == "get_server_list\n":
            return CommandResult(0 if self.running else 1, "", "" if self.running else "Cannot find MPS control daemon process")
        if input == "quit\n":
            if self.honours_quit:
                (self.pipe_dir / "control").unlink()
                self.alive = False
            return CommandResult(0)
        raise AssertionError(f"unexpected call {argv} {input!r}")

    def commands(self):
        return [(argv, stdin) for argv, _, stdin in self.calls]


def daemon(tmp_path, fake, found=True, **wait):
    return MpsDaemon(tmp_path / "pipe", tmp_path / "log", runner=fake,
                     which=lambda b: f"/usr/bin/{b}" if found else None, wait=DaemonWait(**{"poll_s": 0.001, **wait}))


def test_commands_and_environment(tmp_path):
    d = MpsDaemon(tmp_path / "pipe", tmp_path / "log")
    assert d.environment() == {"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path / "pipe"),
                               "CUDA_MPS_LOG_DIRECTORY": str(tmp_path / "log")}
    assert d.start_command() == [BIN, "-d"]
    assert d.quit_command() == ([BIN], "quit\n")
    custom = MpsDaemon(tmp_path / "p", tmp_path / "l", control_binary="/opt/cuda/bin/nvidia-cuda-mps-control")
    assert custom.start_command() == ["/opt/cuda/bin/nvidia-cuda-mps-control", "-d"]


def test_a_pipe_directory_too_long_for_mps_sockets_gets_a_short_one_of_its_own(tmp_path):
    from services.measurer.gpu.daemon import MAX_PIPE_DIR_CHARS, usable_pipe_dir

    long_dir = tmp_path / ("w" * 90) / "mps" / "pipe"
    d = MpsDaemon(long_dir, tmp_path / "log")
    assert len(str(d.pipe_dir)) <= MAX_PIPE_DIR_CHARS and d.pipe_dir != long_dir
    # every process given the long path finds the same short one; another long path, another one
    assert usable_pipe_dir(str(long_dir)) == d.pipe_dir != usable_pipe_dir(tmp_path / ("v" * 90))
    assert d.environment()["CUDA_MPS_PIPE_DIRECTORY"] == str(d.pipe_dir) and d.control_pipe.parent == d.pipe_dir
    assert usable_pipe_dir(tmp_path / "pipe") == tmp_path / "pipe"


def test_lane_gets_the_daemon_variables(tmp_path):
    d = MpsDaemon(tmp_path / "pipe", tmp_path / "log")
    env = d.client_environment(lanes.kind("gpu").lane(H200.uuid, 25), H200.uuid)
    assert env == {"CUDA_VISIBLE_DEVICES": H200.uuid, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25", **d.environment()}


def test_start_when_none_runs_then_stop_what_it_started(tmp_path):
    fake = FakeControl(tmp_path / "pipe")
    d = daemon(tmp_path, fake)
    assert not d.is_running()
    assert fake.calls == []  # no control pipe: no need to ask the control binary
    assert d.start() is True and d.started
    assert (tmp_path / "pipe").is_dir() and (tmp_path / "log").is_dir()
    assert fake.commands() == [([BIN, "-d"], None), ([BIN], "get_server_list\n")]
    assert all(env == d.environment() for _, env, _ in fake.calls)
    assert d.is_running()
    fake.calls.clear()
    assert d.stop() is True and not d.started
    assert fake.commands()[0] == ([BIN], "quit\n")
    assert not (tmp_path / "pipe" / "control").exists()
    assert d.stop() is False  # nothing left to stop


def test_a_running_daemon_is_used_and_never_stopped(tmp_path):
    fake = FakeControl(tmp_path / "pipe", running=True)
    d = daemon(tmp_path, fake)
    assert d.start() is False and not d.started
    assert fake.commands() == [([BIN], "get_server_list\n")]
    assert d.stop() is False
    assert ([BIN], "quit\n") not in fake.commands()
    assert fake.running


def test_stale_control_pipe_is_not_a_running_daemon(tmp_path):
    fake = FakeControl(tmp_path / "pipe")
    (tmp_path / "pipe").mkdir()
    (tmp_path / "pipe" / "control").write_text("")  # left over by a daemon that died; nothing answers
    d = daemon(tmp_path, fake)
    assert not d.is_running()
    fake.calls.clear()
    assert d.start() is True and d.started
    assert fake.commands() == [([BIN], "get_server_list\n"), ([BIN, "-d"], None), ([BIN], "get_server_list\n")]


def test_start_failure_and_start_timeout_are_refused(tmp_path):
    fake = FakeControl(tmp_path / "pipe", start_rc=1)
    with pytest.raises(LaneError, match="did not start .exit 1.: An instance"):
        daemon(tmp_path, fake).start()

    silent = lambda argv, env, input, timeout: CommandResult(0 if input is None else 1)  # noqa: E731
    clock = iter(range(1000))
    d = MpsDaemon(tmp_path / "pipe2", tmp_path / "log2", runner=silent, which=lambda b: b,
                  wait=DaemonWait(timeout_s=3, sleep=lambda s: None, clock=lambda: next(clock)))
    with pytest.raises(LaneError, match="does not answer"):
        d.start()
    assert not d.started


def test_stop_times_out_when_the_daemon_stays(tmp_path):
    fake = FakeControl(tmp_path / "pipe", honours_quit=False)
    clock = iter(range(1000))
    d = daemon(tmp_path, fake, timeout_s=3, sleep=lambda s: None, clock=lambda: next(clock))
    d.start()
    with pytest.raises(LaneError, match="still runs 3 s after 'quit'"):
        d.stop()
    assert d.started  # still ours to stop


def test_refusal_without_mps(tmp_path):
    fake = FakeControl(tmp_path / "pipe")
    d = daemon(tmp_path, fake, found=False)
    assert not d.available()
    plan = plan_gpu_lanes([H200], "4x25")
    with pytest.raises(LaneError) as e:
        d.ensure_for(plan)
    assert str(e.value) == ("MPS is not available (nvidia-cuda-mps-control not found): "
                            "refusing to run GPU lanes at 25 % unshared")
    with pytest.raises(LaneError, match=r"at 25 %, 50 % unshared"):
        d.require_for(plan_gpu_lanes([H200], "25,25,50"))
    with pytest.raises(LaneError, match="not found"):
        d.start()
    with pytest.raises(LaneError, match="at 25 % unshared"):
        d.check_lane(lanes.kind("gpu").lane(H200.uuid, 25))
    # a whole GPU needs no MPS, CPU lanes neither
    assert d.ensure_for(plan_gpu_lanes([H200], "1x100")) is False
    d.check_lane(lanes.kind("gpu").lane(H200.uuid, 100))
    d.check_lane(lanes.kind("cpu").lane([0], lanes.Host(2)))
    assert fake.calls == []


def test_a_lane_asks_again_until_the_daemon_answers(tmp_path):
    class Slow(FakeControl):  # the daemon runs, but its first two queries go unanswered (a busy host)
        missed = 0

        def __call__(self, argv, env, input, timeout):
            if input == "get_server_list\n" and self.missed < 2:
                self.missed += 1
                return CommandResult(124, "", "timed out")
            return super().__call__(argv, env, input, timeout)

    fake = Slow(tmp_path / "pipe", running=True)
    daemon(tmp_path, fake).check_lane(lanes.kind("gpu").lane(H200.uuid, 25))
    assert fake.missed == 2


def test_ensure_starts_the_daemon_for_partial_lanes_only(tmp_path):
    fake = FakeControl(tmp_path / "pipe")
    d = daemon(tmp_path, fake, timeout_s=0.2)
    assert d.ensure_for(plan_gpu_lanes([H200], "1x100")) is False and not d.started
    with pytest.raises(LaneError, match="no MPS control daemon answers"):
        d.check_lane(lanes.kind("gpu").lane(H200.uuid, 50))
    assert d.ensure_for(plan_gpu_lanes([H200], "2x50")) is True and d.started
    d.check_lane(lanes.kind("gpu").lane(H200.uuid, 50))
    with d:
        pass
    assert not d.started and not fake.running


def test_real_runner_passes_env_and_stdin_and_does_not_wait_for_forked_children():
    res = run_command(["sh", "-c", 'cat; echo "$CUDA_MPS_PIPE_DIRECTORY"'], {"CUDA_MPS_PIPE_DIRECTORY": "/tmp/p"}, "quit\n", 10)
    assert (res.returncode, res.stdout) == (0, "quit\n/tmp/p\n")
    assert run_command(["/nonexistent/nvidia-cuda-mps-control", "-d"], {}, None, 10).returncode == 127
    t0 = time.monotonic()
    res = run_command(["sh", "-c", "sleep 3 & echo forked"], {}, None, 10)  # like `-d`: a child keeps stdout
    assert res.stdout == "forked\n" and time.monotonic() - t0 < 2.5
    assert run_command(["sleep", "5"], {}, None, 0.2).returncode == 124


# ------------------------------------------------------------------------------------ lane plans
def queues(plan):
    return [(lane.queue, n) for lane, n in plan]


def test_plans_on_one_gpu():
    assert queues(plan_gpu_lanes([H200], "4x25")) == [("measure.3f2a1c9b.p25", 4)]
    assert queues(plan_gpu_lanes([H200], "2x50")) == [("measure.3f2a1c9b.p50", 2)]
    assert queues(plan_gpu_lanes([H200], "1x100")) == [("measure.3f2a1c9b.p100", 1)]
    assert queues(plan_gpu_lanes([H200], "25,25,50")) == [("measure.3f2a1c9b.p25", 2), ("measure.3f2a1c9b.p50", 1)]
    assert queues(plan_gpu_lanes([H200], " 2x25, 50% ")) == [("measure.3f2a1c9b.p25", 2), ("measure.3f2a1c9b.p50", 1)]
    assert queues(plan_gpu_lanes([H200], {0: "4x25"})) == [("measure.3f2a1c9b.p25", 4)]
    lane, n = plan_gpu_lanes([H200], "1x100")[0]
    assert gpu_for_lane([H200], lane) is H200 and lanes.parse(lane.queue) == lane


def test_plans_on_four_gpus():
    plan = plan_gpu_lanes(FOUR_H200, "4x25")
    assert queues(plan) == [(f"measure.{g.uuid8}.p25", 4) for g in FOUR_H200]
    assert sum(n for _, n in plan) == 16
    assert queues(plan_gpu_lanes(FOUR_H200, "2x50"))[1] == ("measure.b7c40e52.p50", 2)
    # dict form: by index, by UUID prefix (with or without "GPU-"), a digit string is an index
    plan = plan_gpu_lanes(FOUR_H200, {"GPU-c15f": "1x100", 1: "4x25", "0e9d6a31": "25,25,50", "0": 50})
    assert queues(plan) == [
        ("measure.3f2a1c9b.p50", 1),
        ("measure.b7c40e52.p25", 4),
        ("measure.0e9d6a31.p25", 2), ("measure.0e9d6a31.p50", 1),
        ("measure.c15f8b07.p100", 1),
    ]
    assert find_gpu(FOUR_H200, "b7c4") is FOUR_H200[1]


def test_sums_past_the_limit_are_refused_naming_the_gpu():
    with pytest.raises(ShareError) as e:
        plan_gpu_lanes([H200], "25,25,50,25")
    assert "GPU 0 (GPU-3f2a1c9b-5d7e-4a10-9c21-6b8e0f4d2a17, NVIDIA H200)" in str(e.value)
    assert "25 + 25 + 50 + 25 = 125 %" in str(e.value) and "limit of 100 %" in str(e.value)
    with pytest.raises(ShareError, match=r"GPU 2 \(GPU-0e9d6a31.*\): shares 50 \+ 50 \+ 50 = 150 %"):
        plan_gpu_lanes(FOUR_H200, {1: "2x50", 2: "3x50"})
    with pytest.raises(ShareError, match="= 200 %"):
        plan_gpu_lanes(FOUR_H200, "2x100")
    # a lower limit (leave room for others), or a higher one (MPS percentages are caps, not reservations)
    with pytest.raises(ShareError, match="= 100 % exceed the limit of 75 %"):
        plan_gpu_lanes([H200], "4x25", max_total_percent=75)
    assert queues(plan_gpu_lanes([H200], "3x50", max_total_percent=150)) == [("measure.3f2a1c9b.p50", 3)]


@pytest.mark.parametrize("spec", ["1x0", "0", "150", "1x150", "25,0", "-5", {0: "150"}])
def test_percent_outside_range_is_refused(spec):
    with pytest.raises(ShareError, match=r"GPU 0 \(GPU-3f2a1c9b.*outside 1..100 %"):
        plan_gpu_lanes([H200], spec)


@pytest.mark.parametrize("key", [4, "7", "GPU-deadbeef", "ffff"])
def test_unknown_gpu_is_refused(key):
    with pytest.raises(ShareError, match=r"not in this host's inventory \(GPUs: 0: GPU-3f2a1c9b"):
        plan_gpu_lanes(FOUR_H200, {key: "1x100"})


def test_bad_plans_are_refused():
    with pytest.raises(ShareError, match="empty GPU lane plan: the inventory has no GPU"):
        plan_gpu_lanes([], "4x25")
    with pytest.raises(ShareError, match="empty GPU lane plan"):
        plan_gpu_lanes(FOUR_H200, {})
    with pytest.raises(ShareError, match="named twice"):
        plan_gpu_lanes(FOUR_H200, {0: "1x50", "GPU-3f2a": "1x50"})
    with pytest.raises(ShareError, match="ambiguous"):
        find_gpu(FOUR_H200 + [GpuInfo(4, "GPU-3f2a0000-0000-0000-0000-000000000000", "NVIDIA H200", 143771)], "3f2a")
    with pytest.raises(ShareError, match="UUID prefix 3f2a1c9b"):
        plan_gpu_lanes([H200, GpuInfo(1, "GPU-3f2a1c9b-ffff-0000-0000-000000000000", "NVIDIA H200", 143771)], "1x100")
    for bad in ["", "4x", "x25", "four", "4x25x2", "0x25"]:
        with pytest.raises(ShareError):
            plan_gpu_lanes([H200], bad)
    with pytest.raises(ShareError, match="max_total_percent"):
        plan_gpu_lanes([H200], "1x100", max_total_percent=0)


def test_parse_share_spec():
    assert parse_share_spec("4x25") == [25] * 4
    assert parse_share_spec("25,25,50") == [25, 25, 50]
    assert parse_share_spec(100) == [100]
    assert parse_share_spec([50, 50]) == [50, 50]
    assert parse_share_spec("2X50") == [50, 50]


def test_gpu_build_pools_stay_within_the_mps_client_limit():
    from services.measurer.agent import MPS_MAX_CLIENTS, gpu_build_workers

    four = ["measure.aaaaaaaa.p25"] * 4
    assert gpu_build_workers(four, four[0], cores=32) == 8  # cores split between the GPU's lanes
    assert gpu_build_workers(four, four[0], cores=32, asked=3) == 3
    seven = ["measure.aaaaaaaa.p25"] * 4 + ["measure.aaaaaaaa.p50"] * 2 + ["measure.aaaaaaaa.p100"]
    per_lane = gpu_build_workers(seven, seven[0], cores=32, asked=16)
    assert len(seven) * (1 + per_lane) <= MPS_MAX_CLIENTS - 1  # lanes + pools + one serving process
    two_gpus = ["measure.aaaaaaaa.p25"] * 4 + ["measure.bbbbbbbb.p25"] * 4
    assert gpu_build_workers(two_gpus, two_gpus[0], cores=32) == 4


# ---- GPU faults: classification and the supervisor's recovery plan, on recorded events ---------------
from services.measurer.gpu.faults import classify_cuda_error, diagnose  # noqa: E402
from services.measurer.gpu.recovery import LaneExit, plan_recovery  # noqa: E402
from shared.messages import GpuFault  # noqa: E402

U8 = H200.uuid8
LANE25 = f"measure.{U8}.p25"


@pytest.mark.parametrize("error,role", [
    ("run failed: InternalError: CUDA: an illegal memory access was encountered", "culprit"),
    ("run failed: RuntimeError: CUDA_ERROR_ILLEGAL_ADDRESS: an illegal memory access was encountered", "culprit"),
    ("run failed: InternalError: CUDA: misaligned address", "culprit"),
    ("run failed: InternalError: CUDA: unspecified launch failure", "victim"),
    ("run failed: InternalError: CUDA_ERROR_MPS_CLIENT_TERMINATED: the MPS client has been terminated", "victim"),
    ("run failed: InternalError: CUDA: out of memory", None),
    ("run failed: InternalError: CUDA: too many resources requested for launch", None),
    ("build failed: InternalError: illegal memory access in codegen text", None),
    ("run failed: ValueError: argument shape mismatch", None),
    (None, None),
])
def test_cuda_errors_are_classified(error, role):
    from shared.messages import ErrorKind

    kind = None if error is None else ErrorKind.BUILD if error.startswith("build") else ErrorKind.RUN
    assert classify_cuda_error(error, kind) == role


def _fault(role, chash, lane=LANE25, at=100.0):
    return GpuFault(gpu8=U8, lane=lane, worker=f"h.{chash}", candidate_hash=chash, error="e", role=role, at=at)


def test_a_gpu_fault_recovers_the_whole_gpu_and_plain_exits_restart_one_lane():
    exits = [LaneExit("lane-a", LANE25, 75, 101.0), LaneExit("lane-b", LANE25, -9, 101.0),
             LaneExit("lane-cpu", "measure.cpu.c0", -9, 101.0)]
    plan = plan_recovery(exits, [_fault("culprit", "c1")], {}, now=102.0)
    assert plan.gpus == (U8,)
    assert plan.restart == ("lane-cpu",)  # GPU lanes come back with their GPU, not one by one
    # the exit code alone (fault report lost with a Redis restart) is enough to recover the GPU
    assert plan_recovery(exits[:1], [], {}, now=102.0).gpus == (U8,)
    # a lane killed from outside, without a fault, comes back on its own
    solo = plan_recovery([LaneExit("lane-b", LANE25, -9, 101.0)], [], {}, now=102.0)
    assert solo.gpus == () and solo.restart == ("lane-b",)
    # one lane crashed without a word (aborted while freeing CUDA objects after a fault, on the H200): its
    # idle neighbours lost their contexts too, so the whole GPU is recovered; a CPU lane's crash is its own
    for code in (-6, -11):
        crashed = plan_recovery([LaneExit("lane-b", LANE25, code, 101.0)], [], {}, now=102.0)
        assert crashed.gpus == (U8,) and crashed.restart == ()
    assert plan_recovery([LaneExit("lane-cpu", "measure.cpu.c0", -6, 101.0)], [], {}, now=102.0).restart == ("lane-cpu",)
    # lanes of one GPU dying together without a word (killed by the MPS server): the GPU is recovered
    together = plan_recovery([LaneExit("lane-a", LANE25, -9, 101.0), LaneExit("lane-b", LANE25, -9, 101.0)], [], {},
                             now=102.0)
    assert together.gpus == (U8,) and together.restart == ()


def test_a_crash_looping_lane_is_given_up_not_hidden():
    history = {"lane-cpu": [10.0, 20.0, 30.0, 40.0, 50.0]}
    plan = plan_recovery([LaneExit("lane-cpu", "measure.cpu.c0", -11, 60.0)], [], history, now=60.0)
    assert plan.given_up == ("lane-cpu",) and plan.restart == ()
    later = plan_recovery([LaneExit("lane-cpu", "measure.cpu.c0", -11, 1000.0)], [], history, now=1000.0)
    assert later.restart == ("lane-cpu",)  # old restarts fall out of the window


def test_diagnosis_names_the_culprit_or_else_the_suspects():
    incident = [_fault("culprit", "bad"), _fault("victim", "v1"), _fault("victim", "v2")]
    assert diagnose(incident) == {"culprits": ["bad"], "suspects": [], "victims": ["v1", "v2"]}
    unclear = [_fault("unknown", "x"), _fault("unknown", "y"), _fault("victim", "v")]
    assert diagnose(unclear)["suspects"] == ["x", "y"] and diagnose(unclear)["culprits"] == []

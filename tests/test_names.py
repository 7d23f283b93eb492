import pytest

from shared import lanes
from shared.errors import ShareError

CPU, GPU = lanes.kind("cpu"), lanes.kind("gpu")
TWO_CORES = lanes.Host(cores=2)


def test_cpu_lane_names_round_trip():
    assert CPU.lane([0, 1], TWO_CORES).queue == "measure.cpu.local.p100.c0-1"
    assert CPU.lane([3], lanes.Host(cores=4, node="h2")).queue == "measure.cpu.h2.p25.c3"
    assert lanes.parse("measure.cpu.local.p50.c2-5").cores == (2, 3, 4, 5)
    lane = lanes.parse("measure.cpu.h2.p25.c7")
    assert (lane.kind, lane.share, lane.cores, lane.node) == ("cpu", 25, (7,), "h2")
    assert lanes.parse(lane.queue) == lane


def test_a_cpu_lane_given_by_its_cores_is_named_for_the_host():
    assert lanes.parse("measure.cpu.c0", TWO_CORES).queue == "measure.cpu.local.p50.c0"
    assert lanes.parse("measure.cpu.c0-1", lanes.Host(cores=8, node="big")).queue == "measure.cpu.big.p25.c0-1"


def test_gpu_lane_names_round_trip():
    lane = GPU.lane("GPU-3f2a1c9b-aaaa-bbbb-cccc-0123456789ab", 25)
    assert lane.queue == "measure.3f2a1c9b.p25"
    parsed = lanes.parse("measure.3f2a1c9b.p25")
    assert (parsed.kind, parsed.gpu, parsed.share) == ("gpu", "3f2a1c9b", 25) and parsed == lane


@pytest.mark.parametrize("bad", ["measure.cpu.c", "measure.cpu.c3-1", "measure.zz.p25", "plan", "measure.3f2a1c9b.p",
                                 "measure.cpu.local.p0.c1", "measure.cpu.Local.p50.c1", "measure.cpu.local.c1"])
def test_bad_lane_names_are_refused(bad):
    with pytest.raises(ValueError):
        lanes.parse(bad, TWO_CORES)


@pytest.mark.parametrize("pct", [0, 101, 150])
def test_gpu_share_outside_range_is_refused(pct):
    with pytest.raises(ShareError, match="outside 1..100"):
        GPU.lane("GPU-3f2a1c9b", pct)


def test_cpu_lane_must_be_contiguous():
    with pytest.raises(ValueError, match="contiguous"):
        CPU.lane([0, 2], TWO_CORES)


def test_lane_share_of_cpu_cores():
    assert CPU.lane([0], TWO_CORES).share == 50
    assert CPU.lane([0, 1], TWO_CORES).share == 100
    assert GPU.lane("GPU-3f2a1c9b", 25).share == 25
    env = CPU.environment(CPU.lane([0, 1], TWO_CORES))
    assert env["TVM_NUM_THREADS"] == "2"
    env = GPU.environment(GPU.lane("GPU-3f2a1c9b", 25), "GPU-3f2a1c9b-x")
    assert env == {"CUDA_VISIBLE_DEVICES": "GPU-3f2a1c9b-x", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25"}


def test_one_worker_id_and_one_gpu_uuid_spelling():
    import os
    import socket

    from shared.ids import gpu8, gpu_hex, worker_id
    from shared.messages import BuilderInfo

    assert worker_id() == f"{socket.gethostname()}.{os.getpid()}"
    assert BuilderInfo(family="llvm", host="h", pid=7, started_at=0).worker == worker_id("h", 7) == "h.7"
    assert gpu_hex(" GPU-3F2A1C9B-0a1b ") == gpu_hex("3f2a1c9b0a1b") == "3f2a1c9b0a1b"
    assert gpu8("GPU-3f2a1c9b-0a1b") == GPU.lane("GPU-3F2A1C9B-0a1b", 25).gpu == "3f2a1c9b"


def test_one_celery_worker_command_line():
    """Lanes, builders and the tuner's workers (stack, `sharetune up`, compose) all run services/workers.py's."""
    import os
    import socket
    from pathlib import Path

    from services.workers import worker_argv

    argv = worker_argv("services.measurer.tasks", "measure.cpu.c0", "lane.measure.cpu.c0", "DEBUG", python="py")
    assert argv == ["py", "-m", "celery", "-A", "services.measurer.tasks", "worker", "-Q", "measure.cpu.c0", "-P",
                    "solo", "-c", "1", "--prefetch-multiplier", "1", "-n",
                    f"lane.measure.cpu.c0.{os.getpid()}@{socket.gethostname()}", "--loglevel", "DEBUG",
                    "--without-gossip", "--without-mingle"]
    root = Path(__file__).resolve().parent.parent
    for path in [*root.glob("services/**/*.py"), *root.glob("sharetune/*.py"), root / "docker-compose.yml"]:
        if path.name != "workers.py":
            assert '"worker", "-Q"' not in path.read_text() and "celery -A" not in path.read_text(), path

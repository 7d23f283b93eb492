import pytest

from shared.errors import ShareError
from shared.names import LaneName


def test_cpu_lane_names_round_trip():
    assert LaneName.for_cpu([0, 1]).queue == "measure.cpu.c0-1"
    assert LaneName.for_cpu([3]).queue == "measure.cpu.c3"
    assert LaneName.parse("measure.cpu.c2-5").cores == (2, 3, 4, 5)
    assert LaneName.parse("measure.cpu.c7").cores == (7,)


def test_gpu_lane_names_round_trip():
    lane = LaneName.for_gpu("GPU-3f2a1c9b-aaaa-bbbb-cccc-0123456789ab", 25)
    assert lane.queue == "measure.3f2a1c9b.p25"
    parsed = LaneName.parse("measure.3f2a1c9b.p25")
    assert (parsed.kind, parsed.gpu, parsed.percent) == ("gpu", "3f2a1c9b", 25)


@pytest.mark.parametrize("bad", ["measure.cpu.c", "measure.cpu.c3-1", "measure.zz.p25", "plan", "measure.3f2a1c9b.p"])
def test_bad_lane_names_are_refused(bad):
    with pytest.raises(ValueError):
        LaneName.parse(bad)


@pytest.mark.parametrize("pct", [0, 101, 150])
def test_gpu_share_outside_range_is_refused(pct):
    with pytest.raises(ShareError, match="outside 1..100"):
        LaneName.for_gpu("GPU-3f2a1c9b", pct)


def test_cpu_lane_must_be_contiguous():
    with pytest.raises(ValueError, match="contiguous"):
        LaneName.for_cpu([0, 2])


def test_lane_share_of_cpu_cores():
    from services.measurer.lanes import lane_environment, lane_share

    assert lane_share(LaneName.for_cpu([0]), total_cores=2) == 50
    assert lane_share(LaneName.for_cpu([0, 1]), total_cores=2) == 100
    assert lane_share(LaneName.for_gpu("GPU-3f2a1c9b", 25)) == 25
    env = lane_environment(LaneName.for_cpu([0, 1]))
    assert env["TVM_NUM_THREADS"] == "2"
    env = lane_environment(LaneName.for_gpu("GPU-3f2a1c9b", 25), "GPU-3f2a1c9b-x")
    assert env == {"CUDA_VISIBLE_DEVICES": "GPU-3f2a1c9b-x", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25"}


def test_one_worker_id_and_one_gpu_uuid_spelling():
    import os
    import socket

    from shared.ids import gpu8, gpu_hex, worker_id
    from shared.messages import BuilderInfo

    assert worker_id() == f"{socket.gethostname()}.{os.getpid()}"
    assert BuilderInfo(family="llvm", host="h", pid=7, started_at=0).worker == worker_id("h", 7) == "h.7"
    assert gpu_hex(" GPU-3F2A1C9B-0a1b ") == gpu_hex("3f2a1c9b0a1b") == "3f2a1c9b0a1b"
    assert gpu8("GPU-3f2a1c9b-0a1b") == LaneName.for_gpu("GPU-3F2A1C9B-0a1b", 25).gpu == "3f2a1c9b"


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

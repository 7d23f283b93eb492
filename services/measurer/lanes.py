"""What a lane is on this host: its share, the environment it must have before TVM or CUDA start, and
the target it builds for. Pure apart from reading the host's core count."""
from __future__ import annotations

import os

from shared.names import LaneName


def host_cores() -> int:
    return os.cpu_count() or 1


def lane_share(lane: LaneName, total_cores: int | None = None) -> int:
    """A lane's share in percent: its MPS percentage on a GPU, its fraction of the cores on a CPU."""
    if lane.kind == "gpu":
        return int(lane.percent)
    total = total_cores or host_cores()
    return max(1, round(100 * len(lane.cores) / total))


def lane_environment(lane: LaneName, gpu_uuid: str | None = None) -> dict[str, str]:
    """Variables that must be set before the lane's process initialises TVM's thread pool or CUDA."""
    if lane.kind == "cpu":
        n = str(len(lane.cores))
        return {"TVM_NUM_THREADS": n, "OMP_NUM_THREADS": n, "CUDA_VISIBLE_DEVICES": ""}
    if not gpu_uuid:
        raise ValueError(f"GPU lane {lane.queue} needs the GPU's full UUID")
    return {"CUDA_VISIBLE_DEVICES": gpu_uuid, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(lane.percent)}


def pin_to_lane(lane: LaneName) -> None:
    """Pin this process (and what it execs) to the lane's cores; a no-op for GPU lanes."""
    if lane.kind == "cpu":
        missing = set(lane.cores) - set(range(host_cores()))
        if missing:
            raise ValueError(f"lane {lane.queue} names cores {sorted(missing)} this host does not have")
        os.sched_setaffinity(0, set(lane.cores))


def lane_pool(gpu_uuid: str | None, share: int | None, cores_per_lane: int | None, node: str,
              cores: list[int] | None = None) -> tuple[str, list[str]]:
    """The lanes replicas of one measurer service divide among themselves (`--scale measurer=N`):
    on a GPU, 100 // share lanes at `share` % (four at 25 %); on a CPU, the host's cores in groups of
    `cores_per_lane`. Returns the claim scope (the GPU, or the node for cores) and the lane queues."""
    if gpu_uuid and share:
        lane = LaneName.for_gpu(gpu_uuid, share)
        return f"gpu-{lane.gpu}", [lane.queue] * (100 // share)
    if cores_per_lane:
        cores = sorted(cores if cores is not None else os.sched_getaffinity(0))
        groups = [cores[i:i + cores_per_lane] for i in range(0, len(cores) - cores_per_lane + 1, cores_per_lane)]
        return f"cpu-{node}", [LaneName.for_cpu(g).queue for g in groups]
    raise ValueError("no lane given: set SHARETUNE_LANE, or SHARETUNE_LANE_SHARE with SHARETUNE_GPU_UUID "
                     "(GPU lanes), or SHARETUNE_LANE_CORES (CPU lanes) for replicas to claim one each")


def builder_environment(family: str, hide_gpus: bool = True) -> dict[str, str]:
    """A builder compiles for its family's explicit target and never needs a device: with no GPU visible and
    a private MPS pipe directory it can never open a CUDA context, so it is never a client of a GPU's MPS
    server (a GPU fault's recovery need not end it). One TVM thread: builders scale by process."""
    env = {"TVM_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    if hide_gpus:
        import tempfile

        env["CUDA_VISIBLE_DEVICES"] = ""
        env["CUDA_MPS_PIPE_DIRECTORY"] = tempfile.mkdtemp(prefix="sharetune-builder-nomps-")
    return env


def parse_cores(spec: str) -> set[int]:
    """"0-15", "16-31,40" -> a core set; ValueError naming the problem."""
    cores: set[int] = set()
    for part in filter(None, (p.strip() for p in spec.split(","))):
        first, _, last = part.partition("-")
        if not first.isdigit() or (last and not last.isdigit()):
            raise ValueError(f"not a core range: {part!r} (e.g. 0-15,32)")
        cores.update(range(int(first), int(last or first) + 1))
    if not cores:
        raise ValueError(f"no cores in {spec!r}")
    return cores

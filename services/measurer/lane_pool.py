"""Which lanes the replicas of one measurer service divide among themselves, and a builder's environment.
What a lane is (its share, placement, environment) is its kind's business: shared.lanes."""
from __future__ import annotations

import os

from shared import lanes


def lane_pool(gpu_uuid: str | None, share: int | None, cores_per_lane: int | None, node: str,
              cores: list[int] | None = None) -> tuple[str, list[str]]:
    """The lanes replicas of one measurer service divide among themselves (`--scale measurer=N`):
    on a GPU, 100 // share lanes at `share` % (four at 25 %); on a CPU, the host's cores in groups of
    `cores_per_lane`. Returns the claim scope (the GPU, or the node for cores) and the lane queues."""
    if gpu_uuid and share:
        gpu = lanes.kind("gpu")
        lane = gpu.lane(gpu_uuid, share)
        return f"gpu-{lane.gpu}", [lane.queue] * gpu.lanes_fit(share, lanes.Host.this(node))
    if cores_per_lane:
        cores = sorted(cores if cores is not None else os.sched_getaffinity(0))
        groups = [cores[i:i + cores_per_lane] for i in range(0, len(cores) - cores_per_lane + 1, cores_per_lane)]
        host = lanes.Host(os.cpu_count() or 1, node)
        return f"cpu-{node}", [lanes.kind("cpu").lane(g, host).queue for g in groups]
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

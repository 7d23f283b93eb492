"""GPU lanes: a GPU, named by its UUID, at an MPS active-thread percentage. The percentage is the share;
it is fixed per process when CUDA initialises, so it goes in the environment before anything touches CUDA.
A candidate's fault under MPS ends every client of the GPU: the GPU is the lanes' fault domain."""
from __future__ import annotations

import re

from shared import names
from shared.errors import ShareError
from shared.ids import gpu_hex
from shared.lanes.base import Host, Lane, LaneKind, register


@register
class GpuLanes(LaneKind):
    name = "gpu"
    target_kind = "cuda"
    mps = True
    device_uuid = True
    build_pool = True  # a CUDA candidate takes seconds to build and microseconds to time

    def lane(self, uuid: str, percent: int) -> Lane:
        if not 1 <= int(percent) <= 100:
            raise ShareError(f"GPU share {percent} % is outside 1..100 %")
        hexdigits = gpu_hex(uuid)
        if len(hexdigits) < 8 or not re.fullmatch(r"[0-9a-f]+", hexdigits[:8]):
            raise ValueError(f"not a GPU UUID: {uuid!r}")
        return Lane(self.name, int(percent), gpu=hexdigits[:8])

    def queue(self, lane: Lane) -> str:
        if lane.gpu is None:
            raise ValueError(f"a GPU lane names its GPU: {lane!r}")
        return names.gpu_lane_queue(lane.gpu, lane.share)

    def parse(self, queue: str, host: Host | None = None) -> Lane | None:
        parsed = names.parse_gpu_lane_queue(queue)
        return self.lane(*parsed) if parsed else None

    def lane_at(self, share: int, host: Host, index: int = 0, device: str | None = None) -> Lane:
        if not device:
            raise ValueError("a GPU lane needs its GPU's UUID")
        return self.lane(device, share)  # lanes of one share on one GPU share its queue

    def lanes_fit(self, share: int, host: Host) -> int:
        return 100 // share

    def check_shares(self, shares: list[int], host: Host) -> None:
        pass  # any whole percentage is an MPS share

    def environment(self, lane: Lane, device_uuid: str | None = None) -> dict[str, str]:
        if not device_uuid:
            raise ValueError(f"GPU lane {lane.queue} needs the GPU's full UUID")
        return {"CUDA_VISIBLE_DEVICES": device_uuid, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(lane.share)}

    def family(self, target: dict) -> str:
        arch = str(target.get("arch") or "")
        if not re.fullmatch(r"sm_[0-9]+[a-z]?", arch):
            raise ValueError(f"a CUDA target needs an explicit arch (sm_XX) to be built apart from its GPU, got {arch!r}")
        return f"cuda.{arch}"

    def timing(self) -> dict:
        # 3 repeats of 3 runs with a 50 ms floor each, ranked by their median: a shared GPU needs the repeats;
        # first at 10 ms each, kept where the three agree within 1 % (TimingConfig.settle_ms)
        return {"number": 3, "repeat": 3, "min_repeat_ms": 50, "settle_ms": 10}

    def fault_domain(self, lane: Lane) -> str | None:
        return lane.gpu

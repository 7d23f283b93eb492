"""CPU lanes: a contiguous range of a host's cores. The share is the fraction of the host's cores, so the
same cores are a different share on a host with another core count; the queue name carries the node and
the share, and a lane refuses to serve a name whose share its host would not give."""
from __future__ import annotations

import os
import re

from shared import names
from shared.errors import LaneError, ShareError
from shared.lanes.base import Host, Lane, LaneKind, register


def share_of_cores(cores: int, host_cores: int) -> int:
    """The share in percent of `cores` of a host's `host_cores`."""
    return max(1, round(100 * cores / host_cores))


def cores_for_share(share: int, host_cores: int) -> int:
    """How many cores a share is; ShareError when it is not a whole number of this host's cores."""
    for n in range(1, host_cores + 1):
        if share_of_cores(n, host_cores) == share:
            return n
    valid = ", ".join(f"{share_of_cores(n, host_cores)} ({n} core{'s' * (n > 1)})" for n in range(1, host_cores + 1))
    raise ShareError(f"on this {host_cores}-core CPU a share must be a whole number of cores; {share} % is not "
                     f"(valid: {valid})")


@register
class CpuLanes(LaneKind):
    name = "cpu"
    target_kind = "llvm"
    sandboxed = True  # a candidate that segfaults or hangs takes only its child
    runs_on_host_cores = True

    def lane(self, cores, host: Host) -> Lane:
        """The lane of these cores (contiguous) on the host, at the share they are there."""
        cores = tuple(sorted(int(c) for c in cores))
        if not cores or cores != tuple(range(cores[0], cores[-1] + 1)):
            raise ValueError(f"a CPU lane is a contiguous, non-empty core range, not {cores}")
        return Lane(self.name, share_of_cores(len(cores), host.cores), cores=cores, node=host.node)

    def queue(self, lane: Lane) -> str:
        return names.cpu_lane_queue(lane.node or "local", lane.share, lane.cores)

    def parse(self, queue: str, host: Host | None = None) -> Lane | None:
        parsed = names.parse_cpu_lane_queue(queue)
        if parsed is None:
            return None
        node, share, cores = parsed
        if share is None:  # the short form: these cores of the host it runs on
            if host is None:
                raise ValueError(f"{queue!r} names cores of a host, and no host was given to place them on")
            return self.lane(cores, host)
        if not cores or not 1 <= share <= 100:
            raise ValueError(f"not a CPU lane queue: {queue!r}")
        return Lane(self.name, share, cores=cores, node=node)

    def lane_at(self, share: int, host: Host, index: int = 0, device: str | None = None) -> Lane:
        n = cores_for_share(share, host.cores)
        return self.lane(range(index * n, (index + 1) * n), host)

    def check_shares(self, shares: list[int], host: Host) -> None:
        if host.cores < 1:
            raise ShareError("CPU shares need the host's core count")
        super().check_shares(shares, host)

    def lanes_fit(self, share: int, host: Host) -> int:
        return host.cores // cores_for_share(share, host.cores)

    def check(self, lane: Lane, host: Host) -> None:
        missing = set(lane.cores) - set(range(host.cores))
        if missing:
            raise LaneError(f"lane {lane.queue} names cores {sorted(missing)} this host does not have")
        here = share_of_cores(len(lane.cores), host.cores)
        if here != lane.share:
            raise LaneError(f"lane {lane.queue} serves {lane.share} %, but its {len(lane.cores)} core(s) are "
                            f"{here} % of this {host.cores}-core host: start lanes named for this host "
                            f"(e.g. {self.lane(lane.cores, Host(host.cores, lane.node or host.node)).queue})")

    def environment(self, lane: Lane, device_uuid: str | None = None) -> dict[str, str]:
        n = str(len(lane.cores))
        return {"TVM_NUM_THREADS": n, "OMP_NUM_THREADS": n, "CUDA_VISIBLE_DEVICES": ""}

    def pin(self, lane: Lane) -> None:
        self.check(lane, Host(os.cpu_count() or 1, lane.node or "local"))
        os.sched_setaffinity(0, set(lane.cores))

    def family(self, target: dict) -> str:
        mcpu = str(target.get("mcpu") or "generic").lower()
        return f"llvm.{re.sub(r'[^a-z0-9_.+-]', '-', mcpu)}"

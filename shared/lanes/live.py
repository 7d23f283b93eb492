"""Which live lanes serve a job, and the one policy for when none does.

A job names a target and a share; the live lanes that serve it are those of the target's lane kind at
exactly that share. When none does, each role acts by the same policy (LaneWaitSettings.live_lane_policy):
the client refuses the job at submit (unless it asked to wait), the planner parks it and looks again
every `recheck_s` for `park_s` (without limit when it asked to wait), and the tuner's lane runner, mid-job,
waits `give_up_s` for a lane to come back and then gives the batch up."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from shared.errors import ShareError


def serving(live: Iterable, lane_kind: str, share: int) -> list:
    """The live lanes (LaneInfo) of `lane_kind` at `share`: the ones that may measure for the job."""
    return [l for l in live if l.kind == lane_kind and l.share == share]


def shares_served(live: Iterable, lane_kind: str) -> list[int]:
    """The shares the live lanes of `lane_kind` serve, ascending."""
    return sorted({l.share for l in live if l.kind == lane_kind})


def waiting_for(lane_kind: str, share: int) -> str:
    return f"a live {lane_kind} lane at {share} %"


@dataclass(frozen=True)
class LiveLanePolicy:
    park_s: float = 120.0  # the planner parks a job this long for a lane of its share, then fails it
    recheck_s: float = 3.0  # how often a parked job is looked at again
    give_up_s: float = 60.0  # mid-job, the tuner waits this long for a lane of the job's share to come back

    def share_at_submit(self, served: list[int], lane_kind: str, share: int | None, wait: bool) -> int:
        """The client's rule: the job's share, or the one share the live lanes serve when none is given;
        ShareError (refused, naming the shares served) when no live lane serves it and the job may not wait."""
        listed = ", ".join(map(str, served))
        if share is None:
            if len(served) == 1:
                return served[0]
            if served:
                raise ShareError(f"live {lane_kind} lanes serve {listed} %: give one of them as the share (--share)")
            raise ShareError(f"no live {lane_kind} lane: start lanes (`sharetune up`), or give a share and wait for "
                             f"its lanes (wait_for_lanes=True, --wait-for-lanes)")
        if share not in served and not wait:
            have = f"live {lane_kind} lanes serve {listed} %" if served else f"no {lane_kind} lane is live"
            raise ShareError(f"no live {lane_kind} lane serves {share} % ({have}); give a served share, or wait for "
                             f"lanes of {share} % (wait_for_lanes=True, --wait-for-lanes)")
        return share

    def parks(self, waited_s: float, wait: bool) -> bool:
        """The planner's rule: does a job with no lane yet stay parked after `waited_s`?"""
        return wait or waited_s < self.park_s

    def unserved(self, lane_kind: str, share: int, waited_s: float, live: Iterable) -> ShareError:
        """Why a job failed for want of lanes, naming the live ones."""
        listed = ", ".join(f"{l.queue} ({l.kind} {l.share} %)" for l in live) or "none"
        return ShareError(f"no live measurer lane serves {lane_kind} at {share} % (waited {waited_s:.0f} s); "
                          f"live lanes: {listed}")

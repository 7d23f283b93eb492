"""Start one measurer lane: `python -m services.measurer --lane measure.cpu.c0-1 [--gpu-uuid UUID]` (a CPU
lane given by its cores is named for this host: node and share),
or one builder: `python -m services.measurer --builder cuda.sm_90|llvm [--cores 16-31]`.
Without a lane (replicas of one compose service), the process claims a free lane of its pool in Redis
(SHARETUNE_LANE_SHARE + SHARETUNE_GPU_UUID, or SHARETUNE_LANE_CORES), so N replicas are N distinct lanes.

Sets the lane's environment and CPU affinity first, then execs a Celery worker (solo pool, so the one
warm process does every build and timing) consuming only the lane's queue."""
from __future__ import annotations

import argparse
import os
import sys

from shared import lanes
from shared.ids import worker_id
from shared.settings import LaneSettings
from services.workers import exec_worker


def main(argv=None) -> None:
    settings = LaneSettings()
    ap = argparse.ArgumentParser(prog="python -m services.measurer")
    ap.add_argument("--lane", default=settings.given("lane"),
                    help="lane queue name, e.g. measure.cpu.c0-1 or measure.3f2a1c9b.p25 (default: claim a free lane of "
                         "the pool SHARETUNE_LANE_SHARE with SHARETUNE_GPU_UUID, or SHARETUNE_LANE_CORES, says)")
    ap.add_argument("--gpu-uuid", default=settings.gpu_uuid)
    ap.add_argument("--loglevel", default=settings.log_level)
    ap.add_argument("--builder", metavar="FAMILY", default=settings.builder,
                    help="run a builder of this family instead of a lane: cuda.sm_90, llvm.<mcpu>, or llvm (this host's CPU)")
    ap.add_argument("--cores", help="CPU cores to run on, e.g. 16-31 (builders)")
    args = ap.parse_args(argv)
    if args.builder:
        return exec_builder(args.builder, args.cores, args.loglevel, settings.builder_hide_gpus,
                            settings.batch_priority)
    from shared.errors import SharetuneError

    claim = None
    try:
        if args.lane:
            lane = lanes.parse(args.lane, settings.host())
        else:
            lane, claim = claim_lane(args.gpu_uuid, settings)
        kind = lanes.of(lane)
        kind.check(lane, settings.host())  # a name whose share this host would not give is refused
        env = dict(os.environ, **kind.environment(lane, args.gpu_uuid), SHARETUNE_LANE=lane.queue)
        kind.pin(lane)
    except (SharetuneError, ValueError, OSError) as err:
        sys.exit(f"measurer: {err}")
    if claim:
        env["SHARETUNE_LANE_CLAIM"] = claim
    if args.gpu_uuid:
        env["SHARETUNE_GPU_UUID"] = args.gpu_uuid
    exec_worker("services.measurer.tasks", lane.queue, f"lane.{lane.queue}", args.loglevel, env)


def exec_builder(family: str, cores: str | None, loglevel: str, hide_gpus: bool = True,
                 batch_priority: str = "idle") -> None:
    from shared.names import build_queue, check_family
    from services.measurer.lane_pool import builder_environment, parse_cores

    if family == "llvm":  # this host's CPU
        from services.measurer.metaschedule.host import system_cpu

        family = lanes.target_family({"kind": "llvm", "mcpu": system_cpu()})
    try:
        queue = build_queue(check_family(family))
        if cores:
            os.sched_setaffinity(0, parse_cores(cores))
    except (ValueError, OSError) as err:
        sys.exit(f"measurer: {err}")
    env = dict(os.environ, **builder_environment(family, hide_gpus), SHARETUNE_BUILDER_FAMILY=family)
    exec_worker("services.measurer.tasks", queue, f"builder.{family}", loglevel, env, batch_priority)


def claim_lane(gpu_uuid: str | None, settings: LaneSettings) -> tuple[lanes.Lane, str]:
    """Take the lane of this service's pool this worker already holds (a container restarted in place is
    the same host.pid), else the first no live replica holds (exec keeps the pid, so the lane's heartbeat
    refreshes the same claim)."""
    from shared import names, store
    from shared.errors import LaneError
    from services.measurer.lane_pool import lane_pool

    scope, pool = lane_pool(gpu_uuid, settings.lane_share, settings.lane_cores, settings.node)
    slot = store.claim_slot(store.connect(settings.redis_url), scope, len(pool), worker_id())
    if slot is None:
        raise LaneError(f"all {len(pool)} lanes of pool {scope} ({pool[0]} ...) are held by live replicas; "
                        "scale the service down or give the new replicas another share or node")
    return lanes.parse(pool[slot]), names.lane_claim_key(scope, slot)


if __name__ == "__main__":
    main()

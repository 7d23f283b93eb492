"""Start one measurer lane: `python -m services.measurer --lane measure.cpu.c0-1 [--gpu-uuid UUID]`.

Sets the lane's environment and CPU affinity first, then execs a Celery worker (solo pool, so the one
warm process does every build and timing) consuming only the lane's queue."""
from __future__ import annotations

import argparse
import os
import socket
import sys

from shared.names import LaneName
from services.measurer.lanes import lane_environment, pin_to_lane


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m services.measurer")
    ap.add_argument("--lane", required=True, help="lane queue name, e.g. measure.cpu.c0-1 or measure.3f2a1c9b.p25")
    ap.add_argument("--gpu-uuid", default=os.environ.get("SHARETUNE_GPU_UUID"))
    ap.add_argument("--loglevel", default=os.environ.get("SHARETUNE_LOG_LEVEL", "INFO"))
    args = ap.parse_args(argv)
    lane = LaneName.parse(args.lane)
    env = dict(os.environ, **lane_environment(lane, args.gpu_uuid), SHARETUNE_LANE=lane.queue)
    if args.gpu_uuid:
        env["SHARETUNE_GPU_UUID"] = args.gpu_uuid
    pin_to_lane(lane)
    cmd = [
        sys.executable, "-m", "celery", "-A", "services.measurer.tasks", "worker",
        "-Q", lane.queue, "-P", "solo", "-c", "1", "--prefetch-multiplier", "1",
        "-n", f"lane.{lane.queue}.{os.getpid()}@{socket.gethostname()}", "--loglevel", args.loglevel,
        "--without-gossip", "--without-mingle",
    ]
    os.execve(sys.executable, cmd, env)


if __name__ == "__main__":
    main()

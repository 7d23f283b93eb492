"""Run this host's node agent until SIGTERM: `python -m services.measurer.agent --lanes 4x25 --builders 12`.

What `sharetune up --join` and a compose or Kubernetes GPU node run: the agent starts the host's lanes (and
the MPS daemon they need), its builders, restarts what dies, recovers a faulted GPU, and keeps its liveness
key in the store. Options default to the environment (REDIS_URL, shared.settings.AgentSettings:
SHARETUNE_AGENT_LANES, SHARETUNE_BUILDERS, SHARETUNE_BUILDER_CORES, SHARETUNE_WORK_DIR), as a container sets
them."""
from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path


def main(argv=None) -> int:
    from shared.settings import AgentSettings

    s = AgentSettings()
    ap = argparse.ArgumentParser(prog="python -m services.measurer.agent")
    ap.add_argument("--lanes", default=s.agent_lanes,
                    help="cpu (a lane per core), lane queue names (measure.cpu.c0,...) or a GPU share spec (4x25, 2x50)")
    ap.add_argument("--builders", type=int, default=s.builders,
                    help="build workers per family the lanes build for (0: the lanes build for themselves)")
    ap.add_argument("--builder-cores", default=s.builder_cores)
    ap.add_argument("--work-dir", default=str(s.work_dir))
    ap.add_argument("--redis-url", default=s.given("redis_url"))
    ap.add_argument("--loglevel", default=s.log_level)
    ap.add_argument("--wait-s", type=float, default=300.0, help="how long the lanes and builders may take to come up")
    args = ap.parse_args(argv)
    import logging

    logging.basicConfig(level=args.loglevel, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not args.redis_url:
        sys.exit("agent: no Redis URL (--redis-url or REDIS_URL)")
    from shared.errors import SharetuneError
    from services.measurer.agent import BuilderSpec, NodeAgent, NodeConfig, lanes_from_spec

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        agent = NodeAgent(NodeConfig(Path(args.work_dir), args.redis_url, args.loglevel), s,
                          lanes_from_spec(args.lanes, s.host()), builders=BuilderSpec(args.builders, args.builder_cores))
    except (SharetuneError, ValueError) as err:
        sys.exit(f"agent: {err}")
    try:
        agent.start(args.wait_s)
        logging.getLogger(agent.log_name).info("agent up: lanes %s, %d builders", agent.lanes, len(agent.builder_procs))
        stop.wait()
    except (SharetuneError, RuntimeError, TimeoutError) as err:
        logging.getLogger(agent.log_name).error("agent: %s", err)
        return 1
    finally:
        agent.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())

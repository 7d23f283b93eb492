"""A container's health, for docker compose and Kubernetes probes: `python -m services.healthcheck`, exit 0
when a worker of this host (container) serves.

Served means: a liveness key of this host's own worker is in Redis (a lane, a builder, a warm tuner client,
a planner and an updater each keep one while they serve, from a heartbeat thread that beats during a long task
too). A Celery ping is not enough: a worker whose start-up failed answers it as well. A lane still warming up
has no key yet, so `start_period` covers its warm-up."""
from __future__ import annotations

import socket
import sys

PROBE_TIMEOUT_S = 3.0


def main() -> int:
    from shared import store
    from shared.settings import CommonSettings

    url, host = CommonSettings().redis_url, socket.gethostname()
    unreachable = store.unreachable(url, timeout_s=PROBE_TIMEOUT_S)
    if unreachable:
        print(f"unhealthy: Redis: {unreachable}")
        return 1
    key = store.host_liveness_key(store.connect_probe(url, PROBE_TIMEOUT_S), host)
    if key:
        print(f"healthy: {key}")
        return 0
    print(f"unhealthy: no worker of this container ({host}) keeps a liveness key")
    return 1


if __name__ == "__main__":
    sys.exit(main())

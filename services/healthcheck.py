"""A container's health, for docker compose and Kubernetes probes: `python -m services.healthcheck`, exit 0
when a worker of this host (container) serves.

Served means: a liveness key of this host's worker is in Redis (a lane, a builder or a warm tuner client
keeps one while it serves, from a heartbeat thread that beats during a long task too); else the worker
answers a Celery ping (the planner and the updater keep no liveness key; a solo-pool worker answers between
tasks). A lane still warming up is neither, so `start_period` covers its warm-up."""
from __future__ import annotations

import socket
import sys

PROBE_TIMEOUT_S = 3.0


def answers_ping(redis_url: str, host: str, timeout_s: float) -> bool:
    """A Celery worker whose node name ends in @host answers a broadcast ping (workers name their node
    `role.pid@host`, services.workers)."""
    from services.celery_app import make_celery  # Celery only through the one app factory

    app = make_celery("healthcheck", redis_url)
    try:
        replies = app.control.ping(timeout=timeout_s)
    finally:
        app.close()
    return any(node.endswith(f"@{host}") for reply in replies for node in reply)


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
    if answers_ping(url, host, timeout_s=PROBE_TIMEOUT_S):
        print(f"healthy: a worker @{host} answers ping")
        return 0
    print(f"unhealthy: no liveness key and no ping answer from a worker @{host}")
    return 1


if __name__ == "__main__":
    sys.exit(main())

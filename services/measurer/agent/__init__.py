"""The node agent (node.py): one per host, it keeps that host's lanes and builders running and recovers its
GPUs; `python -m services.measurer.agent` runs one."""
from services.measurer.agent.node import (  # noqa: F401
    CLIENT_GRACE_S, MAX_RESTARTS, MPS_MAX_CLIENTS, REPO, RESTART_WINDOW_S, NodeAgent, alive, default_cpu_lanes,
    gpu_build_workers, gpu_lanes, lanes_from_spec, restart_backoff_s, signal_group
)

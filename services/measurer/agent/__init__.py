"""The node agent (node.py): one per host, it keeps that host's lanes and builders running and recovers its
GPUs; `python -m services.measurer.agent` runs one. Its parts: processes.py (spawn, back-off, give-up),
builders.py (the build workers) and gpu_recovery.py (lane restarts and GPU recovery)."""
from services.measurer.agent.builders import BuilderPool, BuilderSpec
from services.measurer.agent.gpu_recovery import CLIENT_GRACE_S, GpuRecovery, HostProcesses
from services.measurer.agent.node import (MPS_MAX_CLIENTS, NodeAgent, default_cpu_lanes, gpu_build_workers, gpu_lanes,
                                          lanes_from_spec)
from services.measurer.agent.processes import (MAX_RESTARTS, REPO, RESTART_WINDOW_S, NodeConfig, ProcessSupervisor,
                                               alive, restart_backoff_s, signal_group, start_guarded)

__all__ = ["BuilderPool", "BuilderSpec", "CLIENT_GRACE_S", "GpuRecovery", "HostProcesses", "MAX_RESTARTS",
           "MPS_MAX_CLIENTS", "NodeAgent", "NodeConfig", "ProcessSupervisor", "REPO", "RESTART_WINDOW_S", "alive",
           "default_cpu_lanes", "gpu_build_workers", "gpu_lanes", "lanes_from_spec", "restart_backoff_s",
           "signal_group", "start_guarded"]

"""Identities that several processes must spell the same way: a worker process, a GPU."""
from __future__ import annotations

import os
import socket


def worker_id(host: str | None = None, pid: int | None = None) -> str:
    """A worker process as `host.pid` (this process by default): liveness keys, lane claims, shard leases
    and batch marks name it, and a lane's exec keeps its pid, so the id survives the exec."""
    return f"{host if host is not None else socket.gethostname()}.{pid if pid is not None else os.getpid()}"


def gpu_hex(uuid: str) -> str:
    """A GPU UUID's hex digits, lower case: "GPU-3F2A1C9B-..." and "3f2a1c9b..." compare equal."""
    return uuid.strip().lower().removeprefix("gpu-").replace("-", "")


def gpu8(uuid: str) -> str:
    """The first 8 hex digits of a GPU UUID: what a GPU lane queue name carries (shared.lanes.gpu)."""
    return gpu_hex(uuid)[:8]

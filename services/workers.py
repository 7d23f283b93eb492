"""The one Celery worker command line. Every worker of the system (planner, tuner client, updater,
measurer lane, builder) is started through it, by its service's `python -m services.<service>` entry
point, whether the local stack, `sharetune up` or docker compose starts that entry point."""
from __future__ import annotations

import os
import socket
import sys


def worker_argv(app_module: str, queue: str, name: str, loglevel: str = "INFO",
                python: str = sys.executable) -> list[str]:
    """A worker consuming only `queue`: a solo pool (the one warm process does every task, so TVM and a
    lane's CUDA context load once), one message at a time, no gossip or mingle (workers coordinate
    through Redis keys, not Celery's broadcasts). Its node name, `name.pid@host`, carries this process's
    pid: the caller execs it (exec_worker), so it is the worker's own."""
    return [python, "-m", "celery", "-A", app_module, "worker", "-Q", queue, "-P", "solo", "-c", "1",
            "--prefetch-multiplier", "1", "-n", f"{name}.{os.getpid()}@{socket.gethostname()}", "--loglevel", loglevel,
            "--without-gossip", "--without-mingle"]


def exec_worker(app_module: str, queue: str, name: str, loglevel: str = "INFO",
                env: dict[str, str] | None = None, batch_priority: str | None = None) -> None:
    """Replace this process with the worker (same pid: a claim or liveness key made before stays right); a batch
    role (not a lane) gives its `batch_priority` first."""
    if batch_priority is not None:
        from shared.cpu_priority import yield_cpu

        yield_cpu(batch_priority)
    argv = worker_argv(app_module, queue, name, loglevel)
    os.execve(argv[0], argv, dict(os.environ) if env is None else env)

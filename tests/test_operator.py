"""The operator's side (issue 14, part 2): a missing Redis, bad numbers, the default share, a job
waiting for lanes, budget advice, and the end-to-end latency in `sharetune results`."""
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cli(*args, redis_url: str, timeout: float = 60):
    env = {**os.environ, "REDIS_URL": redis_url}
    t0 = time.time()
    out = subprocess.run([sys.executable, "-m", "sharetune", *args], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=timeout)
    return out, time.time() - t0


def test_submit_without_redis_fails_fast_with_one_line():
    url = f"redis://127.0.0.1:{_unused_port()}/0"
    out, elapsed = _cli("submit", "tiny", redis_url=url)
    assert elapsed <= 5, elapsed
    assert out.returncode != 0
    assert "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and url in lines[0] and "cannot reach Redis" in lines[0], out.stderr

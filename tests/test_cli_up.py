"""`sharetune up` leaves a working stack running as local processes; `sharetune down` stops exactly those."""
import os
import stat
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import redis

from services.broker.server import SERVICE_USER
from shared.lanes import Host
from shared.lanes import parse as parse_lane
from shared.store import masked_url
from sharetune.stack import supervisor

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.e2e


def _cli(*args, env=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "sharetune", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=env)


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_up_then_down(tmp_path):
    """A real `up` in a fresh work dir, then `down`. The printed URL is masked, W/redis_url holds it in full
    (0600), the workers run with it in their environment and not in their argv, the supervisor's log shows it
    masked (the store's locks: tests/test_store_auth.py); `down` stops exactly the processes `up` started."""
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    up = _cli("up", "--work-dir", str(tmp_path), "--lanes", "measure.cpu.c0", "--tuners", "1", env=env)
    try:
        assert up.returncode == 0, up.stderr[-2000:]
        printed = next(l.split("=", 1)[1] for l in up.stdout.splitlines() if l.startswith("REDIS_URL="))
        url = (tmp_path / supervisor.URL_FILE).read_text().strip()  # the full URL: printed masked, in the file
        password = urlsplit(url).password
        assert urlsplit(url).username == SERVICE_USER and password
        assert printed == masked_url(url) and "****" in printed
        assert password not in up.stdout + up.stderr and str(tmp_path / supervisor.URL_FILE) in up.stdout
        assert _mode(tmp_path / supervisor.URL_FILE) == 0o600 and _mode(tmp_path / supervisor.STATE_FILE) == 0o600
        assert _mode(tmp_path / "redis") == 0o700
        state = supervisor.read_state(tmp_path)
        pids = list(state["pids"].values()) + [state["redis_pid"]]
        for name, pid in state["pids"].items():
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            assert f"REDIS_URL={url}".encode() in environ, name
            assert password.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes(), name
        for pid in (state["supervisor_pid"], state["redis_pid"]):
            assert password.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
        assert password not in (tmp_path / "logs" / "supervisor.log").read_text(errors="replace")
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis(port=urlsplit(url).port).ping()
        lanes = _cli("lanes", env={**env, "REDIS_URL": url}, timeout=60)
        assert lanes.returncode == 0 and parse_lane("measure.cpu.c0", Host.this("local")).queue in lanes.stdout
    finally:
        down = _cli("down", "--work-dir", str(tmp_path), env=env, timeout=200)
    assert down.returncode == 0, down.stderr[-2000:]
    from services.measurer.agent import alive as _alive

    assert not any(_alive(p) for p in pids)
    assert not (tmp_path / "stack.json").exists()


def test_a_refused_up_says_why_in_one_line(tmp_path):
    work = tmp_path / "stack"
    out = _cli("up", "--work-dir", str(work), "--lanes", "measure.nosuchkind.c0", timeout=120)
    assert out.returncode == 1
    lines = [l for l in out.stderr.strip().splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("sharetune up: the stack did not start: "), out.stderr
    assert "nosuchkind" in lines[0] and "Traceback" not in out.stderr
    assert "supervisor.log" in lines[0]  # where the details are

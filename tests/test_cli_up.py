"""`sharetune up` leaves a working stack running as local processes; `sharetune down` stops exactly those."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shared.lanes import Host
from shared.lanes import parse as parse_lane
from shared.store import masked_url

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.e2e


def _cli(*args, env=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "sharetune", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_up_then_down(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    up = _cli("up", "--work-dir", str(tmp_path), "--lanes", "measure.cpu.c0", env=env)
    assert up.returncode == 0, up.stderr[-2000:]
    printed = next(l.split("=", 1)[1] for l in up.stdout.splitlines() if l.startswith("REDIS_URL="))
    url = (tmp_path / "redis_url").read_text().strip()  # the full URL: printed masked, the password in the file
    assert printed == masked_url(url) and "****" in printed
    import json

    state = json.loads((tmp_path / "stack.json").read_text())
    pids = list(state["pids"].values()) + [state["redis_pid"]]
    try:
        lanes = _cli("lanes", env={**env, "REDIS_URL": url}, timeout=60)
        assert lanes.returncode == 0 and parse_lane("measure.cpu.c0", Host.this("local")).queue in lanes.stdout
    finally:
        down = _cli("down", "--work-dir", str(tmp_path), env=env, timeout=120)
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

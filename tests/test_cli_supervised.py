"""`sharetune up` runs its stack under a supervisor of its own: a lane, a tuner client, the planner and the
updater killed with SIGKILL come back (new pids, restarts counted in `sharetune services`) and tune a job; a
second `up` in the same work dir is refused naming the running stack; `down` stops every process by PID;
`down` again says so in one line."""
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shared.lanes import Host
from shared.lanes import parse as parse_lane
from shared.store import masked_url

ROOT = Path(__file__).resolve().parent.parent
LANE_PROC = "lane-" + parse_lane("measure.cpu.c0", Host.this("local")).queue  # the lane of core 0, named for this host


def _cli(*args, env, timeout=300):
    return subprocess.run([sys.executable, "-m", "sharetune", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=env)


def _services(work, env) -> dict:
    out = _cli("services", "--work-dir", str(work), "--json", env=env, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr[-2000:]
    return json.loads(out.stdout)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_choose_port_keeps_the_recorded_one(tmp_path):
    from sharetune.stack.supervisor import URL_FILE, choose_port

    port = _free_port()
    (tmp_path / URL_FILE).write_text(f"redis://127.0.0.1:{port}/0\n")
    assert choose_port(tmp_path) == port
    with socket.socket() as busy:  # the recorded one taken: 6379 if free, else another free one
        busy.bind(("127.0.0.1", port))
        busy.listen()
        assert choose_port(tmp_path) != port


@pytest.mark.e2e
def test_up_is_supervised_refuses_a_second_stack_and_down_stops_everything(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    port = _free_port()  # recorded as if by an earlier `up` (and keeps this test off 6379)
    (tmp_path / "redis_url").write_text(f"redis://127.0.0.1:{port}/0\n")
    # REDIS_URL still exported from that earlier stack (nothing answers there now): `up` starts its Redis again
    up = _cli("up", "--work-dir", str(tmp_path), "--lanes", "measure.cpu.c0",
              env={**env, "REDIS_URL": f"redis://127.0.0.1:{port}/0"})
    assert up.returncode == 0, up.stderr[-2000:]
    printed = next(l.split("=", 1)[1] for l in up.stdout.splitlines() if l.startswith("REDIS_URL="))
    # the same port; the URL printed masked, in full (the services user and its password) in W/redis_url
    url = (tmp_path / "redis_url").read_text().strip()
    assert printed == f"redis://sharetune:****@127.0.0.1:{port}/0" == masked_url(url) != url
    seen: set[int] = set()
    try:
        st = _services(tmp_path, env)
        rows = {r["name"]: r for r in st["services"]}
        assert {"redis", "planner", "tuner0", "updater", LANE_PROC} <= set(rows)
        assert st["supervisor_alive"] and all(r["alive"] and r["restarts"] == 0 for r in rows.values())
        seen |= {r["pid"] for r in rows.values()} | {st["supervisor_pid"]}

        again = _cli("up", "--work-dir", str(tmp_path), "--lanes", "measure.cpu.c0", env=env, timeout=60)
        assert again.returncode != 0
        assert printed in again.stderr and str(st["supervisor_pid"]) in again.stderr
        assert _services(tmp_path, env)["supervisor_pid"] == st["supervisor_pid"]  # nothing changed

        killed = {n: rows[n]["pid"] for n in (LANE_PROC, "tuner0", "planner", "updater")}
        for pid in killed.values():
            os.kill(pid, signal.SIGKILL)
        deadline = time.time() + 120
        while True:
            now = {r["name"]: r for r in _services(tmp_path, env)["services"]}
            back = all(now[n]["alive"] and now[n]["pid"] != pid and now[n]["restarts"] == 1 for n, pid in killed.items())
            if back:
                break
            assert time.time() < deadline, now
            time.sleep(1)
        seen |= {r["pid"] for r in now.values()}
        # the CLI finds the stack through WORK_DIR/redis_url when REDIS_URL is not set; the new lane is live (the
        # killed one's key went with it, so only the restarted lane can serve)
        deadline = time.time() + 120
        while True:
            lanes = _cli("lanes", "--json", env={**env, "SHARETUNE_WORK_DIR": str(tmp_path)}, timeout=60)
            assert lanes.returncode == 0, lanes.stderr[-2000:]
            live = [l.get("pid") for l in json.loads(lanes.stdout)]
            if now[LANE_PROC]["pid"] in live:
                break
            assert time.time() < deadline, lanes.stdout
            time.sleep(1)
        assert killed[LANE_PROC] not in live
        # the restarted stack tunes: a job planned, searched, measured and finished by the new processes
        from sharetune.client import Client

        job = Client(url).submit("tiny", target="llvm", trials=4, trials_per_iter=4, seed=21)
        assert job.wait(timeout_s=600)["state"] == "done"
    finally:
        down = _cli("down", "--work-dir", str(tmp_path), env=env, timeout=200)
    assert down.returncode == 0 and down.stdout.startswith("stopped: "), down.stdout + down.stderr[-2000:]
    from services.measurer.agent import alive as _alive

    assert not [p for p in seen if _alive(p)]
    assert not (tmp_path / "stack.json").exists()
    twice = _cli("down", "--work-dir", str(tmp_path), env=env, timeout=60)
    assert twice.returncode in (0, 1) and twice.stdout.strip() == f"no stack running in {tmp_path}"
    assert "Traceback" not in twice.stderr and len((twice.stdout + twice.stderr).strip().splitlines()) == 1

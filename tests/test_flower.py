"""Flower, unmodified, started against the stack's broker, finds our workers and lane queues."""
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from shared import names

pytestmark = pytest.mark.e2e


def test_flower_sees_workers_and_lane_queues(stack, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "FLOWER_UNAUTHENTICATED_API": "true"}  # Flower 2 closes its API without auth
    proc = subprocess.Popen([sys.executable, "-m", "celery", f"--broker={stack.redis_url}", "flower",
                             f"--port={port}", "--address=127.0.0.1", f"--db={tmp_path / 'flower.db'}"],
                            env=env, stdout=open(tmp_path / "flower.log", "wb"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    wanted = {names.PLAN_QUEUE, names.TUNE_QUEUE, names.COSTMODEL_QUEUE, *stack.lanes}
    try:
        deadline = time.time() + 180
        queues, workers = set(), {}
        while not wanted <= queues:
            assert proc.poll() is None, (tmp_path / "flower.log").read_text()[-2000:]
            assert time.time() < deadline, f"flower saw queues {queues}, wanted {wanted}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/workers?refresh=1", timeout=30) as resp:
                    workers = json.load(resp)
            except OSError:
                time.sleep(0.5)
                continue
            queues = {q["name"] for w in workers.values() for q in (w.get("active_queues") or [])}
            time.sleep(0.5)
        lane_workers = [w for w in workers if w.startswith("lane.")]
        assert len(lane_workers) >= len(stack.lanes)
        assert any(w.startswith("planner.") for w in workers) and any(w.startswith("tuner0.") for w in workers)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)

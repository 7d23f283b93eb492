"""`sharetune report JOB`: the data behind the plots, and the page as headless Chromium renders it."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from shared import store

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.e2e

MATRIX = {"model": "tiny", "shares": [25, 50, 100], "latency_us": [[410.2, 260.0, 190.5], [455.1, 231.7, 170.2],
                                                                   [520.9, 250.3, 151.8]]}


def _browser() -> str | None:
    for name in (os.environ.get("SHARETUNE_BROWSER"), "chromium", "chromium-browser", "google-chrome", "headless_shell"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def test_report_data_matches_the_store(tuned_tiny, redis_conn):
    from sharetune.experiments.report import job_data

    data = job_data(redis_conn, tuned_tiny.job_id)
    res = tuned_tiny.result()
    assert {t["name"] for t in data["tasks"].values()} == {t.name for t in res.tasks}
    assert sum(len(t["curve"]) for t in data["tasks"].values()) == res.trials
    for t in res.tasks:  # each curve ends at the task's best from this job's records
        curve = data["tasks"][t.task_id]["curve"]
        assert [c["trial"] for c in curve] == list(range(1, len(curve) + 1))
        bests = [c["best_us"] for c in curve if c["best_us"] is not None]
        assert bests == sorted(bests, reverse=True)  # a best never gets worse
    # every batch a lane measured for the job is there, by lane worker; utilisation is a fraction
    batches = store.lane_batches(redis_conn, tuned_tiny.job_id)
    assert batches and sum(len(v) for v in data["lanes"].values()) == len(batches)
    assert all(b.lane.startswith("measure.cpu.") and b.finished_at >= b.started_at for b in batches)
    assert all(0.0 <= u <= 1.0 for pts in data["utilisation"].values() for _, u in pts)
    assert data["job_curve"] and data["job_curve"][-1]["est_us"] > 0
    assert data["accounting"]["recorded"] == res.trials and data["accounting"]["lost"] == 0
    from sharetune.experiments.report import render_html

    assert f"{res.trials} recorded, 0 outstanding, 0 lost" in render_html(data)


def test_report_renders_in_headless_chromium(tuned_tiny, stack, tmp_path):
    matrix = tmp_path / "matrix.json"
    matrix.write_text(json.dumps(MATRIX))
    out = tmp_path / "report.html"
    env = {**os.environ, "REDIS_URL": stack.redis_url}
    run = subprocess.run([sys.executable, "-m", "sharetune", "report", tuned_tiny.job_id, "-o", str(out),
                          "--matrix", str(matrix)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    page = out.read_text()
    assert page.count("<svg") == 6 and "Share matrix" in page and "<script" not in page
    browser = _browser()
    if browser is None:
        pytest.skip("no headless Chromium binary on this machine (set SHARETUNE_BROWSER to one)")
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={tmp_path / 'profile'}", "--hide-scrollbars", "--window-size=1400,2200"]
    dom = subprocess.run([browser, *flags, "--dump-dom", out.as_uri()], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert dom.stdout.count("<svg") == 6 and "Lane utilisation over time" in dom.stdout
    for name in (t.name for t in tuned_tiny.result().tasks):
        assert name in dom.stdout
    png = tmp_path / "report.png"
    shot = subprocess.run([browser, *flags, f"--screenshot={png}", out.as_uri()], capture_output=True, text=True,
                          timeout=120)
    assert shot.returncode == 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png.stat().st_size > 20_000  # a blank page of this size compresses to a few kB
    keep = os.environ.get("SHARETUNE_KEEP_SCREENSHOTS")
    if keep:
        shutil.copy(png, Path(keep) / "report.png")


def test_the_page_says_why_a_job_stopped_early():
    from sharetune.experiments.report import render_html

    data = {"job_id": "j1", "name": "tiny", "target": "llvm", "share": 50, "budget": 64, "state": "done", "error": None,
            "tasks": {}, "job_curve": [], "lanes": {}, "utilisation": {}, "end_s": 1.0, "accounting": None,
            "result": {"wall_s": 3.0, "time_split_s": {}, "stopped": "time limit: 60 s of tuning passed"}}
    assert "done</b> - stopped early: time limit: 60 s of tuning passed" in render_html(data)
    assert "stopped early" not in render_html({**data, "result": {**data["result"], "stopped": None}})

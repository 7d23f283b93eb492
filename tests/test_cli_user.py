"""The user's side of the CLI against a real stack: status, watch, results, export, lanes, cancel,
each with --json for scripts; and cancel stopping a running job between rounds."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shared import lanes as lane_kinds
from shared import names, store

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def cli(stack):
    # a wide terminal, whatever runs the suite (xdist's workers inherit a narrow one): task names stay whole
    env = {**os.environ, "REDIS_URL": stack.redis_url, "COLUMNS": "160"}

    def run(*args, timeout=300):
        out = subprocess.run([sys.executable, "-m", "sharetune", *args], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=timeout)
        assert out.returncode in (0, 1), out.stderr[-2000:]
        return out

    return run


def test_status_results_lanes_as_json(cli, tuned_tiny, client):
    st = json.loads(cli("status", tuned_tiny.job_id, "--json").stdout)
    assert st["state"] == "done" and st["estimates"]["eta_s"] == 0.0
    assert st["trials"] == sum(t["trials"] for t in st["tasks"])
    res = json.loads(cli("results", tuned_tiny.job_id, "--json").stdout)
    assert res["trials"] == st["trials"] and res["tuned_module_path"]
    listing = json.loads(cli("status", "--json").stdout)  # the newest 20 (earlier tests' jobs may push this one out)
    assert listing and [j["job_id"] for j in listing] == [j.job_id for j in client.jobs(20)]
    lanes = json.loads(cli("lanes", "--json").stdout)
    assert {lane_kinds.parse("measure.cpu.c0", lane_kinds.Host.this("local")).queue} <= {l["queue"] for l in lanes}
    text = cli("status", tuned_tiny.job_id).stdout
    assert "trials" in text and all(t["task"] in text for t in st["tasks"])
    # where the trials went, in the JSON and in the text of both commands
    acc = st["accounting"]
    assert acc["claimed"] == acc["recorded"] == st["trials"] and acc["lost"] == acc["outstanding"] == 0
    assert res["accounting"]["recorded"] == st["trials"] and res["accounting"]["lost"] == 0
    line = f"trials: {acc['claimed']} claimed, {acc['recorded']} recorded, 0 outstanding, 0 lost"
    assert line in text and line in cli("results", tuned_tiny.job_id).stdout


def test_watch_ends_with_the_job(cli, tuned_tiny):
    out = cli("watch", tuned_tiny.job_id, "--json", timeout=60)
    lines = [json.loads(l) for l in out.stdout.splitlines()]
    assert out.returncode == 0 and lines[-1]["state"] == "done"


def test_export_writes_a_tvm_database_and_every_record(cli, tuned_tiny, tmp_path, redis_conn):
    info = json.loads(cli("export", tuned_tiny.job_id, "-o", str(tmp_path / "db"), "--json").stdout)
    # TVM's two files, and every repeat of every record beside them
    assert sorted(os.listdir(tmp_path / "db")) == ["database_repeats.json", "database_tuning_record.json",
                                                   "database_workload.json"]
    # the count is what TVM's file holds (a workload that keeps its default schedule has no record there)
    assert info["records"] == len((tmp_path / "db" / "database_tuning_record.json").read_text().splitlines()) > 0
    cli("export", tuned_tiny.job_id, "-o", str(tmp_path / "rows"), "--format", "jsonl")
    rows = [json.loads(x) for x in (tmp_path / "rows" / "records.jsonl").read_text().splitlines()]
    assert rows and {x["job_id"] for x in rows} == {tuned_tiny.job_id}  # this job's records, errors too
    wkeys = [t.wkey for t in store.job_tasks(redis_conn, tuned_tiny.job_id)]
    everyone = sum(1 for w in wkeys for rec in store.records(redis_conn, w) if rec.job_id == tuned_tiny.job_id)
    assert len(rows) == everyone
    cli("export", tuned_tiny.job_id, "-o", str(tmp_path / "all"), "--format", "jsonl", "--all-jobs")
    rows = (tmp_path / "all" / "records.jsonl").read_text().splitlines()
    assert len(rows) == sum(redis_conn.hlen(names.records_key(w)) for w in wkeys)


def test_submit_wait_prints_the_status_view(cli, lane_share):
    out = cli("submit", "tiny", "--share", str(lane_share), "--trials", "8", "--per-iter", "4", "--seed", "3", "--wait")
    job_id = out.stdout.splitlines()[0]
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"job {job_id} (tiny, llvm at {lane_share} %): done" in out.stdout  # not the store's raw hash
    assert "trials" in out.stdout and "{" not in out.stdout


def test_cancel_stops_a_running_job_between_rounds(cli, client, lane_share, redis_conn, tuned_tiny):
    job = client.submit("tiny", target="llvm", share=lane_share, trials=5000, trials_per_iter=4, seed=7)
    deadline = time.time() + 600
    while job.status()["trials"] == 0:  # at least one round measured: the tuner is in the search
        assert job.state()["state"] not in ("failed", "done"), job.state()
        assert time.time() < deadline
        time.sleep(0.5)
    out = json.loads(cli("cancel", job.job_id, "--json").stdout)
    assert out == {"job_id": job.job_id, "state": "cancelled"}
    # the one tuner client is free again only once it has left the cancelled job's search
    nxt = client.submit("tiny", target="llvm", share=lane_share, trials=4, trials_per_iter=4, seed=8)
    assert nxt.wait(timeout_s=600)["state"] == "done"
    st = job.status()
    assert st["state"] == "cancelled" and 0 < st["trials"] < 5000
    res = store.job_result(redis_conn, job.job_id)  # partial results, once the tuner has finished it
    assert res is None or res.trials < 5000
    # the trials counted are the records kept (fewer when a candidate was already measured by an earlier job)
    recs = [r for t in store.job_tasks(redis_conn, job.job_id) for r in store.records(redis_conn, t.wkey)
            if r.job_id == job.job_id]
    assert 0 < len(recs) <= st["trials"]


def test_results_show_the_models_tuning_curve(cli, tuned_tiny, redis_conn):
    from sharetune.experiments.report import job_data

    curve = job_data(redis_conn, tuned_tiny.job_id)["job_curve"]
    assert curve and all(b["est_us"] <= a["est_us"] for a, b in zip(curve, curve[1:]))  # a running best
    line = next(l for l in cli("results", tuned_tiny.job_id).stdout.splitlines() if l.startswith("model estimate"))
    assert line.count(" trials ") == min(5, len(curve)) and f"{curve[-1]['trial']} trials" in line


def test_prune_dry_run_says_what_it_would_free_and_deletes_nothing(cli, tuned_tiny, redis_conn):
    # the store's jobs and records that do not expire by themselves (the running stack's leases and guards do,
    # and its sets and lists vanish when their last member goes)
    kept = {k for k in redis_conn.scan_iter(match=f"{names.PREFIX}:*", count=1000)
            if redis_conn.ttl(k) == -1 and redis_conn.type(k) in (b"hash", b"string")}
    out = json.loads(cli("prune", "--older-than", "0", "--dry-run", "--json").stdout)
    assert tuned_tiny.job_id in out["jobs"] and out["dry_run"]
    assert 0 < out["frees_bytes"] < out["used_bytes_before"]
    assert redis_conn.exists(names.job_key(tuned_tiny.job_id))
    gone = [k for k in kept if not redis_conn.exists(k)]
    assert not gone, gone[:10]
    text = cli("prune", "--older-than", "0", "--dry-run").stdout
    assert text.startswith("would prune") and "MiB of the" in text and "nothing deleted" in text

"""What a user of the compose stack does from this host, one command per step of tests/compose/run.sh:
the HTTP API for jobs (submit, status, results, the exported database), and the Python client's Redis
(published on loopback) for what only the store can tell: which lane measured each trial, and the trial
accounting. Each command prints one JSON line and exits non-zero, saying why, when the step fails.

    python tests/compose/as_a_user.py lanes N            # until N lanes are live (GET /lanes)
    python tests/compose/as_a_user.py submit TRIALS      # POST /jobs: prints the job id
    python tests/compose/as_a_user.py wait JOB           # until a final state (GET /jobs/{id})
    python tests/compose/as_a_user.py measured JOB N     # until N trials are recorded (the kill's moment)
    python tests/compose/as_a_user.py fetch JOB DIR      # results (JSON) and the database (zip) into DIR
    python tests/compose/as_a_user.py account JOB        # trial accounting and records per lane

Environment: API (default http://127.0.0.1:8000), REDIS_URL (default redis://:$REDIS_PASSWORD@127.0.0.1:6379/0).
"""
from __future__ import annotations

import io
import json
import os
import sys
import time
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

API = os.environ.get("API", "http://127.0.0.1:8000")
REDIS_URL = os.environ.get("REDIS_URL") or f"redis://:{os.environ.get('REDIS_PASSWORD', '')}@127.0.0.1:6379/0"
FINAL = ("done", "failed", "cancelled")


def http(method: str, path: str, body: dict | None = None, timeout_s: float = 30) -> bytes:
    req = urllib.request.Request(API + path, method=method, data=json.dumps(body).encode() if body else None,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        return resp.read()


def get_json(path: str):
    return json.loads(http("GET", path))


def until(what: str, check, timeout_s: float, poll_s: float = 1.0):
    """check() until it returns something truthy; connection errors (a service still starting) retry."""
    deadline, last = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        try:
            got = check()
            if got:
                return got
        except (urllib.error.URLError, ConnectionError, OSError) as err:
            last = err
        time.sleep(poll_s)
    sys.exit(f"timed out after {timeout_s:.0f} s waiting for {what}" + (f" (last error: {last})" if last else ""))


def job_status_when(job: str, done) -> dict | None:
    st = get_json(f"/jobs/{job}")
    return st if done(st) else None


def cmd_lanes(n: str) -> dict:
    lanes = until(f"{n} live lanes", lambda: (lambda ls: ls if len(ls) >= int(n) else None)(get_json("/lanes")), 300)
    return {"lanes": sorted(l["queue"] for l in lanes), "workers": sorted(f"{l['host']}.{l['pid']}" for l in lanes)}


def cmd_submit(trials: str) -> dict:
    # the tiny zoo model: two tasks, a round of 8 each; seed fixed so a rerun asks the same candidates
    sub = json.loads(http("POST", "/jobs", {"model": "tiny", "target": "llvm", "trials": int(trials),
                                            "trials_per_iter": 8, "seed": 0}, timeout_s=120))
    return sub


def cmd_wait(job: str) -> dict:
    st = until(f"job {job} to finish", lambda: job_status_when(job, lambda s: s["state"] in FINAL), 900)
    if st["state"] != "done":
        sys.exit(f"job {job} ended {st['state']}: {st.get('error')}")
    return {"job_id": job, "state": st["state"], "trials": st["trials"], "budget": st["budget"]}


def cmd_measured(job: str, n: str) -> dict:
    st = until(f"{n} trials of job {job}", lambda: job_status_when(job, lambda s: s["trials"] >= int(n)), 600,
               poll_s=0.25)
    return {"job_id": job, "trials": st["trials"], "state": st["state"]}


def cmd_fetch(job: str, out: str) -> dict:
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    results = http("GET", f"/jobs/{job}/results")
    (out_dir / f"{job}-results.json").write_bytes(results)
    db = http("GET", f"/jobs/{job}/database", timeout_s=120)
    (out_dir / f"{job}-database.zip").write_bytes(db)
    names = zipfile.ZipFile(io.BytesIO(db)).namelist()
    if not any(n.endswith("database_tuning_record.json") for n in names):
        sys.exit(f"job {job}'s database has no tuning records: {names}")
    res = json.loads(results)
    return {"job_id": job, "tasks": len(res["tasks"]), "trials": res["trials"], "database_files": len(names),
            "database_bytes": len(db)}


def cmd_account(job: str) -> dict:
    """From the store: every claimed trial recorded (nothing lost or outstanding), and which lanes did them."""
    from shared import store

    r = store.connect(REDIS_URL)
    acc = store.trial_accounting(r, job)
    per_lane: dict[str, int] = {}
    for task in store.job_tasks(r, job):
        for rec in store.records(r, task.wkey):
            if rec.job_id == job:
                per_lane[rec.lane] = per_lane.get(rec.lane, 0) + 1
    if acc["lost"] or acc["outstanding"] or acc["recorded"] != acc["claimed"]:
        sys.exit(f"job {job}: trials not all recorded: {acc}")
    return {"job_id": job, **acc, "records_per_lane": per_lane}


COMMANDS = {"lanes": cmd_lanes, "submit": cmd_submit, "wait": cmd_wait, "measured": cmd_measured,
            "fetch": cmd_fetch, "account": cmd_account}

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
        sys.exit(__doc__)
    print(json.dumps(COMMANDS[sys.argv[1]](*sys.argv[2:])), flush=True)

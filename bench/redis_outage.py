"""A Redis outage of minutes in the middle of a job, with the services' default window
(SHARETUNE_REDIS_OUTAGE_S, 600 s): a local stack (one CPU lane, one tuner client, the planner, the updater,
its embedded Redis) tunes the tiny model; once a batch is in flight the embedded Redis is stopped for
--outage-s, then started again on the same port with the same AOF. While it is away the API's /health is
asked every few seconds (503 and the reason, each within a second). Writes `$OUT/redis_outage.json`
(default bench/results/redis_outage.json): the job's end state, claimed = recorded, the API's answers.

    python -m bench.redis_outage --outage-s 300     # ~7 min on a 2-core host
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from bench.harness.common import REPO, child_env, module_command, results_path, write_results
from bench.harness.jobs import local_stack
from shared import names, store
from sharetune.testing.faults import batch_in_flight


def ask_health(url: str, stop: threading.Event, answers: list) -> None:
    """/health while Redis is away: (status, seconds to answer, reason), every 5 s."""
    while not stop.wait(5):
        t0 = time.time()
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                answers.append((resp.status, round(time.time() - t0, 3), ""))
        except urllib.error.HTTPError as err:
            answers.append((err.code, round(time.time() - t0, 3), err.read().decode()[:200]))
        except Exception as err:  # noqa: BLE001
            answers.append((None, round(time.time() - t0, 3), f"{type(err).__name__}: {err}"))


def main(argv=None) -> int:
    import subprocess

    from sharetune.client import Client

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--outage-s", type=float, default=300)
    ap.add_argument("--trials", type=int, default=16)
    ap.add_argument("--api-port", type=int, default=18765)
    ap.add_argument("--out", default=None, help="default $OUT/redis_outage.json, else bench/results/redis_outage.json")
    args = ap.parse_args(argv)
    os.environ.pop("REDIS_URL", None)
    os.environ.pop("SHARETUNE_REDIS_OUTAGE_S", None)  # the default window, as deployed
    work = Path(tempfile.mkdtemp(prefix="redis_outage_"))
    os.environ["SHARETUNE_CORE_LOCK_DIR"] = str(work / "cores")
    out: dict = {"outage_s": args.outage_s, "trials": args.trials, "window_s": "default (SHARETUNE_REDIS_OUTAGE_S)"}
    with local_stack(work / "stack", ["measure.cpu.c0"], tuners=1) as st:
        api = subprocess.Popen(module_command("sharetune", "api", "--port", args.api_port, "--no-token"), cwd=REPO,
                               env=child_env(REDIS_URL=st.redis_url), stdout=open(work / "api.log", "wb"),
                               stderr=subprocess.STDOUT)
        try:
            r, client = store.connect(st.redis_url), Client(st.redis_url)
            before = set(r.scan_iter(match=f"{names.PREFIX}:batch:*"))
            t0 = time.time()
            job = client.submit("tiny", target="llvm", share=client.lanes()[0].share, trials=args.trials,
                                trials_per_iter=4, seed=21, untuned_baseline=False)
            batch_in_flight(r, before, job.job_id, 300)
            answers: list = []
            stop = threading.Event()
            asker = threading.Thread(target=ask_health, args=(f"http://127.0.0.1:{args.api_port}/health", stop,
                                                              answers), daemon=True)
            st.redis_server.stop()
            stopped_at = time.time()
            asker.start()
            time.sleep(args.outage_s)
            stop.set()
            asker.join()
            st.redis_server.start()
            back_at = time.time()
            final = job.wait(timeout_s=1800)
            accounting = store.trial_accounting(r, job.job_id)
            logs = "".join(f.read_text(errors="replace") for f in (work / "stack" / "logs").glob("*.log"))
            out.update(
                state=final.get("state"), error=final.get("error"), wall_s=round(time.time() - t0, 1),
                stopped_after_s=round(stopped_at - t0, 1), outage_measured_s=round(back_at - stopped_at, 1),
                done_after_redis_back_s=round(time.time() - back_at, 1),
                claimed=accounting["claimed"], recorded=accounting["recorded"], lost=accounting["lost"],
                steps_given_up=logs.count("Redis was away"),
                health=[{"status": s, "answer_s": a, "reason": why} for s, a, why in answers],
                health_max_answer_s=max((a for _, a, _ in answers), default=None),
                health_all_503=all(s == 503 for s, _, _ in answers))
        finally:
            api.terminate()
            api.wait(timeout=30)
    write_results(out, results_path("redis_outage.json", args.out), "bench.redis_outage", argv)
    print(json.dumps({k: v for k, v in out.items() if k != "health"}, indent=1))
    return 0 if out.get("state") == "done" and out.get("lost") == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

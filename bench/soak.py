"""A stack that lives through many jobs: N real tuning jobs in a row on one embedded stack (real Redis, real
Celery workers, real TVM), Redis's used memory, keys and AOF size after each; with `--prune` each ended job is
pruned as an operator's cron would (`sharetune prune --older-than 0s`). Prints a table and writes
bench/results/soak_cpu.json ($OUT/soak_cpu.json when $OUT is set).

    .venv/bin/python -m bench.soak --jobs 50 --prune      # ~15 min on a 2-core host
    .venv/bin/python -m bench.soak --jobs 50              # the same without pruning: what grows
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from bench.harness.common import results_path, write_results
from bench.harness.jobs import local_stack


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=50)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--trials", type=int, default=8)
    ap.add_argument("--prune", action="store_true", help="prune each job once it ended")
    ap.add_argument("--work-dir", default="/tmp/sharetune-soak")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    os.environ.setdefault("TVM_NUM_THREADS", "1")

    from shared import store
    from sharetune.client import Client
    from services.measurer.agent import default_cpu_lanes

    rows = []
    t0 = time.time()
    with local_stack(Path(args.work_dir), default_cpu_lanes()) as stack:
        client = Client(stack.redis_url)
        r = client.redis
        aof = lambda: sum(p.stat().st_size for p in (Path(args.work_dir) / "redis").rglob("*.aof*"))  # noqa: E731
        base = {**store.memory(r), "aof_bytes": aof()}
        print(f"{'job':>4} {'state':>8} {'used MiB':>9} {'keys':>6} {'AOF MiB':>8} {'pruned':>6}", flush=True)
        for i in range(args.jobs):
            job = client.submit(args.model, target="llvm", trials=args.trials, trials_per_iter=args.trials, seed=i)
            state = job.wait(timeout_s=900).get("state")
            pruned = len(store.prune_jobs(r, 0, now=time.time() + 1)) if args.prune else 0
            mem = store.memory(r)
            row = {"job": i + 1, "job_id": job.job_id, "state": state, "used_bytes": mem["used_bytes"],
                   "keys": mem["keys"], "aof_bytes": aof(), "pruned": pruned, "at_s": round(time.time() - t0, 1)}
            rows.append(row)
            print(f"{i + 1:>4} {state:>8} {mem['used_bytes'] / 2**20:>9.2f} {mem['keys']:>6} "
                  f"{row['aof_bytes'] / 2**20:>8.2f} {pruned:>6}", flush=True)
        used = [row["used_bytes"] for row in rows]
        summary = {"jobs": args.jobs, "prune": args.prune, "model": args.model, "trials": args.trials,
                   "base": base, "max_bytes": store.memory(r)["max_bytes"],
                   "used_bytes_first": used[0], "used_bytes_last": used[-1], "used_bytes_max": max(used),
                   "done": sum(row["state"] == "done" for row in rows), "wall_s": round(time.time() - t0, 1)}
    write_results({"summary": summary, "rows": rows}, results_path("soak_cpu.json", args.out), "bench.soak", argv)
    print(json.dumps(summary, indent=1))
    return 0 if summary["done"] == args.jobs else 1


if __name__ == "__main__":
    sys.exit(main())

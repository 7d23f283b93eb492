"""Sharding benchmark on the CPU: the CPU benchmark's model and budget (small_cnn, 32 trials) tuned by this
service with N = 1, 2, 4 tuner clients over the host's one-core lanes, one fresh stack per N.

    python bench/cpu_sharding.py [--clients 1,2,4] [--trials 32] [--per-iter 8]

Prints a table and writes bench/results/sharding_cpu.json (clients, lanes, wall_s, trials, trials_per_min,
tuned_latency_us on one core, speedup_vs_stock against stock tune_relax's wall time in
bench/results/cpu_tuning.json: same model, budget and kind of machine)."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("TVM_NUM_THREADS", "1")  # the tuned model is timed on one core, as its target says


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="small_cnn")
    ap.add_argument("--trials", type=int, default=32)
    ap.add_argument("--per-iter", type=int, default=8)
    ap.add_argument("--clients", default="1,2,4")
    ap.add_argument("--work-dir", default="/tmp/cpu_sharding")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "sharding_cpu.json"))
    args = ap.parse_args()

    from sharetune import evaluate
    from sharetune.client import Client
    from sharetune.stack import Stack, default_cpu_lanes
    from sharetune.zoo import get

    stock_path = REPO / "bench" / "results" / "cpu_tuning.json"
    stock = json.loads(stock_path.read_text()) if stock_path.exists() else None
    _, example = get(args.model).build()
    inputs = [t.detach().numpy() for t in example]
    lanes = default_cpu_lanes()
    rows = []
    for n in (int(x) for x in args.clients.split(",")):
        with Stack(Path(args.work_dir) / f"clients{n}", lanes=lanes, tuners=n) as stack:
            client = Client(stack.redis_url)
            t0 = time.time()
            job = client.submit(args.model, target="llvm", share=client.lanes()[0].share, trials=args.trials,
                                trials_per_iter=args.per_iter, seed=0, clients=n, untuned_baseline=False)
            final = job.wait(timeout_s=1800)
            wall = time.time() - t0
            if final["state"] != "done":
                rows.append({"clients": n, "state": final["state"], "error": final.get("error")})
                continue
            res = job.result()
            lat = evaluate.latency_us(res.tuned_module_path, inputs)
            rows.append({"clients": n, "lanes": len(lanes), "wall_s": round(wall, 2),
                         "tune_s": res.time_split_s.get("tune_total"), "trials": res.trials,
                         "trials_per_min": round(60 * res.trials / wall, 2), "tuned_latency_us": round(lat, 2),
                         "speedup_vs_stock": round(stock["stock_wall_s"] / wall, 3) if stock else None,
                         "split_s": res.time_split_s})
        print(json.dumps(rows[-1]), flush=True)
    out = {"machine": "cpu", "model": args.model, "trials": args.trials, "per_iter": args.per_iter,
           "host": {"cpus": os.cpu_count(), "loadavg": os.getloadavg()},
           "stock": stock and {"wall_s": stock["stock_wall_s"], "trials": stock["stock_trials"],
                               "tuned_latency_us": stock["stock_latency_us"], "per_iter": stock["per_iter"]},
           "rows": rows, "command": "python bench/cpu_sharding.py --clients " + args.clients}
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"\n{'clients':>8}{'lanes':>6}{'wall s':>8}{'tune s':>8}{'trials':>7}{'tr/min':>8}{'tuned us':>10}{'vs stock':>9}")
    if stock:
        print(f"{'stock':>8}{1:>6}{stock['stock_wall_s']:>8.1f}{'':>8}{stock['stock_trials']:>7}"
              f"{60 * stock['stock_trials'] / stock['stock_wall_s']:>8.1f}{stock['stock_latency_us']:>10.1f}{1.0:>9.2f}")
    for r in rows:
        if "wall_s" in r:
            print(f"{r['clients']:>8}{r['lanes']:>6}{r['wall_s']:>8.1f}{r['tune_s']:>8.1f}{r['trials']:>7}"
                  f"{r['trials_per_min']:>8.1f}{r['tuned_latency_us']:>10.1f}{r['speedup_vs_stock'] or 0:>9.2f}")


if __name__ == "__main__":
    main()

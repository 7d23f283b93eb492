"""Sharding benchmark on the CPU: the CPU benchmark's model and budget (small_cnn, 32 trials) tuned by this
service with N = 1, 2, 4 tuner clients over the host's one-core lanes, one fresh stack per N.

    python -m bench.cpu_sharding [--clients 1,2,4] [--trials 32] [--per-iter 8]

Prints a table and writes bench/results/sharding_cpu.json (clients, lanes, wall_s, trials, trials_per_min,
tuned_latency_us on one core, speedup_vs_stock against stock tune_relax's wall time in
bench/results/cpu_tuning.json: same model, budget and kind of machine).

The shared cost model against one model per client, at equal trials (several seeds, since one run decides little;
a budget past the first round of every task, or no model is trained in time and both runs only sample):

    SHARETUNE_SEARCH_POPULATION=128 python -m bench.cpu_sharding --clients 2 --trials 96 \
        --cost-models shared,per_client --seeds 0,1,2 \
        --out bench/results/cost_model_cpu.json"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from bench.harness.common import RESULTS, command_line
from bench.harness.jobs import run_job

os.environ.setdefault("TVM_NUM_THREADS", "1")  # the tuned model is timed on one core, as its target says


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="small_cnn")
    ap.add_argument("--trials", type=int, default=32)
    ap.add_argument("--per-iter", type=int, default=8)
    ap.add_argument("--clients", default="1,2,4")
    ap.add_argument("--cost-models", default="shared", help="shared, per_client or both, comma-separated")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--work-dir", default="/tmp/cpu_sharding")
    ap.add_argument("--out", default=str(RESULTS / "sharding_cpu.json"))
    args = ap.parse_args()

    from sharetune.experiments import model_timing as evaluate
    from sharetune.client import Client
    from services.measurer.agent import default_cpu_lanes
    from sharetune.stack.local import Stack
    from shared.settings import StackSettings
    from sharetune.zoo import get

    stock_path = RESULTS / "cpu_tuning.json"
    stock = json.loads(stock_path.read_text()) if stock_path.exists() else None
    _, example = get(args.model).build()
    inputs = [t.detach().numpy() for t in example]
    lanes = default_cpu_lanes()
    rows = []
    configs = [(int(n), cm, int(seed)) for seed in args.seeds.split(",") for n in args.clients.split(",")
               for cm in args.cost_models.split(",")]
    for n, cost_model, seed in configs:
        # a fresh stack per run: no records or cost model carried over from the run before
        with Stack(Path(args.work_dir) / f"clients{n}-{cost_model}-{seed}", lanes=lanes, tuners=n,
                   settings=StackSettings()) as stack:
            client = Client(stack.redis_url)
            job, final, wall = run_job(client, 1800, model=args.model, target="llvm", share=client.lanes()[0].share,
                                       trials=args.trials, trials_per_iter=args.per_iter, seed=seed, clients=n,
                                       untuned_baseline=False, cost_model=cost_model)
            if final["state"] != "done":
                rows.append({"clients": n, "cost_model": cost_model, "seed": seed, "state": final["state"],
                             "error": final.get("error")})
                continue
            res = job.result()
            lat = evaluate.latency_us(res.tuned_module_path, inputs)
            rows.append({"clients": n, "cost_model": cost_model, "seed": seed, "lanes": len(lanes),
                         "wall_s": round(wall, 2),
                         "tasks_best_us": round(sum(t.weight * t.best_us for t in res.tasks if t.best_us), 2),
                         "warm_switches": res.time_split_s.get("warm_switches"),
                         "tune_s": res.time_split_s.get("tune_total"), "trials": res.trials,
                         "trials_per_min": round(60 * res.trials / wall, 2), "tuned_latency_us": round(lat, 2),
                         "speedup_vs_stock": round(stock["stock_wall_s"] / wall, 3) if stock else None,
                         "split_s": res.time_split_s})
        print(json.dumps(rows[-1]), flush=True)
    out = {"machine": "cpu", "model": args.model, "trials": args.trials, "per_iter": args.per_iter,
           "host": {"cpus": os.cpu_count(), "loadavg": os.getloadavg()},
           "stock": stock and {"wall_s": stock["stock_wall_s"], "trials": stock["stock_trials"],
                               "tuned_latency_us": stock["stock_latency_us"], "per_iter": stock["per_iter"]},
           # 0: the setting's default, twice the trials a round, 64 to 512
           "search_population": int(os.environ.get("SHARETUNE_SEARCH_POPULATION", 0)),
           "rows": rows, "command": command_line("bench.cpu_sharding")}
    models = sorted({r["cost_model"] for r in rows if "wall_s" in r})
    if len(models) > 1:  # which cost model tunes better at equal trials: median over seeds
        import statistics
        out["cost_model_summary"] = {m: {k: statistics.median(r[k] for r in rows if r.get("cost_model") == m and k in r)
                                         for k in ("tuned_latency_us", "tasks_best_us", "wall_s")} for m in models}
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"\n{'clients':>8}{'model':>11}{'seed':>5}{'lanes':>6}{'wall s':>8}{'tune s':>8}{'trials':>7}{'tr/min':>8}{'tuned us':>10}{'vs stock':>9}")
    if stock:
        print(f"{'stock':>8}{'':>11}{'':>5}{1:>6}{stock['stock_wall_s']:>8.1f}{'':>8}{stock['stock_trials']:>7}"
              f"{60 * stock['stock_trials'] / stock['stock_wall_s']:>8.1f}{stock['stock_latency_us']:>10.1f}{1.0:>9.2f}")
    for r in rows:
        if "wall_s" in r:
            print(f"{r['clients']:>8}{r['cost_model']:>11}{r['seed']:>5}{r['lanes']:>6}{r['wall_s']:>8.1f}{r['tune_s']:>8.1f}{r['trials']:>7}"
                  f"{r['trials_per_min']:>8.1f}{r['tuned_latency_us']:>10.1f}{r['speedup_vs_stock'] or 0:>9.2f}")
    for m, v in out.get("cost_model_summary", {}).items():
        print(f"median over seeds, {m}: tuned {v['tuned_latency_us']:.1f} us, tasks' best {v['tasks_best_us']:.1f} us, "
              f"wall {v['wall_s']:.1f} s")


if __name__ == "__main__":
    main()

"""Sharding and multi-GPU benchmark (run on an H200 machine, one or more GPUs): the GPU benchmark's
workload (the k heaviest ResNet-18-like tasks, same trials as bench.gpu_tuning) tuned by this service
with N tuner clients over lanes on one GPU or spread over several.

    python -m bench.gpu_sharding --configs 1:4x25:1,1:4x25:2,1:4x25:4,2:4x25:4
        config = GPUS:LANES_PER_GPU:CLIENTS[:COST_MODEL]  (COST_MODEL shared | per_client)
    python -m bench.gpu_sharding --report OUT.json   # print the tables of a finished run

Writes, under $OUT: gpu_sharding_rows.json (every row as it finishes), sharding_h200.json (rows on one GPU:
clients, lanes, wall_s, trials, tuned_latency_us, speedup_vs_stock) and gpu_scaling.json (one GPU against
two at the same clients: scaling_efficiency = trials/min with 2 GPUs / (2 x trials/min with 1)). Stock's
figures come from bench/results/gpu_tuning_h200.json (same workload, trials and machine kind)."""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from bench.harness.common import RESULTS
from bench.harness.jobs import gpus as find_gpus, run_job
from bench.harness.samplers import BusySampler
from bench.harness.serving import e2e_latency_us, model_inputs
from bench.harness.stock import heaviest, make_target

def stock_row() -> dict | None:
    path = RESULTS / "gpu_tuning_h200.json"
    if not path.exists():
        return None
    return next((r for r in json.loads(path.read_text())["rows"] if r["config"] == "stock"), None)


def run_config(cfg: str, args, names, inputs, gpus) -> dict:
    from sharetune.client import Client
    from services.measurer.agent import gpu_lanes
    from sharetune.stack.local import Stack
    from shared.settings import StackSettings

    n_gpus, spec, clients, *rest = cfg.split(":")
    n_gpus, clients = int(n_gpus), int(clients)
    cost_model = rest[0] if rest else args.cost_model
    if n_gpus > len(gpus):
        return {"config": cfg, "error": f"needs {n_gpus} GPUs, this host has {len(gpus)}"}
    plan = {g.index: spec for g in gpus[:n_gpus]}
    lanes = gpu_lanes(plan)
    share = int(spec.split("x")[1])
    t_up = time.time()
    with Stack(Path(args.work_dir) / cfg.replace(":", "_"), lanes=lanes, tuners=clients, log_level="INFO",
               settings=StackSettings()) as stack:
        startup = time.time() - t_up
        client = Client(stack.redis_url)
        busy = BusySampler(gpus[0].uuid, interval_ms=None)
        job, final, wall = run_job(client, args.timeout, model=args.model, target="cuda", share=share,
                                   trials=args.trials, trials_per_iter=args.per_iter, seed=0, only_tasks=names,
                                   clients=clients, cost_model=cost_model,
                                   untuned_baseline=False)  # stock's figure has no compile either
        busy_frac = busy.stop()
        if final["state"] != "done":
            return {"config": cfg, "state": final["state"], "error": final.get("error"), "wall_s_partial": round(wall, 1),
                    "status": job.status()}
        res = job.result()
        lat = e2e_latency_us(res.tuned_module_path, inputs)
        tune_s = res.time_split_s.get("tune_total") or wall
        return {"config": cfg, "gpus": n_gpus, "lanes": len(lanes), "lane_spec": spec, "clients": clients,
                "share": share, "cost_model": cost_model, "wall_s": round(wall, 2), "tune_s": round(tune_s, 2),
                "trials": res.trials, "trials_per_min": round(60 * res.trials / wall, 2),
                "tune_trials_per_min": round(60 * res.trials / tune_s, 2),
                "gpu0_busy_frac": busy_frac, "tuned_latency_us": round(lat, 2),
                "split_s": res.time_split_s, "stack_startup_s": round(startup, 2)}


def tables(rows: list[dict], stock: dict | None) -> tuple[dict, dict]:
    ok = [r for r in rows if "wall_s" in r]
    for r in ok:
        if stock:
            r["speedup_vs_stock"] = round(stock["wall_s"] / r["wall_s"], 3)
            r["throughput_vs_stock"] = round(r["trials_per_min"] / stock["trials_per_min"], 3)
    sharding = {"machine": "h200", "stock": stock and {k: stock[k] for k in ("wall_s", "trials", "trials_per_min",
                                                                             "tuned_latency_us")},
                "rows": [r for r in ok if r["gpus"] == 1]}
    scaling_rows = []
    for r2 in (r for r in ok if r["gpus"] == 2):
        r1 = next((r for r in ok if r["gpus"] == 1 and r["clients"] == r2["clients"]
                   and r["lane_spec"] == r2["lane_spec"] and r["cost_model"] == r2["cost_model"]), None)
        if r1:
            scaling_rows.append({
                "clients": r2["clients"], "lanes_1gpu": r1["lanes"], "lanes_2gpu": r2["lanes"],
                "wall_s": {"1": r1["wall_s"], "2": r2["wall_s"]},
                "trials_per_min": {"1": r1["trials_per_min"], "2": r2["trials_per_min"]},
                "tune_trials_per_min": {"1": r1["tune_trials_per_min"], "2": r2["tune_trials_per_min"]},
                "tuned_latency_us": {"1": r1["tuned_latency_us"], "2": r2["tuned_latency_us"]},
                "scaling_efficiency": round(r2["trials_per_min"] / (2 * r1["trials_per_min"]), 3),
                "scaling_efficiency_tuning_phase": round(r2["tune_trials_per_min"] / (2 * r1["tune_trials_per_min"]), 3),
            })
    scaling = {"machine": "h200-x2", "rows": [r for r in ok if r["gpus"] == 2], "pairs": scaling_rows}
    return sharding, scaling


def print_tables(rows, stock):
    print(f"{'config':<12}{'gpus':>5}{'lanes':>6}{'clients':>8}{'wall s':>8}{'tune s':>8}{'trials':>7}"
          f"{'tr/min':>8}{'tuned us':>10}{'vs stock':>9}")
    if stock:
        print(f"{'stock':<12}{1:>5}{0:>6}{1:>8}{stock['wall_s']:>8.1f}{'':>8}{stock['trials']:>7}"
              f"{stock['trials_per_min']:>8.1f}{stock['tuned_latency_us']:>10.1f}{1.0:>9.2f}")
    for r in rows:
        if "wall_s" not in r:
            print(f"{r['config']:<12} failed: {r.get('state')} {r.get('error')}")
            continue
        print(f"{r['config']:<12}{r['gpus']:>5}{r['lanes']:>6}{r['clients']:>8}{r['wall_s']:>8.1f}{r['tune_s']:>8.1f}"
              f"{r['trials']:>7}{r['trials_per_min']:>8.1f}{r['tuned_latency_us']:>10.1f}"
              f"{r.get('speedup_vs_stock', 0):>9.2f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="resnet18")
    ap.add_argument("--tasks", type=int, default=6)
    ap.add_argument("--trials", type=int, default=48)
    ap.add_argument("--per-iter", type=int, default=8)
    ap.add_argument("--configs", default="1:4x25:1,1:4x25:2,1:4x25:4,2:4x25:4")
    ap.add_argument("--cost-model", default="shared", choices=["shared", "per_client"])
    ap.add_argument("--timeout", type=float, default=240)
    ap.add_argument("--work-dir", default="/tmp/gpu_sharding")
    ap.add_argument("--report", default=None, help="print the tables of a rows file and write the results")
    args = ap.parse_args()
    out = Path(os.environ.get("OUT", "."))
    stock = stock_row()
    if args.report:
        rows = json.loads(Path(args.report).read_text())["rows"]
    else:
        gpus = find_gpus()
        _, names, _ = heaviest(args.model, args.tasks, make_target(False))
        inputs = model_inputs(args.model)
        rows = []
        for cfg in args.configs.split(","):
            rows.append(run_config(cfg, args, names, inputs, gpus))
            print(json.dumps(rows[-1]), flush=True)
            (out / "gpu_sharding_rows.json").write_text(json.dumps({"rows": rows, "tasks": names,
                                                                     "per_iter": args.per_iter}, indent=1))
    sharding, scaling = tables(rows, stock)
    (out / "sharding_h200.json").write_text(json.dumps(sharding, indent=1))
    (out / "gpu_scaling.json").write_text(json.dumps(scaling, indent=1))
    print_tables(rows, stock)
    for p in scaling["pairs"]:
        print(f"clients {p['clients']}: scaling efficiency {p['scaling_efficiency']} "
              f"(tuning phase {p['scaling_efficiency_tuning_phase']})")


if __name__ == "__main__":
    main()

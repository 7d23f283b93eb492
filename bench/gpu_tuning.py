"""GPU tuning benchmark (run on the H200 machine): stock MetaSchedule against this service with
1 x 100 %, 2 x 50 % and 4 x 25 % MPS lanes, same model tasks, same trial budget.

    python -m bench.gpu_tuning --part stock   # stock tune_tasks: LocalBuilder on all cores + LocalRunner
    python -m bench.gpu_tuning --part ours    # this service, one configuration after another
    python -m bench.gpu_tuning --merge A.json B.json --out bench/results/gpu_tuning_h200.json

The workload is the k heaviest tasks (by FLOPs x weight) of the ResNet-18-like zoo model. Both sides
compile the whole model with their records (stock compile_relax; untuned operators get DLight's
default GPU schedules) and time it end to end on the GPU at 100 %, next to PyTorch eager."""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from bench.harness.jobs import gpu_lane, gpus as find_gpus, run_job
from bench.harness.samplers import BusySampler
from bench.harness.serving import e2e_latency_us, model_inputs, torch_eager_us
from bench.harness.stock import heaviest, make_target, tune_tasks


def run_stock(args) -> dict:
    from tvm.s_tir import meta_schedule as ms

    target = make_target(False)
    mod, names, extracted = heaviest(args.model, args.tasks, target)
    work = Path(args.work_dir) / "stock"
    work.mkdir(parents=True, exist_ok=True)
    found = find_gpus()
    busy = BusySampler(found[0].uuid if found else None, interval_ms=None)
    t0 = time.time()
    with ms.Profiler() as prof:
        contexts, weights = ms.relax_integration.extracted_tasks_to_tune_contexts(extracted, str(work), seed=0)
        db = tune_tasks(contexts, weights, str(work), args.trials, args.per_iter, os.cpu_count() or 1)
    wall = time.time() - t0
    profile = {k: round(float(v), 2) for k, v in prof.get().items()}
    trials = sum(1 for _ in open(work / "database_tuning_record.json"))
    ex = ms.relax_integration.compile_relax(db, mod, target, params=None)
    lat = e2e_latency_us(ex, model_inputs(args.model))
    return {"config": "stock", "lanes": 0, "wall_s": round(wall, 2), "trials": trials,
            "trials_per_min": round(60 * trials / wall, 2),
            "gpu_busy_frac": busy.stop(), "tuned_latency_us": round(lat, 2), "tasks": names, "profile_s": profile,
            "split_s": _stock_split(profile)}


def _stock_split(profile: dict) -> dict:
    def total(*keys):
        return round(sum(v for k, v in profile.items() if any(key in k for key in keys)), 2)

    return {"build": total("LocalBuilder", "Builder"), "run": total("LocalRunner", "Runner"),
            "search": total("EvoSearch/SampleInitPopulation", "EvoSearch/Evolve/Mutation", "EvoSearch/Evolve/Misc",
                            "EvoSearch/PickWithEpsGreedy", "EvoSearch/PickBestFromDatabase"),
            "cost_model": total("XGBModel", "CostModel")}


def run_ours(args) -> list[dict]:
    from sharetune.client import Client
    from sharetune.stack.local import Stack
    from shared.settings import StackSettings

    uuid = find_gpus()[0].uuid
    _, names, _ = heaviest(args.model, args.tasks, make_target(False))
    inputs = model_inputs(args.model)
    configs = [c for c in args.configs.split(",") if c != "stock"]
    out = []
    partial = Path(os.environ.get("OUT", ".")) / "gpu_tuning_ours_partial.json"
    for c in configs:
        # one fresh stack per configuration: each lane gets an equal part of the host's cores for its
        # warm build pool, as a deployment of that configuration would
        n, pct = (int(x) for x in c.split("x"))
        lanes = [gpu_lane(uuid, pct)] * n
        t_up = time.time()
        with Stack(Path(args.work_dir) / f"ours-{c}", lanes=lanes, tuners=1, log_level="INFO",
                   settings=StackSettings()) as stack:
            startup = time.time() - t_up
            client = Client(stack.redis_url)
            busy = BusySampler(uuid, interval_ms=None)
            job, final, wall = run_job(client, args.timeout, model=args.model, target="cuda", share=pct,
                                       trials=args.trials, trials_per_iter=args.per_iter, seed=0, only_tasks=names,
                                       retime_top_k=args.retime)
            busy_frac = busy.stop()
            if final["state"] != "done":
                out.append({"config": c, "error": final.get("error"), "state": final["state"],
                            "wall_s_partial": round(wall, 1), "status": job.status()})
            else:
                res = job.result()
                lat = e2e_latency_us(res.tuned_module_path, inputs)
                out.append({"config": c, "lanes": n, "share": pct, "wall_s": round(wall, 2),
                            "tune_s": res.time_split_s.get("tune_total"), "trials": res.trials,
                            "trials_per_min": round(60 * res.trials / wall, 2),
                            "gpu_busy_frac": busy_frac, "tuned_latency_us": round(lat, 2),
                            "split_s": res.time_split_s, "stack_startup_s": round(startup, 2),
                            "build_workers_per_lane": max(1, (os.cpu_count() or 1) // n),
                            "retime": res.retime})
            print(json.dumps(out[-1]), flush=True)
            partial.write_text(json.dumps({"rows": out}, indent=1))
    return out


def merge(paths: list[str], out_path: str, model: str) -> dict:
    rows = []
    extra = {}
    for p in paths:
        data = json.loads(Path(p).read_text())
        rows += data["rows"]
        extra.update({k: v for k, v in data.items() if k != "rows"})
    for r in rows:
        if "profile_s" in r:
            r["split_s"] = _stock_split({k: v for k, v in r["profile_s"].items() if k != "EvoSearch/Evolve/Misc/CopyMeasuredWorkloads"})
    stock = next((r for r in rows if r["config"] == "stock"), None)
    for r in rows:
        if stock and "wall_s" in r:
            r["speedup_vs_stock"] = round(stock["wall_s"] / r["wall_s"], 3)
    result = {**extra, "rows": rows, "model": model}
    Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    Path(out_path).write_text(json.dumps(result, indent=1))
    print_table(result)
    return result


def print_table(result: dict) -> None:
    print(f"\nmodel {result.get('model')}, tasks {result.get('tasks')}, PyTorch eager {result.get('torch_eager_us')} us")
    print(f"{'config':<8}{'lanes':>6}{'wall s':>9}{'trials':>8}{'tr/min':>9}{'gpu busy':>10}{'tuned us':>10}{'speedup':>9}")
    for r in result["rows"]:
        if "wall_s" not in r:
            print(f"{r['config']:<8} failed: {r.get('error')}")
            continue
        print(f"{r['config']:<8}{r['lanes']:>6}{r['wall_s']:>9.1f}{r['trials']:>8}{r['trials_per_min']:>9.1f}"
              f"{(r['gpu_busy_frac'] or 0):>10.3f}{r['tuned_latency_us']:>10.1f}{r.get('speedup_vs_stock', 1.0):>9.2f}")
    for r in result["rows"]:
        if "split_s" in r:
            print(f"  {r['config']} time split (s): {r['split_s']}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--part", choices=["stock", "ours", "all"], default="all")
    ap.add_argument("--model", default="resnet18")
    ap.add_argument("--tasks", type=int, default=6)
    ap.add_argument("--trials", type=int, default=48)
    ap.add_argument("--per-iter", type=int, default=16)
    ap.add_argument("--configs", default="1x100,2x50,4x25")
    ap.add_argument("--timeout", type=float, default=540)
    ap.add_argument("--retime", type=int, default=0, help="re-time each task's top k with neighbours idle")
    ap.add_argument("--work-dir", default="/tmp/gpu_bench")
    ap.add_argument("--out", default=None)
    ap.add_argument("--merge", nargs="*")
    args = ap.parse_args()
    if args.merge:
        merge(args.merge, args.out or "bench/results/gpu_tuning_h200.json", args.model)
        return
    rows = []
    extra = {"trials_budget": args.trials, "per_iter": args.per_iter, "model": args.model}
    if args.part in ("stock", "all"):
        rows.append(run_stock(args))
        print(json.dumps(rows[-1]), flush=True)
    if args.part in ("ours", "all"):
        rows += run_ours(args)
        extra["torch_eager_us"] = round(torch_eager_us(args.model), 2)
    extra["tasks"] = heaviest(args.model, args.tasks, make_target(False))[1]
    out = args.out or os.path.join(os.environ.get("OUT", "."), f"gpu_tuning_{args.part}.json")
    Path(out).write_text(json.dumps({**extra, "rows": rows}, indent=1))
    print_table({**extra, "rows": rows})


if __name__ == "__main__":
    main()

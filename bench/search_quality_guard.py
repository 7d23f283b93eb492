"""The default-schedule guard (services/tuner/metaschedule/defaults.py) applied to the records of a finished
bench/search_quality_gpu.py run: each task's default schedule timed the way a lane times a candidate, each
database cut to the tasks whose best record beats their default, compiled, and timed beside the untuned
model and stock's unguarded model in one fresh process (GPU 0 at 100 %).

    python -m bench.search_quality_guard --work-dir /tmp/sqg --first-run bench/results/search_quality_h200_unguarded.json
    python -m bench.search_quality_guard --rehearse --work-dir /tmp/sqg_r --first-run /tmp/sqg_r/out.json

The work dir is the first run's: {model}/stock/db_{B} and {model}/ours_{B}/ours/db_{B} (JSON databases of
the first B trials of each side). The guard uses the records' own figures (lane timings for ours, stock's
LocalRunner for stock) against a default timed here with the lanes' GPU timing (3 repeats of 3 runs, 50 ms
floor, median), as the service compares a lane-timed default with lane-timed records."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from bench import search_quality_gpu as sqg
from bench.harness.common import git_state, rounded
from bench.harness.jobs import gpus as find_gpus
from bench.harness.stock import make_target


def _default_build(args_tuple):
    """In a pool process: the default schedule of one task, built and exported."""
    packed, target_json, out_dir = args_tuple
    from services.measurer.metaschedule.build import build_to_file

    return build_to_file(packed, target_json, out_dir)


def default_timings(model: str, target, rehearse: bool, work: Path) -> dict[str, dict]:
    """Per task of the model (by its workload's structural hash): its default schedule's median seconds."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    import tvm
    from tvm.s_tir import meta_schedule as ms

    from services.measurer.metaschedule.timing import time_module
    from services.tuner.metaschedule.defaults import default_module
    from services.tuner.metaschedule.extract import fuse
    from services.tuner.metaschedule.lane_runner import module_candidate
    from services.tuner.search import timing_for
    from shared.ranking import rank_secs
    from sharetune.intake import to_relax

    tasks = ms.relax_integration.extract_tasks(fuse(to_relax(model).mod), target)
    cands, jobs = {}, []
    out_dir = work / model / "defaults"
    out_dir.mkdir(parents=True, exist_ok=True)
    for t in tasks:
        mod = default_module(t.dispatched[0], target)
        cands[t.task_name] = module_candidate(t.task_name, mod)
        jobs.append((cands[t.task_name].mod, str(target), str(out_dir)))
    workers = 2 if rehearse else min(32, os.cpu_count() or 1)
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        built = list(pool.map(_default_build, jobs))
    timing = timing_for(target.kind.name)
    out = {}
    for t, (path, err, build_s) in zip(tasks, built):
        entry = {"workload": t.dispatched[0], "weight": int(t.weight), "build_s": rounded(build_s)}
        if path is None:
            entry.update(default_s=None, error=err)
        else:
            res = time_module(tvm.runtime.load_module(path), cands[t.task_name], target, timing)
            entry.update(default_s=rank_secs(res.run_secs) if res.run_secs else None, error=res.error)
        out[t.task_name] = entry
    return out


def guarded_database(src: Path, dst: Path, defaults: dict[str, dict]) -> dict:
    """Copy a JSON database keeping each task's records only when its best (TVM's ranking: the mean of a
    record's figures) beats the task's default; returns which tasks kept their records."""
    from tvm.s_tir import meta_schedule as ms

    from services.tuner.metaschedule.defaults import keeps_records

    db = ms.database.JSONDatabase(path_workload=str(src / "database_workload.json"),
                                  path_tuning_record=str(src / "database_tuning_record.json"),
                                  module_equality="structural")
    dst.mkdir(parents=True, exist_ok=True)
    for name in ("database_workload.json", "database_tuning_record.json"):
        (dst / name).unlink(missing_ok=True)
    out = ms.database.JSONDatabase(work_dir=str(dst), module_equality="structural")
    kept, dropped = [], []
    for name, d in defaults.items():
        if not db.has_workload(d["workload"]):
            continue
        wl = db.commit_workload(d["workload"])
        recs = [r for r in db.get_top_k(wl, 10**6) if r.run_secs]
        best = min((statistics.mean(float(getattr(s, "value", s)) for s in r.run_secs) for r in recs), default=None)
        if best is not None and best >= 1e9:
            best = None
        if keeps_records(best, d["default_s"]):
            owl = out.commit_workload(d["workload"])
            for r in recs:
                out.commit_tuning_record(ms.database.TuningRecord(r.trace, owl, r.run_secs, r.target, r.args_info))
            kept.append(name)
        elif best is not None:
            dropped.append({"task": name, "best_us": rounded(1e6 * best, 3), "default_us": rounded(1e6 * d["default_s"], 3)})
    return {"kept": sorted(kept), "dropped": dropped}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work-dir", default="/tmp/sqg")
    ap.add_argument("--first-run", required=True, help="the JSON bench/search_quality_gpu.py wrote")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--compile-timeout", type=float, default=400.0)
    ap.add_argument("--serve-timeout", type=float, default=300.0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--rehearse", action="store_true")
    args = ap.parse_args(argv)
    work = Path(args.work_dir).resolve()
    first = json.loads(Path(args.first_run).read_text())
    out = Path(args.out or Path(os.environ.get("OUT") or work) / ("search_quality_guard_rehearsal.json" if args.rehearse
                                                                     else "search_quality_h200_guarded.json"))
    gpus = [] if args.rehearse else find_gpus()
    if gpus:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpus[0].uuid  # this process times the defaults on GPU 0
    uuid = gpus[0].uuid if gpus else None
    target = make_target(args.rehearse)
    t0 = time.time()
    rep = {"first_run": first.get("code"), "code": git_state(), "target": json.loads(str(target)), "models": {}}
    compiles = {}
    for run in first["runs"]:
        model = run["model"]
        budgets = sorted(int(b) for b in run["budgets"])
        defaults = default_timings(model, target, args.rehearse, work)
        m = rep["models"][model] = {"defaults_us": {k: rounded(1e6 * v["default_s"], 3) if v["default_s"] else None
                                                    for k, v in defaults.items()},
                                    "default_errors": {k: v["error"][:300] for k, v in defaults.items() if v.get("error")},
                                    "guard": {}}
        w = work / model
        for b in budgets:
            for side, src in (("ours", w / f"ours_{b}" / "ours" / f"db_{b}"), ("stock", w / "stock" / f"db_{b}")):
                dst = w / f"guarded_{side}_{b}"
                m["guard"][f"{side}_{b}"] = guarded_database(src, dst, defaults)
                compiles[(model, f"{side}_guarded_{b}")] = (dst, w / f"{side}_guarded_{b}.so")
            compiles[(model, f"stock_{b}")] = (w / "stock" / f"db_{b}", w / f"stock_{b}.so")
        compiles[(model, "untuned")] = (w / "untuned_db", w / "untuned.so")
        out.write_text(json.dumps(rep, indent=1, default=str) + "\n")
    rep["defaults_s"] = rounded(time.time() - t0)
    libs, errors = sqg.compile_parallel(args, compiles, uuid)
    rep["compile_errors"] = {f"{m}/{label}": err for (m, label), err in errors.items()}
    rep["compile_s"] = rounded(time.time() - t0 - rep["defaults_s"])
    for run in first["runs"]:
        model = run["model"]
        m = rep["models"][model]
        served = sqg.serve_model(args, model, libs.get(model, {}), uuid, work)
        lat = served.get("latency_us", {})
        m["latency_us"] = {k: rounded(v, 2) for k, v in lat.items()}
        m["max_abs_err"] = served.get("max_abs_err")
        m["serve_errors"] = served.get("errors")
        m["by_budget"] = {}
        for b in sorted(int(x) for x in run["budgets"]):
            s, og, sg = lat.get(f"stock_{b}"), lat.get(f"ours_guarded_{b}"), lat.get(f"stock_guarded_{b}")
            m["by_budget"][str(b)] = {
                "stock_us": rounded(s, 2), "ours_guarded_us": rounded(og, 2), "stock_guarded_us": rounded(sg, 2),
                "ours_unguarded_us_first_run": run["budgets"][str(b)]["ours"].get("latency_us"),
                "stock_us_first_run": run["budgets"][str(b)]["stock"].get("latency_us"),
                "latency_ratio": rounded(og / s, 4) if og and s else None,
                "tasks_applied": {"ours": len(m["guard"][f"ours_{b}"]["kept"]),
                                  "stock": len(m["guard"][f"stock_{b}"]["kept"])},
                "tasks_left_on_default": {"ours": len(m["guard"][f"ours_{b}"]["dropped"]),
                                          "stock": len(m["guard"][f"stock_{b}"]["dropped"])}}
        out.write_text(json.dumps(rep, indent=1, default=str) + "\n")
    ratios = [e["latency_ratio"] for m in rep["models"].values() for e in m.get("by_budget", {}).values()
              if e["latency_ratio"] is not None]
    rep["summary"] = {"latency_vs_stock_max": max(ratios) if ratios else None, "total_s": rounded(time.time() - t0)}
    out.write_text(json.dumps(rep, indent=1, default=str) + "\n")
    for model, m in rep["models"].items():
        print(f"{model}: untuned {m['latency_us'].get('untuned')} us")
        for b, e in m["by_budget"].items():
            print(f"  {b:>4s} stock {e['stock_us']} us, ours+guard {e['ours_guarded_us']} us, stock+guard "
                  f"{e['stock_guarded_us']} us, ratio {e['latency_ratio']}, tasks applied {e['tasks_applied']}, "
                  f"left on default {e['tasks_left_on_default']}")
    print(f"latency_vs_stock_max {rep['summary']['latency_vs_stock_max']}; wrote {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

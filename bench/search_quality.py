"""Search quality per trial: stock MetaSchedule `tune_relax` (gradient task scheduler) against this service
on CPU lanes, same model, same budgets, same seed; tuned end-to-end latency and where the trials went.

    python -m bench.search_quality [--models resnet18,mobilenetv2] [--budgets 64,128,256,512] [--per-iter 64]
                                   [--seeds 0] [--out bench/results/search_quality.json]
    python -m bench.search_quality --rehearse      # tiny model, 32 trials: checks the script in minutes

Per model and seed, stock tunes ONCE for the largest budget and its smaller budgets are read off that run's
tuning curve: its choices do not depend on the total budget (`tune_relax` with max_trials_per_task =
max_trials_global; the gradient scheduler picks by history only, and with budgets that are multiples of
the round size no round is cut short at a smaller budget). Ours tunes once PER BUDGET, each in a fresh
store: when the budget cannot give every task a full round, the first rounds share it evenly
(services/tuner/allocation.first_round_size), so its choices depend on the budget.

- stock: bench.harness.stock's fresh subprocess (`tune_relax`, LocalBuilder(max_workers=2,
  timeout_sec=120), LocalRunner(), seed S). Its order of measurement: the task scheduler's log ("TaskScheduler
  picks Task #i", "Sending N sample(s) to builder", with their times); its JSON database appends a task's
  records in that task's batch order (records are committed when the task is revisited, so the file is not
  in global order), so the j-th batch of task i is the next N records of task i in the file. A batch's time
  is the time its "Sending M valid sample(s) to runner" line was logged (its build done; 1 s resolution).
- ours: a fresh local Stack (embedded Redis, one single-core lane per core) per budget,
  `Client.submit(..., trials=B, seed=S)`; order and times: each record's `measured_at` (as `sharetune results` draws the curve).
- at each budget B, per side: the first B trials; per task its trials and best; the estimate
  sum(weight x best task latency); a JSON database of those records only, compiled with `compile_relax`
  (both sides the same way, lane target), and all libraries timed at the end in this process, pinned to one
  core, interleaved round by round (`bench.harness.serving.pinned_latency`).
- summary: latency_vs_stock_max = the worst over budgets of ours/stock latency (median over seeds);
  starved_tasks = tasks with >= 1 % of the FLOPs (x weight) that got fewer trials than some task under
  0.1 %, at any budget of any run (ours; stock's are given beside).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from bench.harness.common import RESULTS, command_line, git_state, rounded
from bench.harness.jobs import job_records
from bench.harness.samplers import ForeignLoad
from bench.harness.serving import compile_at, pinned_latency
from bench.harness.stock import lane_target, stock_batches, target_dict, tune_relax

HEAVY, LIGHT = 0.01, 0.001  # shares of the FLOPs (x weight), as the issue states them


# ---- curves -------------------------------------------------------------------------------------------


def task_baselines(fused, target) -> dict[str, float]:
    """Each task's latency (us) untuned (tvm.compile of its workload, no schedule): what a task the search has
    not reached yet costs in the estimate."""
    import numpy as np
    import tvm
    from tvm.s_tir import meta_schedule as ms

    dev = tvm.cpu(0)
    rng = np.random.default_rng(0)
    out = {}
    for t in ms.relax_integration.extract_tasks(fused, target):
        mod = t.dispatched[0]
        ex = tvm.compile(mod, target=target)
        args = [tvm.runtime.tensor(rng.uniform(size=[int(x) for x in a.shape]).astype(a.dtype), dev)
                for a in ms.arg_info.ArgInfo.from_prim_func(mod["main"])]
        res = ex.mod.time_evaluator("main", dev, number=3, repeat=5)(*args).results
        out[t.task_name] = 1e6 * statistics.median(res)
    return out


def _estimate(best: dict[str, float], tasks: dict[str, dict], base: dict[str, float]) -> float | None:
    """sum(weight x best task latency); a task not tuned yet counts at its untuned latency."""
    try:
        return sum(tasks[k]["weight"] * (best[k] if k in best else base[k]) for k in tasks)
    except KeyError:  # a task with neither (no baseline by that name)
        return None


def curve_points(trials: list[dict], tasks: dict[str, dict], base: dict[str, float]) -> list[dict]:
    """trials: [{task, t, us (None: failed)}] in measurement order -> the estimate after each trial."""
    best: dict[str, float] = {}
    out = []
    for n, tr in enumerate(trials, 1):
        if tr["us"] is not None:
            best[tr["task"]] = min(best.get(tr["task"], float("inf")), tr["us"])
        out.append({"trial": n, "t": rounded(tr["t"], 2), "est_us": rounded(_estimate(best, tasks, base), 2),
                    "tasks_tuned": len(best)})
    return out


def at_budget(trials: list[dict], tasks: dict[str, dict], budget: int, base: dict[str, float]) -> dict:
    """Per task: trials and best within the first `budget` trials; the estimate."""
    per = {k: {"trials": 0, "best_us": None} for k in tasks}
    for tr in trials[:budget]:
        p = per[tr["task"]]
        p["trials"] += 1
        if tr["us"] is not None and (p["best_us"] is None or tr["us"] < p["best_us"]):
            p["best_us"] = rounded(tr["us"], 3)
    est = _estimate({k: p["best_us"] for k, p in per.items() if p["best_us"] is not None}, tasks, base)
    return {"trials": min(budget, len(trials)), "est_us": rounded(est, 2),
            "tasks_tuned": sum(1 for p in per.values() if p["best_us"] is not None),
            "t_s": rounded(trials[min(budget, len(trials)) - 1]["t"], 1) if trials else None, "tasks": per}


def starved(per_task_trials: dict[str, int], shares: dict[str, float], exhausted: set[str] = frozenset()) -> list[str]:
    """Tasks with >= 1 % of the FLOPs that got fewer trials than some task under 0.1 %, unless their design
    space was spent (ours says so in a task's progress; stock does not, so none of its tasks is exempt)."""
    light = [per_task_trials.get(k, 0) for k, s in shares.items() if s < LIGHT]
    if not light:
        return []
    return sorted(k for k, s in shares.items()
                  if s >= HEAVY and per_task_trials.get(k, 0) < max(light) and k not in exhausted)


def exhausted_tasks(r, job_id: str) -> list[str]:
    from shared import store

    return sorted(p.name for p in store.job_progress(r, job_id).values() if p.exhausted)


def rescore(out_path: Path, work: Path) -> None:
    """Recount starved tasks of a finished run with each job's exhausted tasks, read from the stores its
    jobs left in the work dir (runs made before the job's progress said which tasks were exhausted)."""
    from services.broker.server import EmbeddedRedis
    from shared import store

    rep = json.loads(out_path.read_text())
    for run in rep["runs"]:
        shares = {k: v["flops_share"] for k, v in run["tasks"].items()}
        for b, e in run["budgets"].items():
            red = EmbeddedRedis(work / f"{run['model']}_s{run['seed']}" / f"ours_{b}" / "ours" / "redis")
            red.start()
            try:
                r = store.connect(red.url)
                ex = exhausted_tasks(r, store.jobs(r)[0])
            finally:
                red.stop()
            e["ours"]["tasks_exhausted"] = ex
            e["starved"]["ours"] = starved(e["trials_per_task"]["ours"], shares, set(ex))
    rep["summary"] = summarise(rep["runs"], [int(b) for b in rep["runs"][0]["budgets"]])
    out_path.write_text(json.dumps(rep, indent=2) + "\n")
    print(table(rep))


# ---- stock ---------------------------------------------------------------------------------------------


def stock_trials(work: Path, fused, target) -> tuple[list[dict], dict, dict]:
    """The stock run's trials in measurement order, its tasks, and per task the record lines in order."""
    from tvm.s_tir import meta_schedule as ms
    from tvm_ffi import structural_hash

    db_dir = work / "stock" / "ms"
    ext = ms.relax_integration.extract_tasks(fused, target)
    tasks = {t.task_name: {"weight": int(t.weight)} for t in ext}
    names_ = [t.task_name for t in ext]
    # workload index (line of database_workload.json) -> task name, by the structural hash the file keeps
    by_hash = {str(structural_hash(t.dispatched[0]) % 2**64): t.task_name for t in ext}
    wl_task = {i: by_hash[json.loads(line)[0]]
               for i, line in enumerate((db_dir / "database_workload.json").read_text().splitlines()) if line.strip()}
    lines: dict[str, list[str]] = {k: [] for k in tasks}
    for line in (db_dir / "database_tuning_record.json").read_text().splitlines():
        if line.strip():
            lines[wl_task[json.loads(line)[0]]].append(line)
    log = "\n".join(p.read_text(errors="replace") for p in sorted((db_dir / "logs").glob("*task_scheduler*")))
    if "TaskScheduler picks" not in log:
        log = (work / "stock.log").read_text(errors="replace")
    batches = stock_batches(log)
    t0 = batches[0]["t"] if batches and batches[0]["t"] else 0.0
    pos = {k: 0 for k in tasks}
    trials = []
    for b in batches:
        name = names_[b["task"]]
        for j in range(b["n"]):
            i = pos[name] + j
            us = None
            if i < len(lines[name]):
                secs = json.loads(lines[name][i])[1][1]
                if secs:
                    mean = sum(secs) / len(secs)
                    us = None if mean >= 1e9 else 1e6 * mean
            trials.append({"task": name, "t": (b["t"] - t0) if b["t"] else None, "us": us, "line": i})
        pos[name] += b["n"]
    unmatched = sum(max(0, pos[k] - len(lines[k])) + max(0, len(lines[k]) - pos[k]) for k in tasks)
    return trials, tasks, {"lines": lines, "unmatched_records": unmatched, "batches": len(batches)}


def stock_database(work: Path, lines: dict[str, list[str]], trials: list[dict], budget: int, out: Path) -> Path:
    """A JSON database of the stock records among the first `budget` trials."""
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(work / "stock" / "ms" / "database_workload.json", out / "database_workload.json")
    keep = {(tr["task"], tr["line"]) for tr in trials[:budget]}
    with open(out / "database_tuning_record.json", "w") as f:
        for name, ls in lines.items():
            for i, line in enumerate(ls):
                if (name, i) in keep:
                    f.write(line + "\n")
    return out


# ---- ours ---------------------------------------------------------------------------------------------


def run_ours(model: str, relax_mod, trials: int, per_iter: int, seed: int, work: Path, budgets: list[int],
             timeout_s: float, resume: bool = False, *, lanes: list[str] | None = None, target: str = "llvm",
             share: int | None = None, stack_kw: dict | None = None) -> dict:
    """Tune with the service (a fresh local Stack: CPU lanes unless `lanes` name others); its trials in
    measurement order, and a JSON database per budget (written while the stack's Redis is up)."""
    from tvm.s_tir import meta_schedule as ms

    from shared.lanes import parse as parse_lane
    from services.tuner.metaschedule.records import tvm_record
    from shared import store
    from services.tuner.metaschedule.ir_codec import load_ir
    from sharetune.client import Client
    from services.measurer.agent import default_cpu_lanes
    from sharetune.stack.local import Stack
    from shared.settings import StackSettings

    lanes = lanes or default_cpu_lanes()
    share = share or parse_lane(lanes[0]).share
    resumed = resume and (work / "ours" / "redis").exists()
    if resumed:  # a finished job of an earlier try, from its store (AOF)
        from services.broker.server import EmbeddedRedis

        stack = EmbeddedRedis(work / "ours" / "redis")
        stack.start()
        r = store.connect(stack.url)
        job = SimpleNamespace(job_id=store.jobs(r)[0])
        res = store.job_result(r, job.job_id)
        startup_s = wall_s = None
        t1 = float(store.job_state(r, job.job_id).get("tuning_at") or 0.0)
        print(f"[ours] {model}: job {job.job_id} read from the earlier try's store", flush=True)
    else:
        stack = Stack(work / "ours", lanes=lanes, **(stack_kw or {}), settings=StackSettings())
        print(f"[ours] {model} seed {seed}: stack with lanes {lanes}", flush=True)
    try:
        if not resumed:
            t0 = time.time()
            stack.start()
            startup_s = time.time() - t0
            client = Client(stack.redis_url)
            t1 = time.time()
            job = client.submit(relax_mod, target=target, share=share, trials=trials, name=model,
                                trials_per_iter=per_iter, seed=seed, untuned_baseline=target == "llvm")
            job.wait(timeout_s=timeout_s)
            res = job.result()
            wall_s = time.time() - t1
            r = client.redis
        state = store.job_state(r, job.job_id)
        t_start = float(state.get("tuning_at") or t1)
        jtasks = store.job_tasks(r, job.job_id)
        tasks = {t.name: {"weight": t.weight, "flops": t.flops} for t in jtasks}
        recs = job_records(r, job.job_id)
        from shared.ranking import rank_secs

        trials_out = [{"task": t.name, "t": x.measured_at - t_start,
                       "us": 1e6 * rank_secs(x.run_secs) if store.valid_record(x) else None} for x, t in recs]
        from services.tuner.metaschedule.defaults import keeps_records
        from shared.ranking import default_secs

        exhausted = exhausted_tasks(r, job.job_id)

        dbs, left_on_default = {}, {}
        for b in budgets:
            d = work / "ours" / f"db_{b}"
            if d.exists():
                shutil.rmtree(d)
            d.mkdir(parents=True)
            db = ms.database.JSONDatabase(work_dir=str(d), module_equality="structural")
            # as the service exports: a task's records only when their best beats its default schedule
            best: dict[str, float] = {}
            for x, t in recs[:b]:
                if store.valid_record(x):
                    best[t.wkey] = min(best.get(t.wkey, float("inf")), rank_secs(x.run_secs))
            keep = {w for w, s in best.items() if keeps_records(s, default_secs(store.default_timing(r, w)))}
            left_on_default[b] = sorted(t.name for t in jtasks if t.wkey in set(best) - keep)
            wls = {}
            for x, t in recs[:b]:
                if not store.valid_record(x) or t.wkey not in keep:
                    continue
                if t.wkey not in wls:
                    wls[t.wkey] = db.commit_workload(load_ir(store.workload(r, t.wkey).mod))
                db.commit_tuning_record(tvm_record(x, wls[t.wkey]))
            dbs[b] = d
    finally:
        stack.stop()
    print(f"[ours] start-up {startup_s} s, submit->result {wall_s} s, {res.trials} trials", flush=True)
    return {"wall_s": rounded(wall_s), "startup_s": rounded(startup_s), "tuner_wall_s": rounded(res.wall_s), "trials_run": res.trials,
            "errors": sum(1 for tr in trials_out if tr["us"] is None), "lanes": lanes, "share": share,
            "job_id": res.job_id, "trials": trials_out, "tasks": tasks, "dbs": dbs, "resumed": resumed,
            "left_on_default": left_on_default, "exhausted": exhausted}


def one_run(args, model: str, seed: int, work: Path, foreign: ForeignLoad) -> dict:
    from services.tuner.metaschedule.extract import fuse
    from sharetune.intake import to_relax

    top = max(args.budgets)
    rm = to_relax(model)
    target = lane_target()
    foreign.set_phase(f"{model}/s{seed}/stock")
    sargs = SimpleNamespace(model=model, trials=top, per_iter=args.per_iter, timeout=args.timeout, seed=seed)
    print(f"[stock] {model} seed {seed}: tune_relax {top} trials, {args.per_iter} a round", flush=True)
    if args.reuse_stock and (work / "stock_result.json").exists():  # resume: the stock run of an earlier try
        stock = json.loads((work / "stock_result.json").read_text())
    else:
        stock = tune_relax(sargs, work)
    s_trials, s_tasks, s_db = stock_trials(work, fuse(rm.mod), target)
    base = task_baselines(fuse(rm.mod), target)
    foreign.set_phase(f"{model}/s{seed}/ours")
    ours_by = {}
    for b in args.budgets:
        print(f"[ours] {model} seed {seed}: a job of {b} trials", flush=True)
        ours_by[b] = run_ours(model, rm.mod, b, args.per_iter, seed, work / f"ours_{b}", [b], args.timeout,
                              args.reuse_stock)
    ours = ours_by[top]
    shares = _shares(ours["tasks"])
    foreign.set_phase(f"{model}/s{seed}/compile")
    libs, compile_s, budgets = {}, {}, {}
    for b in args.budgets:
        sdb = stock_database(work, s_db["lines"], s_trials, b, work / "stock" / f"db_{b}")
        for side, d in (("stock", sdb), ("ours", ours_by[b]["dbs"][b])):
            lib = work / f"{side}_{b}.so"
            compile_s[f"{side}_{b}"] = rounded(compile_at(d, rm.mod, target, lib))
            libs[f"{side}_{b}"] = str(lib)
        sb, ob = at_budget(s_trials, s_tasks, b, base), at_budget(ours_by[b]["trials"], ours_by[b]["tasks"], b, base)
        budgets[str(b)] = {
            "stock": {k: v for k, v in sb.items() if k != "tasks"},
            "ours": {k: v for k, v in ob.items() if k != "tasks"}
                    | {"tasks_left_on_default": ours_by[b].get("left_on_default", {}).get(b),
                       "tasks_exhausted": ours_by[b].get("exhausted")},
            "trials_per_task": {"stock": {k: v["trials"] for k, v in sb["tasks"].items()},
                                "ours": {k: v["trials"] for k, v in ob["tasks"].items()}},
            "best_us_per_task": {"stock": {k: v["best_us"] for k, v in sb["tasks"].items()},
                                 "ours": {k: v["best_us"] for k, v in ob["tasks"].items()}},
            "starved": {"ours": starved({k: v["trials"] for k, v in ob["tasks"].items()}, shares,
                                        set(ours_by[b].get("exhausted", []))),
                        "stock": starved({k: v["trials"] for k, v in sb["tasks"].items()}, shares)},
        }
        print(f"[compile] {model} budget {b}: stock {compile_s[f'stock_{b}']} s, ours {compile_s[f'ours_{b}']} s",
              flush=True)
    untuned = work / "untuned.so"
    import tvm

    tvm.compile(rm.mod, target=target).export_library(str(untuned))  # its default pipeline legalizes
    libs["untuned"] = str(untuned)
    foreign.set_phase(f"{model}/s{seed}/latency")
    lat = pinned_latency(model, libs, args.number, args.repeat)
    for b in args.budgets:
        e = budgets[str(b)]
        e["stock"]["latency_us"] = lat[f"stock_{b}"]["median_us"]
        e["ours"]["latency_us"] = lat[f"ours_{b}"]["median_us"]
        e["stock"]["max_abs_err"] = lat[f"stock_{b}"]["max_abs_err"]
        e["ours"]["max_abs_err"] = lat[f"ours_{b}"]["max_abs_err"]
        e["latency_ratio"] = rounded(e["ours"]["latency_us"] / e["stock"]["latency_us"], 4)
    return {
        "model": model, "seed": seed,
        "tasks": {k: {"weight": v["weight"], "flops_share": rounded(shares.get(k), 5)} for k, v in ours["tasks"].items()},
        "untuned_task_us": {k: rounded(v, 3) for k, v in base.items()},
        "stock_task_names_missing_in_ours": sorted(set(s_tasks) - set(ours["tasks"])),
        "budgets": budgets,
        "untuned_latency_us": lat["untuned"]["median_us"],
        "latency_detail": lat,
        "compile_s": compile_s,
        "stock": {"wall_s": stock["wall_s"], "trials": len(s_trials), "errors": sum(1 for t in s_trials if t["us"] is None),
                  "batches": s_db["batches"], "unmatched_records": s_db["unmatched_records"],
                  "breakdown_s": stock["breakdown_s"],
                  "curve": curve_points(s_trials, s_tasks, base)},
        "ours": {k: ours[k] for k in ("wall_s", "startup_s", "tuner_wall_s", "trials_run", "errors", "lanes", "share",
                                     "job_id", "resumed")}
                | {"curve": curve_points(ours["trials"], ours["tasks"], base),
                   "by_budget": {str(b): {k: o[k] for k in ("wall_s", "tuner_wall_s", "trials_run", "errors", "job_id")}
                                 | {"curve": curve_points(o["trials"], o["tasks"], base)}
                                 for b, o in ours_by.items()}},
    }


def _shares(tasks: dict[str, dict]) -> dict[str, float]:
    total = sum(max(v["flops"], 1.0) * v["weight"] for v in tasks.values()) or 1.0
    return {k: max(v["flops"], 1.0) * v["weight"] / total for k, v in tasks.items()}


# ---- summary ------------------------------------------------------------------------------------------


def summarise(runs: list[dict], budgets: list[int]) -> dict:
    per_model = {}
    for model in sorted({r["model"] for r in runs}):
        mine = [r for r in runs if r["model"] == model]
        ratios = {str(b): rounded(statistics.median(r["budgets"][str(b)]["latency_ratio"] for r in mine), 4) for b in budgets}
        per_model[model] = {"latency_ratio_by_budget": ratios, "latency_vs_stock_max": max(ratios.values()),
                            "seeds": [r["seed"] for r in mine]}
    starved_ours = sorted({f"{r['model']}/s{r['seed']}@{b}:{t}" for r in runs for b in budgets
                           for t in r["budgets"][str(b)]["starved"]["ours"]})
    starved_stock = sorted({f"{r['model']}/s{r['seed']}@{b}:{t}" for r in runs for b in budgets
                            for t in r["budgets"][str(b)]["starved"]["stock"]})
    return {"latency_vs_stock_max": max(m["latency_vs_stock_max"] for m in per_model.values()),
            "starved_tasks": len({s.split(":", 1)[1] + "@" + s.split("/")[0] for s in starved_ours}),
            "starved_detail": starved_ours, "stock_starved_tasks": starved_stock, "per_model": per_model,
            "goals": {"latency_vs_stock_max": "<= 1.0", "starved_tasks": "= 0"}}


def table(rep: dict) -> str:
    lines = [f"{'model':12s} {'seed':>4s} {'budget':>6s} {'stock us':>10s} {'ours us':>10s} {'ours/stock':>10s} "
             f"{'stock est':>10s} {'ours est':>10s} {'stock t s':>9s} {'ours t s':>9s}"]
    for r in rep["runs"]:
        for b, e in r["budgets"].items():
            lines.append(f"{r['model']:12s} {r['seed']:4d} {b:>6s} {e['stock']['latency_us']:10.1f} "
                         f"{e['ours']['latency_us']:10.1f} {e['latency_ratio']:10.3f} {_f(e['stock']['est_us'])} "
                         f"{_f(e['ours']['est_us'])} {_f(e['stock']['t_s'], 9)} {_f(e['ours']['t_s'], 9)}")
        lines.append(f"{'':12s} untuned {r['untuned_latency_us']} us; stock wall {r['stock']['wall_s']} s, "
                     f"ours wall {r['ours']['wall_s']} s at {max(r['budgets'], key=int)} trials (+ start-up {r['ours']['startup_s']} s)")
    s = rep["summary"]
    lines.append(f"latency_vs_stock_max {s['latency_vs_stock_max']}, starved_tasks {s['starved_tasks']} "
                 f"(stock's own: {len(s['stock_starved_tasks'])})")
    return "\n".join(lines)


def _f(x, w=10) -> str:
    return f"{'-':>{w}s}" if x is None else f"{x:{w}.1f}"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="resnet18,mobilenetv2")
    ap.add_argument("--budgets", default="64,128,256,512")
    ap.add_argument("--per-iter", type=int, default=64)
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--number", type=int, default=5, help="latency: runs per round")
    ap.add_argument("--repeat", type=int, default=15, help="latency: interleaved rounds (median reported)")
    ap.add_argument("--timeout", type=float, default=5400.0, help="per side, seconds")
    ap.add_argument("--work-dir", default=None, help="scratch (default: a temp dir, removed unless --keep)")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--rehearse", action="store_true", help="tiny model, budgets 16,32, 16 a round")
    ap.add_argument("--out", default=None)
    ap.add_argument("--rescore", default=None, help="with --work-dir: recount a finished run's starved tasks "
                    "(this JSON) with the exhausted tasks its jobs' stores name")
    ap.add_argument("--reuse-stock", action="store_true", help="with --work-dir: keep a finished stock run and a finished job of ours there (resume)")
    args = ap.parse_args(argv)
    if args.rescore:
        rescore(Path(args.rescore), Path(args.work_dir))
        return
    if args.rehearse:
        args.models, args.budgets, args.per_iter, args.number, args.repeat = "small_cnn", "16,32", 16, 5, 5
    args.models = [m for m in args.models.split(",") if m]
    args.budgets = sorted(int(b) for b in args.budgets.split(","))
    args.seeds = [int(s) for s in args.seeds.split(",")]
    out = Path(args.out or RESULTS / ("search_quality_rehearsal.json" if args.rehearse
                                                         else "search_quality.json"))
    os.environ["TVM_NUM_THREADS"] = "1"  # the lanes' target says num-cores 1; before tvm starts its pool
    os.environ.pop("REDIS_URL", None)  # a fresh embedded Redis: no records reused from elsewhere
    scratch = Path(args.work_dir or tempfile.mkdtemp(prefix="search_quality_")).resolve()
    load_start = os.getloadavg()
    foreign = ForeignLoad()
    t_all = time.time()
    runs = []
    rep = {}
    for model in args.models:
        for seed in args.seeds:
            work = scratch / f"{model}_s{seed}"
            work.mkdir(parents=True, exist_ok=True)
            runs.append(one_run(args, model, seed, work, foreign))
            rep = report(args, runs, foreign, load_start, t_all, argv, final=False)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(rep, indent=2) + "\n")  # each finished model is kept
            print(table(rep), flush=True)
    rep = report(args, runs, foreign, load_start, t_all, argv, final=True)
    out.write_text(json.dumps(rep, indent=2) + "\n")
    print()
    print(table(rep))
    print(f"\nwrote {out}")
    if args.keep or args.work_dir:
        print(f"scratch kept in {scratch}")
    else:
        shutil.rmtree(scratch, ignore_errors=True)


def report(args, runs, foreign, load_start, t_all, argv, final: bool) -> dict:
    return {
        "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "models": args.models, "budgets": args.budgets, "per_iter": args.per_iter, "seeds": args.seeds,
        "complete": final,
        "target": target_dict(lane_target()),
        "method": {
            "budgets": "stock tuned once per model and seed for the largest budget, smaller budgets read off that "
                       "run (the first B trials in measurement order: its choices do not depend on the total budget); "
                       "ours tuned once per budget in a fresh store (its first rounds share a small budget evenly, "
                       "so its choices depend on the budget)",
            "stock": "a fresh subprocess (bench.harness.stock): tune_relax (gradient task scheduler), "
                     "LocalBuilder(max_workers=2, timeout_sec=120), LocalRunner(), seed as listed; measurement "
                     "order from the task scheduler's log (batches of task i = task i's records in its database "
                     "file order); a batch's time = its 'Sending M valid sample(s) to runner' log line (1 s resolution)",
            "ours": "fresh local Stack per budget (one single-core lane per core), Client.submit(trials=B, seed=...); "
                    "order and time = each record's measured_at; ours.curve is the largest budget's job; its "
                    "database per budget holds a task's records only when their best beats the task's default "
                    "schedule as a lane timed it (as the service exports: services/tuner/metaschedule/defaults.py)",
            "latency": f"compile_relax with the records of the first B trials (JSON database per side and budget), "
                       f"all libraries of a model timed in this process pinned to one core, TVM_NUM_THREADS=1, "
                       f"interleaved: median over {args.repeat} rounds of the mean of {args.number} runs",
            "estimate": "est_us = sum over tasks of weight x best task latency, a task not tuned yet at its "
                        "untuned latency (untuned_task_us: tvm.compile of its workload, no schedule, timed here)",
            "best_per_task": "stock: mean of a record's run_secs (what TVM ranks by); ours: median of repeats",
        },
        "summary": summarise(runs, args.budgets) if runs else None,
        "runs": runs,
        "host": {"cpus": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version(),
                 "loadavg_start": load_start, "loadavg_now": os.getloadavg(),
                 "foreign_load": {p: {"foreign_cpu_s": rounded(foreign.cpu_s.get(p, 0.0), 1)} for p in foreign.cpu_s},
                 "note": "a shared 2-core host: other people's tests run on it at the same time; foreign_load "
                         "is CPU time of processes outside this benchmark per phase (a lower bound)"},
        "bench_total_s": rounded(time.time() - t_all),
        "command": command_line("bench.search_quality", argv),
        "code": git_state(),
    }


if __name__ == "__main__":
    main()

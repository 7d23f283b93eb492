"""Search quality per trial on the GPU (the H200 run of bench/search_quality.py): stock MetaSchedule against
this service on whole models, every task, 64 candidates a round, equal trials, side by side on the 2-GPU host
as DESIGN.md section 4 says.

    python -m bench.search_quality_gpu --models mobilenetv2,resnet18 --budgets 64,128,256 [--model-budgets resnet18=64,128]
    python -m bench.search_quality_gpu --rehearse      # the same code on CPU (llvm), small_cnn, 16 a round
    python -m bench.search_quality_gpu --guard bench/results/search_quality_h200_unguarded.json --work-dir /tmp/sqg

- stock: `tune_tasks` over every task of the model (its gradient task scheduler, LocalBuilder on its cores,
  LocalRunner), seed 0, up to the largest budget, in its own process on the last GPU and cores 16-31
  (python -m bench.harness.stock tasks); smaller budgets are read off that run in measurement order (its task
  scheduler's log, as bench/search_quality.py does on the CPU).
- ours, at the same time on GPU 0 and cores 0-15: one job per budget, each in a fresh stack (one 100 % lane,
  16 builders, 4 tuner clients), seed 0: its first rounds share a small budget evenly, so its choices depend
  on the budget.
- then, on the whole host: each side's records of its first B trials compiled into the whole model
  (`compile_relax`, JSON database; tasks without records get DLight's default GPU schedules, as the untuned
  model does), in parallel processes, and every library of a model timed in one fresh process on GPU 0 at
  100 %, interleaved rounds, output checked against PyTorch.

The driver writes its JSON after every phase (`--out`), so a run stopped early keeps what it measured."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

from bench import search_quality as sq
from bench.harness.common import command_line, cores_of, git_state, rounded
from bench.harness.jobs import gpu_lane, gpus as find_gpus
from bench.harness.samplers import BusySampler
from bench.harness.serving import serve, spawn_compile
from bench.harness.stock import kill_group, make_target, spawn_tune_tasks
from bench.scale_h200 import probe_hidden_gpu_build

OURS_CORES, STOCK_CORES = "0-15", "16-31"


def budgets_of(args, model: str) -> list[int]:
    return args.model_budgets.get(model, args.budgets)


def run_stock(model: str, top: int, args, work: Path, uuid: str | None) -> dict:
    """Stock tune_tasks on every task of the model up to `top` trials, in its own process group."""
    ms_dir = work / "stock" / "ms"
    ms_dir.mkdir(parents=True, exist_ok=True)
    cores = "1" if args.rehearse else STOCK_CORES
    t0 = time.time()
    sampler = BusySampler(uuid)
    proc = spawn_tune_tasks(model, ms_dir, args.per_iter, top, cores, uuid, args.rehearse, work / "stock.log")
    try:
        rc = proc.wait(timeout=args.stock_timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        rc = "timeout"
    return {"wall_s": rounded(time.time() - t0), "rc": rc, "gpu_busy_frac": sampler.stop(), "cores": cores}


def stock_side(args, uuid: str | None, work: Path, stock: dict) -> None:
    for model in args.models:
        try:
            stock[model] = run_stock(model, max(budgets_of(args, model)), args, work / model, uuid)
        except Exception as err:  # noqa: BLE001 - kept in the JSON; the other side goes on
            stock[model] = {"error": f"{type(err).__name__}: {err}", "trace": traceback.format_exc()[-1500:]}
        print(f"[stock] {model}: {json.dumps(stock[model])[:300]}", flush=True)


def ours_side(args, uuid: str | None, work: Path, ours: dict, save) -> None:
    from services.measurer.agent import BuilderSpec
    from sharetune.intake import to_relax

    if args.rehearse:
        lanes, target, share, stack_kw = None, "llvm", None, {}
    else:
        lanes, target, share = [gpu_lane(uuid, 100)], "cuda", 100
        stack_kw = {"tuners": args.tuners, "builders": BuilderSpec(16, OURS_CORES), "log_level": "INFO"}
        os.environ["SHARETUNE_SEARCH_THREADS"] = str(max(1, 16 // args.tuners))
    for model in args.models:
        mod = to_relax(model).mod
        ours[model] = {}
        for b in budgets_of(args, model):
            try:
                ours[model][b] = sq.run_ours(model, mod, b, args.per_iter, 0, work / model / f"ours_{b}", [b],
                                             args.job_timeout, lanes=lanes, target=target, share=share,
                                             stack_kw=stack_kw)
            except Exception as err:  # noqa: BLE001
                ours[model][b] = {"error": f"{type(err).__name__}: {err}", "trace": traceback.format_exc()[-1500:]}
                print(f"[ours-error] {model} @ {b}:\n{ours[model][b]['trace']}", flush=True)  # the device call stops waiting
            print(f"[ours] {model} @ {b}: {ours[model][b].get('wall_s')} s, {ours[model][b].get('trials_run')} trials "
                  f"{ours[model][b].get('error', '')}", flush=True)
            save()


def compile_all(args, work: Path, stock_rows: dict, ours: dict, uuid: str | None) -> dict:
    """Every library of every model in parallel processes: stock and ours at each budget, and untuned."""
    from sharetune.intake import to_relax
    from services.tuner.metaschedule.extract import fuse

    target = make_target(args.rehearse)
    procs, meta = {}, {}
    for model in args.models:
        w = work / model
        meta[model] = {}
        if "error" not in stock_rows.get(model, {"error": 1}):
            try:
                s_trials, s_tasks, s_db = sq.stock_trials(w, fuse(to_relax(model).mod), target)
                meta[model]["stock"] = (s_trials, s_tasks, s_db)
                for b in budgets_of(args, model):
                    db = sq.stock_database(w, s_db["lines"], s_trials, b, w / "stock" / f"db_{b}")
                    procs[(model, f"stock_{b}")] = (db, w / f"stock_{b}.so")
            except Exception as err:  # noqa: BLE001
                meta[model]["stock_error"] = f"{type(err).__name__}: {err}"
        for b in budgets_of(args, model):
            o = ours.get(model, {}).get(b, {})
            if "dbs" in o:
                procs[(model, f"ours_{b}")] = (o["dbs"][b], w / f"ours_{b}.so")
        empty = w / "untuned_db"
        empty.mkdir(parents=True, exist_ok=True)
        for name in ("database_workload.json", "database_tuning_record.json"):
            (empty / name).write_text("")
        procs[(model, "untuned")] = (empty, w / "untuned.so")
    t0 = time.time()
    libs, errors = compile_parallel(args, procs, uuid)
    for (model, label), err in errors.items():
        meta[model].setdefault("compile_errors", {})[label] = err
    print(f"[compile] {sum(len(v) for v in libs.values())} of {len(procs)} libraries in "
          f"{time.time() - t0:.0f} s", flush=True)
    return {"libs": libs, "meta": meta, "compile_s": rounded(time.time() - t0)}


def compile_parallel(args, procs: dict, uuid: str | None) -> tuple[dict, dict]:
    """{(model, label): (database dir, library path)} -> each compiled in its own process, all at once on
    the host's cores: ({model: {label: path}}, {(model, label): the log's tail} for those that failed)."""
    cores = "0-1" if args.rehearse else "0-31"
    running = {k: spawn_compile(db, 10**9, lib, cores, uuid, k[0], args.rehearse) for k, (db, lib) in procs.items()}
    libs, errors = {}, {}
    for k, p in running.items():
        try:
            p.wait(timeout=args.compile_timeout)
        except Exception:  # noqa: BLE001 - its library is missing: reported below
            p.kill()
        lib = procs[k][1]
        if lib.exists():
            libs.setdefault(k[0], {})[k[1]] = str(lib)
        else:
            log = Path(str(lib) + ".log")
            errors[k] = log.read_text(errors="replace")[-800:] if log.exists() else "?"
    return libs, errors


def serve_model(args, model: str, libs: dict, uuid: str | None, work: Path) -> dict:
    """Time one model's libraries in one fresh process at 100 % (GPU 0), interleaved, checked against PyTorch."""
    return serve(libs, model, work / model, args.rounds, uuid, check=True, timeout_s=args.serve_timeout)


def assemble(args, model: str, stock_row: dict, ours_m: dict, meta: dict, served: dict) -> dict:
    """The run's entry in the shape bench/search_quality.py writes (so its summary applies)."""
    lat, err = served.get("latency_us", {}), served.get("max_abs_err", {})
    top = ours_m.get(max(budgets_of(args, model)), {})
    tasks = top.get("tasks") or next((o["tasks"] for o in ours_m.values() if "tasks" in o), {})
    shares = sq._shares(tasks) if tasks else {}
    s_trials, s_tasks, s_db = meta.get("stock", ([], {}, {}))
    budgets = {}
    for b in budgets_of(args, model):
        o = ours_m.get(b, {})
        if "trials" not in o or not s_trials:
            continue
        sb, ob = sq.at_budget(s_trials, s_tasks, b, {}), sq.at_budget(o["trials"], o["tasks"], b, {})
        e = {"stock": {k: v for k, v in sb.items() if k != "tasks"} | {"latency_us": lat.get(f"stock_{b}"),
                                                                        "max_abs_err": err.get(f"stock_{b}")},
             "ours": {k: v for k, v in ob.items() if k != "tasks"} | {"latency_us": lat.get(f"ours_{b}"),
                                                                      "max_abs_err": err.get(f"ours_{b}"),
                                                                      "wall_s": o.get("wall_s")},
             "trials_per_task": {"stock": {k: v["trials"] for k, v in sb["tasks"].items()},
                                 "ours": {k: v["trials"] for k, v in ob["tasks"].items()}},
             "best_us_per_task": {"stock": {k: v["best_us"] for k, v in sb["tasks"].items()},
                                  "ours": {k: v["best_us"] for k, v in ob["tasks"].items()}},
             "starved": {"ours": sq.starved({k: v["trials"] for k, v in ob["tasks"].items()}, shares),
                         "stock": sq.starved({k: v["trials"] for k, v in sb["tasks"].items()}, shares)}}
        if e["stock"]["latency_us"] and e["ours"]["latency_us"]:
            e["latency_ratio"] = rounded(e["ours"]["latency_us"] / e["stock"]["latency_us"], 4)
        budgets[str(b)] = e
    return {
        "model": model, "seed": 0,
        "tasks": {k: {"weight": v["weight"], "flops_share": rounded(shares.get(k), 5)} for k, v in tasks.items()},
        "budgets": budgets,
        "untuned_latency_us": lat.get("untuned"),
        "latency_detail": served,
        "stock": stock_row | {"trials": len(s_trials), "errors": sum(1 for t in s_trials if t["us"] is None),
                              "batches": s_db.get("batches"), "unmatched_records": s_db.get("unmatched_records")},
        "ours": {str(b): {k: o.get(k) for k in ("wall_s", "startup_s", "tuner_wall_s", "trials_run", "errors", "job_id",
                                                 "error")} for b, o in ours_m.items()},
        "compile": {k: v for k, v in meta.items() if k not in ("stock",)},
    }


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


def guard(args) -> int:
    """The default-schedule guard (services/tuner/metaschedule/defaults.py) applied to the records of a
    finished run (`--guard` its JSON, `--work-dir` its work dir): each database cut to the tasks whose best
    record beats their default schedule, compiled, and timed beside the untuned and stock's models."""
    work = Path(args.work_dir).resolve()
    first = json.loads(Path(args.guard).read_text())
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
    libs, errors = compile_parallel(args, compiles, uuid)
    rep["compile_errors"] = {f"{m}/{label}": err for (m, label), err in errors.items()}
    rep["compile_s"] = rounded(time.time() - t0 - rep["defaults_s"])
    for run in first["runs"]:
        model = run["model"]
        m = rep["models"][model]
        served = serve_model(args, model, libs.get(model, {}), uuid, work)
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



def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="mobilenetv2,resnet18")
    ap.add_argument("--budgets", default="64,128,256")
    ap.add_argument("--model-budgets", default="", help="per model, e.g. resnet18=64,128;mobilenetv2=64")
    ap.add_argument("--per-iter", type=int, default=64)
    ap.add_argument("--tuners", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=20, help="timing: interleaved rounds")
    ap.add_argument("--stock-timeout", type=float, default=900.0, help="per model")
    ap.add_argument("--job-timeout", type=float, default=600.0, help="per job of ours")
    ap.add_argument("--compile-timeout", type=float, default=400.0)
    ap.add_argument("--serve-timeout", type=float, default=300.0)
    ap.add_argument("--work-dir", default="/tmp/sqg")
    ap.add_argument("--out", default=None, help="default: $OUT or the work dir, search_quality_h200.json")
    ap.add_argument("--rehearse", action="store_true", help="CPU lanes and llvm, small_cnn, budgets 16,32, 16 a round")
    ap.add_argument("--guard", metavar="FIRST_RUN", default=None,
                    help="apply the default-schedule guard to a finished run's records (its JSON; --work-dir its work dir)")
    args = ap.parse_args(argv)
    if args.guard:
        return guard(args)
    if args.rehearse:
        args.models, args.budgets, args.per_iter, args.rounds = "small_cnn", "16,32", 16, 5
    args.models = [m for m in args.models.split(",") if m]
    args.budgets = sorted(int(b) for b in args.budgets.split(","))
    args.model_budgets = {m: sorted(int(b) for b in bs.split(",")) for m, bs in
                          (kv.split("=", 1) for kv in args.model_budgets.split(";") if kv)}
    work = Path(args.work_dir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    out = Path(args.out or Path(os.environ.get("OUT") or work) / ("search_quality_gpu_rehearsal.json" if args.rehearse
                                                                     else "search_quality_h200.json"))
    os.environ.pop("REDIS_URL", None)
    gpus, rep_probe = [], None
    if not args.rehearse:
        gpus = find_gpus()
        try:
            probe = probe_hidden_gpu_build()
        except Exception as err:  # noqa: BLE001 - e.g. its timeout: builders keep the GPU in view
            probe = {"cubin": False, "error": f"{type(err).__name__}: {err}"}
        rep_probe = probe
        if not probe.get("cubin"):
            os.environ["SHARETUNE_BUILDER_HIDE_GPUS"] = "0"
    uuid_ours = gpus[0].uuid if gpus else None
    uuid_stock = gpus[-1].uuid if gpus else None
    t_all = time.time()
    stock, ours = {}, {}
    rep = {"models": args.models, "budgets": args.budgets, "per_iter": args.per_iter, "complete": False,
           "gpus": [g.uuid for g in gpus], "host_cores": os.cpu_count(),
           "command": command_line("bench.search_quality_gpu", argv),
           "code": git_state(), "builder_probe": rep_probe, "method": __doc__.split("\n\n", 2)[2]}

    def save(**extra):
        rep.update(extra, stock_side={m: {k: v for k, v in s.items() if k != "trace"} for m, s in stock.items()},
                   ours_side={m: {str(b): {k: v for k, v in o.items() if k in ("wall_s", "trials_run", "error", "job_id")}
                                  for b, o in om.items()} for m, om in ours.items()},
                   elapsed_s=rounded(time.time() - t_all))
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(rep, indent=1, default=str) + "\n")

    save(phase="tuning")
    stock_thread = threading.Thread(target=stock_side, args=(args, uuid_stock, work, stock), daemon=True)
    stock_thread.start()
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores_of("0" if args.rehearse else OURS_CORES))  # the stacks inherit it
    try:
        ours_side(args, uuid_ours, work, ours, save)
    finally:
        os.sched_setaffinity(0, before)
    stock_thread.join()
    tune_s = time.time() - t_all
    save(phase="compiling", tune_s=rounded(tune_s))
    comp = compile_all(args, work, stock, ours, uuid_ours)
    save(phase="timing", compile_s=comp["compile_s"])
    runs = []
    for model in args.models:
        try:
            served = serve_model(args, model, comp["libs"].get(model, {}), uuid_ours, work) if comp["libs"].get(model) else {}
            runs.append(assemble(args, model, stock.get(model, {}), ours.get(model, {}), comp["meta"].get(model, {}),
                                 served))
        except Exception as err:  # noqa: BLE001 - the other model still gets its figures
            runs.append({"model": model, "budgets": {}, "error": f"{type(err).__name__}: {err}",
                         "trace": traceback.format_exc()[-1500:]})
        rep["runs"] = runs
        save()
    complete = [r for r in runs if r["budgets"] and all("latency_ratio" in e for e in r["budgets"].values())]
    save(phase="done", complete=len(complete) == len(args.models), summary=summary_of(complete),
         total_s=rounded(time.time() - t_all))
    print(table(rep), flush=True)
    print(f"wrote {out}", flush=True)
    return 0


def summary_of(runs: list[dict]) -> dict | None:
    """bench/search_quality.py's summary, each model over its own budgets."""
    if not runs:
        return None
    per = [sq.summarise([r], [int(b) for b in r["budgets"]]) for r in runs]
    return {"latency_vs_stock_max": max(p["latency_vs_stock_max"] for p in per),
            "starved_tasks": sum(p["starved_tasks"] for p in per),
            "starved_detail": [d for p in per for d in p["starved_detail"]],
            "stock_starved_tasks": [d for p in per for d in p["stock_starved_tasks"]],
            "per_model": {k: v for p in per for k, v in p["per_model"].items()}, "goals": per[0]["goals"]}


def table(rep: dict) -> str:
    lines = [f"{'model':12s} {'budget':>6s} {'stock us':>10s} {'ours us':>10s} {'ours/stock':>10s} {'ours wall s':>11s}"]
    for r in rep.get("runs", []):
        for b, e in r["budgets"].items():
            lines.append(f"{r['model']:12s} {b:>6s} {sq._f(e['stock']['latency_us'])} {sq._f(e['ours']['latency_us'])} "
                         f"{e.get('latency_ratio') or float('nan'):10.3f} {sq._f(e['ours']['wall_s'], 11)}")
        lines.append(f"{'':12s} untuned {r['untuned_latency_us']} us; stock {r['stock'].get('wall_s')} s for "
                     f"{r['stock'].get('trials')} trials")
    if rep.get("summary"):
        s = rep["summary"]
        lines.append(f"latency_vs_stock_max {s['latency_vs_stock_max']}, starved_tasks {s['starved_tasks']}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

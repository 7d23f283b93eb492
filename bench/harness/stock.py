"""Stock MetaSchedule as the benchmarks run it (DESIGN.md section 4), each run in a fresh process of its own so
that nothing of this service's set-up is loaded there, and what its logs and databases say afterwards.

    python -m bench.harness.stock relax ...   # tune_relax to its budget (bench.cpu_tuning, bench.search_quality)
    python -m bench.harness.stock tasks ...   # tune_tasks on every task, until stopped or at its budget
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from bench.harness.common import child_env, module_command, rounded

STOCK_BUILDER_TIMEOUT_S = 120.0


def make_target(rehearse: bool):
    """The lanes' target: an H200's, or one CPU core's when rehearsing."""
    from services.measurer.metaschedule.targets import cpu_target, gpu_target

    return cpu_target(1) if rehearse else gpu_target()


def lane_target():
    import tvm

    return tvm.target.Target({"kind": "llvm", "num-cores": 1, "mcpu": tvm.target.codegen.llvm_get_system_cpu()})


def target_dict(target) -> dict:
    return json.loads(str(target))


def heaviest(model: str, k: int, target):
    from services.tuner.metaschedule.extract import extract, fuse
    from sharetune.intake import to_relax
    from tvm.s_tir import meta_schedule as ms

    mod = to_relax(model).mod
    tasks = extract(mod, target)
    tasks = sorted(tasks, key=lambda t: -t.flops * t.weight)[:k]
    names = [t.name for t in tasks]
    extracted = [t for t in ms.relax_integration.extract_tasks(fuse(mod), target) if t.task_name in names]
    return mod, names, extracted


# ---- tune_relax, to its budget ----------------------------------------------------------------------


def _tune_relax(args) -> None:
    """The child: tune_relax under ms.Profiler, compiled and exported; its figures to --stock-out."""
    t_proc = time.time()
    from tvm.s_tir import meta_schedule as ms

    from services.tuner.metaschedule.extract import fuse
    from sharetune.intake import to_relax

    import_s = time.time() - t_proc
    work_dir = Path(args.work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    t_conv = time.time()
    rm = to_relax(args.model)
    fused = fuse(rm.mod)
    convert_s = time.time() - t_conv
    target = lane_target()

    with ms.Profiler() as prof:
        t0 = time.time()
        db = ms.relax_integration.tune_relax(
            mod=fused,
            params={},
            target=target,
            work_dir=str(work_dir / "ms"),
            max_trials_global=args.trials,
            num_trials_per_iter=args.per_iter,
            builder=ms.builder.LocalBuilder(max_workers=2, timeout_sec=STOCK_BUILDER_TIMEOUT_S),
            runner=ms.runner.LocalRunner(),
            seed=getattr(args, "seed", 0),
        )
        wall_s = time.time() - t0
    profile = {str(k): float(v) for k, v in prof.get().items()}

    out = {
        "wall_s": rounded(wall_s),
        "profile_s": {k: rounded(v, 4) for k, v in sorted(profile.items())},
        "breakdown_s": stock_breakdown(profile, wall_s),
        "import_s": rounded(import_s),
        "convert_s": rounded(convert_s),
        "target": target_dict(target),
        # what sharetune set-up this process saw: none of it must have been loaded
        "sharetune_intrinsics_loaded": "services.tuner.metaschedule.intrinsics" in sys.modules,
        "tensor_intrin_is_stock_package": bool(getattr(sys.modules.get("tvm.s_tir.tensor_intrin"), "__file__", None)),
    }
    Path(args.stock_out).write_text(json.dumps(out, indent=2))  # kept even if what follows fails

    t1 = time.time()
    ex = ms.relax_integration.compile_relax(db, rm.mod, target, params=None)
    lib_path = str(work_dir / "stock_tuned.so")
    ex.export_library(lib_path)
    out["compile_s"] = rounded(time.time() - t1)
    out["tuned_module_path"] = lib_path

    # Per task: trials and best, from the database tune_relax returned (outside the timed region).
    from tvm_ffi import structural_equal

    records = list(db.get_all_tuning_records())
    tasks = []
    matched = 0
    for t in ms.relax_integration.extract_tasks(fused, target):
        mod = t.dispatched[0]
        mine = [r for r in records if structural_equal(r.workload.mod, mod)]
        matched += len(mine)
        ok = [c for c in (_mean_s(r) for r in mine) if c is not None]
        tasks.append({"name": t.task_name, "weight": int(t.weight), "records": len(mine),
                      "valid": len(ok), "best_us": rounded(1e6 * min(ok)) if ok else None})
    out["records"] = len(records)
    out["valid_records"] = sum(1 for r in records if _mean_s(r) is not None)
    out["unmatched_records"] = len(records) - matched
    out["tasks"] = tasks
    out["process_s"] = rounded(time.time() - t_proc)
    Path(args.stock_out).write_text(json.dumps(out, indent=2))


def _mean_s(rec) -> float | None:
    """Mean measured seconds of a record; None for a failed candidate (MetaSchedule stores 1e10 s)."""
    if rec.run_secs is None or len(rec.run_secs) == 0:
        return None
    vals = [float(getattr(s, "value", s)) for s in rec.run_secs]
    mean = sum(vals) / len(vals)
    return None if mean >= 1e9 else mean


def stock_breakdown(profile: dict[str, float], wall_s: float) -> dict:
    build = profile.get("SendToBuilder", 0.0)
    run = profile.get("SendToRunner", 0.0) + profile.get("JoinRunnerFutures", 0.0)
    evo = {k: v for k, v in profile.items() if k.startswith("EvoSearch/")}
    # scopes nest (EvoSearch/Evolve/Misc/CopyMeasuredWorkloads lies inside EvoSearch/Evolve/Misc): sum the outermost
    search = sum(v for k, v in evo.items() if not any(k.startswith(p + "/") for p in evo if p != k))
    cost_model = profile.get("MeasureCallback/UpdateCostModel", 0.0)
    return {
        "search": rounded(search),
        "build": rounded(build),
        "queue": None,
        "run": rounded(run),
        "cost_model": rounded(cost_model),
        "other": rounded(wall_s - search - build - run - cost_model),
        "profiler_total": rounded(profile.get("Total")),
    }


def tune_relax(args, work_dir: Path) -> dict:
    """Stock tune_relax of args.model (args.trials, args.per_iter, args.seed, args.timeout) in a fresh child
    process with TVM_NUM_THREADS=1; its figures, trials counted from its log."""
    import importlib.util

    if importlib.util.find_spec("cloudpickle") is None:  # TVM's PopenPool (LocalBuilder/LocalRunner) needs it
        raise SystemExit("stock MetaSchedule's LocalBuilder/LocalRunner need cloudpickle: pip install cloudpickle")
    out_path = work_dir / "stock_result.json"
    cmd = module_command("bench.harness.stock", "relax", "--model", args.model, "--trials", args.trials,
                         "--per-iter", args.per_iter, "--work-dir", work_dir / "stock", "--stock-out", out_path,
                         "--seed", getattr(args, "seed", 0))
    log_path = work_dir / "stock.log"
    print(f"[stock] fresh subprocess, log {log_path}", flush=True)
    t0 = time.time()
    with open(log_path, "wb") as log:
        proc = subprocess.run(cmd, env=child_env(TVM_NUM_THREADS="1"), stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout)
    if proc.returncode != 0 or not out_path.exists():
        tail = log_path.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"stock subprocess failed (rc {proc.returncode}); log tail:\n{tail}")
    res = json.loads(out_path.read_text())
    res["subprocess_s"] = rounded(time.time() - t0)
    # MetaSchedule's task scheduler logs every batch; trials = candidates sent to the builder (as ours
    # counts every measured candidate, failed ones included)
    text = log_path.read_text(errors="replace")
    res["trials"] = sum(int(n) for n in re.findall(r"Sending (\d+) sample\(s\) to builder", text))
    res["build_errors"] = sum(int(n) for n in re.findall(r"Build errors: (\d+) sample", text))
    res["errors"] = res["trials"] - res.get("valid_records", 0)
    print(f"[stock] tune_relax {res['wall_s']} s, {res['trials']} trials, subprocess {res['subprocess_s']} s", flush=True)
    return res


# ---- tune_tasks, in the background ------------------------------------------------------------------


def _tune_tasks(args) -> int:
    """The child: stock tune_tasks on every task of args.model, until its parent ends it or at its budget."""
    from tvm.s_tir import meta_schedule as ms

    from services.tuner.metaschedule.extract import fuse
    from sharetune.intake import to_relax

    target = make_target(args.rehearse)
    mod = to_relax(args.model).mod
    extracted = ms.relax_integration.extract_tasks(fuse(mod), target)
    work = str(args.stock_work)
    contexts, weights = ms.relax_integration.extracted_tasks_to_tune_contexts(extracted, work, seed=0)
    workers = len(os.sched_getaffinity(0))
    tune_tasks(contexts, weights, work, args.stock_max_trials, args.per_iter, workers)
    return 0


def tune_tasks(contexts, weights, work: str, trials: int, per_iter: int, workers: int):
    """Stock tune_tasks as DESIGN.md section 4 runs it: LocalBuilder on `workers` cores, LocalRunner."""
    from tvm.s_tir import meta_schedule as ms

    return ms.tune_tasks(tasks=contexts, task_weights=weights, work_dir=work, max_trials_global=trials,
                         num_trials_per_iter=per_iter,
                         builder=ms.builder.LocalBuilder(max_workers=workers, timeout_sec=STOCK_BUILDER_TIMEOUT_S),
                         runner=ms.runner.LocalRunner(timeout_sec=60), database=ms.database.JSONDatabase(work_dir=work))


def spawn_tune_tasks(model: str, work: Path, per_iter: int, max_trials: int, cores: str, gpu_uuid: str | None,
                     rehearse: bool, log_path: Path) -> subprocess.Popen:
    """The tune_tasks child on `cores` (and the GPU `gpu_uuid`), in a process group of its own."""
    env = child_env(CUDA_VISIBLE_DEVICES=gpu_uuid) if gpu_uuid else child_env()
    cmd = ["taskset", "-c", cores] + module_command(
        "bench.harness.stock", "tasks", "--model", model, "--stock-work", work, "--per-iter", per_iter,
        "--stock-max-trials", max_trials) + (["--rehearse"] if rehearse else [])
    with open(log_path, "w") as log:
        return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def kill_group(proc: subprocess.Popen) -> None:
    """The child and its builder pool: one process group."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(30)


def stock_records(work: Path) -> list[str]:
    path = work / "database_tuning_record.json"
    return path.read_text().splitlines() if path.exists() else []


def stock_trials_from_log(log_text: str) -> int:
    """Candidates stock sent to its runner (timed right away by LocalRunner). Its task scheduler commits a
    task's records to the database only when it comes back to that task, so over a short window on a model
    with many tasks the database holds none of them: its own log is what counts."""
    return sum(int(m) for m in re.findall(r"Sending (\d+) valid sample\(s\) to runner", log_text))


def stock_steady_from_log(log_text: str) -> dict:
    """Stock's rate once started: from its first batch sent to the builder to its next task pick after the
    last batch it sent to the runner (that batch then timed)."""
    def at(line):
        return _log_time(line[:19])

    lines = [l for l in log_text.splitlines() if re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", l)]
    first = next((at(l) for l in lines if re.search(r"sample\(s\) to builder", l)), None)
    runner = [i for i, l in enumerate(lines) if re.search(r"valid sample\(s\) to runner", l)]
    if first is None or not runner:
        return {}
    after = next((at(l) for l in lines[runner[-1] + 1:] if "TaskScheduler picks" in l), at(lines[runner[-1]]))
    trials = stock_trials_from_log(log_text)
    return {"active_s": round(after - first, 1), "steady_trials_per_min": round(60 * trials / max(after - first, 1e-9), 1)}


_TS = re.compile(r"(\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(?:[.,]\d+)?)")


def _log_time(line: str) -> float | None:
    m = _TS.search(line)
    if not m:
        return None
    s = m.group(1).replace(",", ".").replace("T", " ")
    fmt = "%Y-%m-%d %H:%M:%S.%f" if "." in s else "%Y-%m-%d %H:%M:%S"
    return _dt.datetime.strptime(s, fmt).timestamp()


def stock_batches(log_text: str) -> list[dict]:
    """[{task (index), n, t}] in dispatch order, from the task scheduler's log: n from "Sending N sample(s)
    to builder" (every candidate, as trials are counted), t from the "Sending M valid sample(s) to runner"
    line that follows (its build done), else from the builder line."""
    out, task = [], None
    for line in log_text.splitlines():
        m = re.search(r"TaskScheduler picks Task #(\d+)", line)
        if m:
            task = int(m.group(1))
            continue
        m = re.search(r"Sending (\d+) sample\(s\) to builder", line)
        if m and task is not None:
            out.append({"task": task, "n": int(m.group(1)), "t": _log_time(line)})
            continue
        if re.search(r"Sending \d+ (?:valid )?sample\(s\) to runner", line) and out:
            out[-1]["t"] = _log_time(line) or out[-1]["t"]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("how", choices=["relax", "tasks"])
    ap.add_argument("--model", required=True)
    ap.add_argument("--per-iter", type=int, required=True)
    ap.add_argument("--trials", type=int, default=0, help="relax: the budget")
    ap.add_argument("--work-dir", default=None, help="relax: its scratch")
    ap.add_argument("--stock-out", default=None, help="relax: its figures")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stock-work", default=None, help="tasks: its work dir and JSON database")
    ap.add_argument("--stock-max-trials", type=int, default=100000)
    ap.add_argument("--rehearse", action="store_true", help="tasks: one CPU core's target instead of the GPU's")
    args = ap.parse_args(argv)
    if args.how == "tasks":
        return _tune_tasks(args)
    os.environ["TVM_NUM_THREADS"] = "1"  # before tvm starts its thread pool
    _tune_relax(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())

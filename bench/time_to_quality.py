"""Time to quality: how long a user waits, from submit, until the model is fast; stock MetaSchedule (stock),
this service on a fresh store (cold) and on one that tuned the zoo first (warm), on the panel (bench/panel.py),
one GPU. Protocol and results: docs/time_to_quality.md.

    python -m bench.time_to_quality --resume --deadline-s 1300       # on the GPU machine (a line of device_run.sh plan)
    python -m bench.time_to_quality --rehearse --models efficientnet-mbconv --trials 24 --per-iter 8
    python -m bench.time_to_quality --table bench/results/time_to_quality_h200.json
    -> $OUT/time_to_quality_h200.json (rehearsal: time_to_quality_rehearsal.json) and a PNG beside it
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench.harness.common import kept_in_repo, out_dir, tuning_options
from bench.harness.jobs import gpu_lane, gpus as find_gpus, local_stack, run_job
from bench.harness.serving import export_job_records, serve, spawn_compile
from bench.harness.stock import kill_group, make_target, spawn_tune_tasks
from bench.panel import PANEL, build
from sharetune.experiments.time_to_quality import (
    job_events, kernel_names, kernel_sets, markdown_table, retimed_runs, trial_cuts, run_databases, plot,
    settings_in_effect, step_kernels, stock_events, summarise, summarise_model, table_again)

PHASES = ("stock", "cold", "warm")
# what a step is expected to take, to leave one that cannot finish before the deadline
STOCK_TRIALS_PER_MIN = 31.0  # the slowest panel model so far (vit-s-encoder, 31.4 a minute)
STOCK_STARTUP_S = 90.0
SERVICE_STEP_S = 100.0  # a 384-trial panel job 32-55 s on an H200 or H100, its stack ~20 s
SERVE_S = 200.0  # the modules (6 compiles), each task's kernels and each curve's steps: built, then timed
WARM_STORE_S = 260.0  # three zoo models at 384 trials: 218 s on the H200, 207 s on an H100


class FileLines:
    """When each line of a growing file appeared: polled every `every_s` from a thread."""

    def __init__(self, path: Path, t0: float, every_s: float = 1.0):
        self.path, self.t0, self.every_s = path, t0, every_s
        self.seen: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.is_set():
            self._read()
            self._stop.wait(self.every_s)

    def _read(self) -> None:
        try:
            n = self.path.read_bytes().count(b"\n")
        except OSError:
            return
        now = time.time() - self.t0
        self.seen += [now] * max(0, n - len(self.seen))

    def stop(self) -> list[float]:
        self._stop.set(), self._thread.join(), self._read()
        return self.seen


def run_stock(args, model: str, work: Path) -> dict:
    """Stock to its budget; returns its events (time each record was committed) and wall time."""
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    t0 = time.time()
    lines = FileLines(work / "database_tuning_record.json", t0)
    proc = spawn_tune_tasks(model, work, args.per_iter, args.trials, None, None, args.rehearse, work / "stock.log")
    try:
        proc.wait(timeout=args.stock_timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        raise
    wall, seen = time.time() - t0, lines.stop()
    row = {"wall_s": round(wall, 1), "exit": proc.returncode, "trials_per_min": None}
    if proc.returncode != 0:
        row["error"] = (work / "stock.log").read_text()[-1500:]
        return row
    events, weights = stock_events(work, seen)
    row.update(trials=len(events), trials_per_min=round(60 * len(events) / wall, 1), events=events, weights=weights)
    return row


def service_stack(args, work: Path):
    """(a stack in `work` as the protocol has it, the share and target a job there is submitted at): rehearsal, one
    CPU lane and one builder; else one 100 % lane of the first GPU and a builder a core."""
    if args.rehearse:
        lanes, share, target, builders = ["measure.cpu.c0"], 50, "llvm", 1
    else:
        lanes, share, target, builders = [gpu_lane(find_gpus()[0].uuid, 100)], 100, "cuda", len(os.sched_getaffinity(0))
    return local_stack(work, lanes, args.tuners, builders), share, target


def run_service(args, model: str, work: Path, store_from: Path | None = None) -> dict:
    """One job of the model on a stack in `work` (its store copied from `store_from` first: warm)."""
    from shared import store
    from shared.settings import physical_cores
    from sharetune.client import Client

    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    if store_from is not None:
        shutil.copytree(store_from / "redis", work / "redis")
    stack_of, share, target = service_stack(args, work)
    module, inputs = build(model)
    with stack_of as stack:
        job, final, wall = run_job(Client(stack.redis_url), args.service_timeout, cancel_on_timeout=True,
                                   model=module, example_inputs=inputs, name=model, target=target, share=share,
                                   trials=args.trials, trials_per_iter=args.per_iter, seed=args.seed)
        t0 = time.time() - wall
        r = store.connect(stack.redis_url)
        # a stack's clients split the host's physical cores for their searches (Stack.start_tuner)
        threads = int(os.environ.get("SHARETUNE_SEARCH_THREADS") or max(1, physical_cores() // args.tuners))
        row = {"state": final.get("state"), "wall_s": round(wall, 1),
               **job_events(r, job.job_id, t0, wall, threads)}
        if final.get("state") == "done":
            res = job.result()
            row.update(tuned_module=res.tuned_module_path, untuned_module=res.untuned_module_path,
                       database_dir=res.database_dir, split_s=res.time_split_s, timing_spread=res.timing_spread)
        row["exported_trials"] = export_job_records(stack.redis_url, job.job_id, work / "records_db")
    return row


def prepare_warm_store(args, work: Path) -> dict:
    """A store that has tuned the zoo models (each --warm-trials), made once per work dir."""
    from sharetune.client import Client

    done = work / "DONE.json"
    if done.exists():
        return json.loads(done.read_text())
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    stack_of, share, target = service_stack(args, work)
    out = {"models": {}}
    t_all = time.time()
    with stack_of as stack:
        client = Client(stack.redis_url)
        for m in args.warm_from.split(","):
            t0 = time.time()
            job = client.submit(m, target=target, share=share, trials=args.warm_trials,
                                trials_per_iter=args.per_iter, seed=args.seed, untuned_baseline=False)
            final = job.wait(timeout_s=args.service_timeout, on_progress=None)
            out["models"][m] = {"state": final.get("state"), "trials": args.warm_trials,
                                "wall_s": round(time.time() - t0, 1)}
    out["wall_s"] = round(time.time() - t_all, 1)
    out["lease"] = args.lease
    done.write_text(json.dumps(out))
    # kept so that a later lease unpacks it into its work dir (a first line of a bench/plans file) instead of tuning the
    # zoo again: ~4 minutes of device time
    subprocess.run(["tar", "czf", str(out_dir() / "zoo_store.tgz"), "-C", str(work), "redis", "DONE.json"],
                   check=False)
    return out


def fits(deadline: float | None, need_s: float) -> bool:
    return deadline is None or time.time() + need_s <= deadline


def run_model(args, model: str, row: dict, work: Path, warm_store, save, deadline) -> None:
    """`warm_store()`: the zoo-tuned store's work dir (None when there is no time or no warm run)."""
    mwork = work / model
    if (row.get("stock") or {}).get("error"):
        row.pop("stock")  # a failed step is run again
    for phase in ("cold", "warm"):
        if (row.get(phase) or {}).get("state") not in (None, "done"):
            row.pop(phase)
        elif phase in row and "served" not in row and kept_run(model, phase, mwork / phase, row) is None:
            row.pop(phase)  # its module went with an earlier lease and nothing kept can make it: run again
    ran = False  # a step run now: the modules are served again
    if "stock" not in row and "stock" in args.phases:
        ran = True
        need = STOCK_STARTUP_S + 60 * args.trials / STOCK_TRIALS_PER_MIN
        if not fits(deadline, need):
            row.setdefault("skipped", {})["stock"] = f"needs ~{need:.0f} s, not left before the deadline"
            return
        row["stock"] = run_stock(args, model, mwork / "stock")
        keep = out_dir() / f"stock-{model}"  # a model's stock run is made once and kept
        shutil.rmtree(keep, ignore_errors=True)
        keep.mkdir(parents=True)
        for name in ("database_workload.json", "database_tuning_record.json", "tasks.json"):
            if (mwork / "stock" / name).exists():
                shutil.copy(mwork / "stock" / name, keep / name)
        row["stock_lease"] = args.lease
        save()
    for phase in ("cold", "warm"):
        if phase in row or phase not in args.phases:
            continue
        source = warm_store() if phase == "warm" else None
        if not fits(deadline, SERVICE_STEP_S) or (phase == "warm" and source is None):
            row.setdefault("skipped", {})[phase] = "not enough time left before the deadline"
            break
        ran = True
        row[phase] = run_service(args, model, mwork / phase, source)
        row[phase]["lease"] = args.lease
        row[phase]["settings"] = settings_in_effect(dict(os.environ))
        keep_run(model, phase, mwork / phase, row[phase])
        save()
    if ("served" not in row or ran) and ("cold" in row or "warm" in row) and fits(deadline, SERVE_S):
        serve_model(args, model, row, mwork)
        save()
    # a skip stays on record only while its step is still missing (a later lease may have run it)
    if skipped := {k: why for k, why in row.pop("skipped", {}).items() if k not in row}:
        row["skipped"] = skipped
    summarise_model(row)
    save()


def stock_db(model: str, mwork: Path) -> Path | None:
    for d in (mwork / "stock", out_dir() / f"stock-{model}", kept_in_repo("time_to_quality_stock") / model):
        if (d / "database_tuning_record.json").exists():
            return d
    return None


def keep_run(model: str, phase: str, work: Path, res: dict) -> None:
    """A service run's exported database (what its tuned module was compiled with) and its job's records, kept
    under $OUT as `kept_as` (then in bench/results/time_to_quality_dbs.tar.xz): a later lease can serve it again."""
    res["kept_as"] = f"{phase}-{model}-{time.strftime('%Y-%m-%d-%H%M%S', time.gmtime())}"
    keep = out_dir() / res["kept_as"]
    if res.get("database_dir") and Path(res["database_dir"]).is_dir():
        shutil.copytree(res["database_dir"], keep / "database")
    if (work / "records_db").is_dir():
        shutil.copytree(work / "records_db", keep / "records_db")


def kept_run(model: str, phase: str, work: Path, row: dict | None = None) -> Path | None:
    """Where a service run's databases are: this lease's work dir, $OUT, or the results kept in the repo (under
    the name the row's run says it was kept as, else <phase>-<model>)."""
    if (work / "records_db").is_dir() and any(work.glob("jobs/*/tuned.so")):
        return work
    kept_as = ((row or {}).get(phase) or {}).get("kept_as", f"{phase}-{model}")
    for d in (out_dir() / kept_as, kept_in_repo("time_to_quality_runs") / kept_as):
        if (d / "database" / "database_tuning_record.json").exists():
            return d
    return None


def serve_model(args, model: str, row: dict, mwork: Path) -> None:
    mods, compiled, kept = {}, mwork / "served", lambda phase: kept_run(model, phase, mwork / phase, row)
    compiled.mkdir(parents=True, exist_ok=True)
    db, todo = stock_db(model, mwork), {}  # module -> (its database, None: untuned; its first trials, 0: all)
    if db is not None:
        todo["stock"] = (db, 0)
    for phase in ("cold", "warm"):
        res = row.get(phase) or {}
        if res.get("tuned_module") and Path(res["tuned_module"]).exists():
            mods[phase] = res["tuned_module"]
        elif res and (folder := kept(phase)) is not None:  # made in an earlier lease
            todo[phase] = (folder / "database", 0)
    cold = row.get("cold") or {}
    if cold.get("untuned_module") and Path(cold["untuned_module"]).exists():
        mods["untuned"] = cold["untuned_module"]
    elif cold:
        todo["untuned"] = (None, 0)
    todo.update(trial_cuts(row, kept))  # each compiled in a child of its own, all at once, beside the kernels' builds
    cores = ",".join(map(str, sorted(os.sched_getaffinity(0))))
    compiling = {k: spawn_compile(d, first, compiled / f"{k}.so", cores, None, model, args.rehearse)
                 for k, (d, first) in todo.items()}
    # and each task's kernel of stock and of each run, from its best records: which task a module's time moves with
    dbs = run_databases(row, db, kept)
    folders, kernel_errors, workloads = kernel_sets(dbs, str(make_target(args.rehearse)), compiled)
    # and the kernels each run's curve stepped through: its curve timed again in that same process (latency_curve)
    steps_at, step_errors, steps = step_kernels(row, db, kept, str(make_target(args.rehearse)), compiled)
    built = {k: compiled / f"{k}.so" for k, p in compiling.items() if p.wait(timeout=900) == 0}
    mods.update({k: str(path) for k, path in built.items() if path.exists()})
    failed = [k for k in todo if k not in mods]
    # every module timed in one fresh process, interleaved, unshared, and checked against PyTorch
    row["served"] = serve(mods, model, mwork, args.serve_rounds, gpu=not args.rehearse, check=True, timeout_s=600,
                          kernels={**folders, **{f"{k}-steps": v for k, v in steps_at.items()}})
    row["served"].pop("rounds_us", None)
    row["retimed"] = retimed_runs(row["served"], steps_at, steps)
    row["served"]["kernel_us"] = kernel_names(row["served"].get("kernel_us") or {}, workloads, json.loads(
        (db / "tasks.json").read_text()) if db is not None and (db / "tasks.json").exists() else [])
    row["served"]["kernel_errors"] = {**kernel_errors, **step_errors, **(row["served"].get("kernel_errors") or {})}
    if failed:
        row["served"].setdefault("errors", {}).update({k: "did not compile" for k in failed})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    tuning_options(ap, ",".join(PANEL), 384, 30, "/tmp/ttq/work")
    ap.add_argument("--warm-from", default="resnet18,transformer,mobilenetv2", help="zoo models the warm store tuned first")
    ap.add_argument("--warm-trials", type=int, default=384)
    ap.add_argument("--phases", default=",".join(PHASES), help="the steps to run now (stock,cold,warm)")
    ap.add_argument("--resume", action="store_true", help="keep the steps the JSON already holds")
    ap.add_argument("--again", default="", help="kept steps to run again (cold,warm): the kept ones, their served "
                    "timings and summary go to the model's `earlier`")
    ap.add_argument("--serve-again", action="store_true", help="serve the rows whose runs are kept again")
    ap.add_argument("--deadline-s", type=float, default=None, help="start no step that cannot end before this")
    ap.add_argument("--lease", default=time.strftime("%Y-%m-%d %H:%M"), help="names the lease a step ran in")
    ap.add_argument("--stock-timeout", type=float, default=3600)
    ap.add_argument("--service-timeout", type=float, default=1800)
    ap.add_argument("--table", metavar="JSON", help="derive a results file's summaries again, print its table (markdown), draw its PNG")
    args = ap.parse_args(argv)
    if args.table:  # the figures are derived again from the recorded events
        print(table_again(Path(args.table)))
        return 0
    args.phases = set(args.phases.split(","))
    deadline = time.time() + args.deadline_s if args.deadline_s else None
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    path = out_dir() / ("time_to_quality_rehearsal.json" if args.rehearse else "time_to_quality_h200.json")
    result = json.loads(path.read_text()) if args.resume and path.exists() else {}
    result.setdefault("models", {})
    result.update(protocol={
        "trials": args.trials, "per_iter": args.per_iter, "tuners": args.tuners, "seed": args.seed,
        "lanes": "1x100 %" if not args.rehearse else "one CPU core", "builders": "every core of the host",
        "stock": "tune_tasks, LocalBuilder(every core, timeout 120 s), LocalRunner, JSONDatabase; run to its budget",
        "warm_store": f"{args.warm_from} tuned first, {args.warm_trials} trials each",
        "estimate": "sum over tasks of weight x best so far; a task without a record at its default schedule "
                    "(timed by the service on its lane)",
        "served": "each tuned module timed in one fresh process, interleaved, the GPU unshared, median of rounds"},
        rehearsal=args.rehearse, phase="running")

    def save():
        result["summary"] = summarise(result)
        path.write_text(json.dumps(result, indent=1))

    def warm_store() -> Path | None:
        """Made when a warm step first needs it (stock and the cold run go first: they are kept if it fails)."""
        if not fits(deadline, WARM_STORE_S + SERVICE_STEP_S):
            return None
        result["warm_store"] = prepare_warm_store(args, work / "zoo")
        save()
        return work / "zoo"

    for model in args.models.split(","):
        row = result["models"].setdefault(model, {})
        if args.again and row and not fits(deadline, SERVICE_STEP_S + SERVE_S):
            print(json.dumps({model: "kept as it was: no time left to run it again"}), flush=True)
            continue
        if old := {k: row.pop(k) for k in args.again.split(",") if k in ("cold", "warm") and k in row}:
            old.update({k: row.pop(k) for k in ("served", "summary", "retimed") if k in row})
            [row.pop(k, None) for k in ("curves", "curves_retimed")]
            row.setdefault("earlier", []).append(old)
        if args.serve_again and all(kept_run(model, p, work / model / p, row) for p in ("cold", "warm") if p in row):
            row.pop("served", None)
        run_model(args, model, row, work, warm_store, save, deadline)
        print(json.dumps({model: row.get("summary")}), flush=True)
    result["phase"] = "done"
    save()
    plot(result, path.with_suffix(".png"))
    print(markdown_table(result))
    print(json.dumps(result["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

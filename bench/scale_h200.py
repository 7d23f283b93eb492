"""Throughput at the scale users tune, side by side with stock MetaSchedule in the same run (2-GPU host).

A whole zoo model (every task), 64 candidates a round. Stock `tune_tasks` (LocalBuilder on its 16 cores +
LocalRunner) runs on GPU 1 and cores 16-31 for a fixed window, then stops; its trials/min and its tuned
latency at the trials it reached are what it is judged by. This service runs beside it on GPU 0 and cores
0-15, one configuration after another, each in a fresh stack:

    1gpu-1x100     one 100 % lane, 16 builders and 4 tuner clients on cores 0-15
    1gpu-4x25      four 25 % lanes, the same cores
    1gpu-4x25-b32  four 25 % lanes, builders on all 32 cores (a build host's CPUs added)
    2gpu-4x25-b32  four 25 % lanes on each GPU, builders on all 32 cores

Tuned latency at equal trials: the service's first N records (N = stock's trials) are applied to the model
through a JSON database exactly as stock's are (compile_relax), and both are timed in one fresh process at
the configuration's share, interleaved. Every row is written to the JSON as soon as it is measured.

    python bench/scale_h200.py --part A       # stock's window beside the 16-core configurations
    python bench/scale_h200.py --part B       # the 32-core and two-GPU configurations
    python bench/scale_h200.py --merge A.json B.json --out bench/results/scale_h200.json
    python bench/scale_h200.py --rehearse     # the same code on CPU lanes (llvm), small, for this host
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

CONFIGS = {  # name -> (lanes per GPU "NxPCT", GPUs, builders, builder cores, tuner-side cores)
    "1gpu-1x100": ("1x100", 1, 16, "0-15", "0-15"),
    "1gpu-4x25": ("4x25", 1, 16, "0-15", "0-15"),
    "1gpu-4x25-b32": ("4x25", 1, 28, "0-31", "0-15"),
    "2gpu-4x25-b32": ("4x25", 2, 28, "0-31", "0-15"),
}
REHEARSAL = {"cpu-1lane": ("measure.cpu.c0", 1, 1, "1", "0-1")}


def out_dir() -> Path:
    d = Path(os.environ.get("OUT", "/tmp/out"))
    d.mkdir(parents=True, exist_ok=True)
    return d


class BusySampler:
    """GPU busy fraction over a window (NVML utilisation, through the project's observer)."""

    def __init__(self, uuid: str | None):
        self.uuid, self.obs = uuid, None
        if uuid:
            from services.measurer.observers import make_observer

            self.obs = make_observer()
            self.obs.start_window(uuid, interval_ms=250)

    def stop(self) -> float | None:
        if self.obs is None:
            return None
        stats = self.obs.stop_window()
        self.obs.close()
        return None if stats.busy_fraction is None else round(stats.busy_fraction, 4)


def cores_of(spec: str) -> set[int]:
    from services.measurer.lanes import parse_cores

    have = os.sched_getaffinity(0) | set(range(os.cpu_count() or 1))
    return {c for c in parse_cores(spec) if c in have} or have


# ---- stock ---------------------------------------------------------------------------------------------


def stock_tune(args) -> int:
    """In its own process (the parent ends it when the window closes): stock tune_tasks on every task."""
    from tvm.s_tir import meta_schedule as ms

    from services.tuner.metaschedule.extract import fuse
    from sharetune.intake import to_relax

    target = make_target(args.rehearse)
    mod = to_relax(args.model).mod
    extracted = ms.relax_integration.extract_tasks(fuse(mod), target)
    work = str(args.stock_work)
    contexts, weights = ms.relax_integration.extracted_tasks_to_tune_contexts(extracted, work, seed=0)
    workers = len(os.sched_getaffinity(0))
    ms.tune_tasks(tasks=contexts, task_weights=weights, work_dir=work, max_trials_global=args.stock_max_trials,
                  num_trials_per_iter=args.per_iter,
                  builder=ms.builder.LocalBuilder(max_workers=workers, timeout_sec=120),
                  runner=ms.runner.LocalRunner(timeout_sec=60), database=ms.database.JSONDatabase(work_dir=work))
    return 0


def make_target(rehearse: bool):
    import tvm

    if rehearse:
        from services.measurer.metaschedule.evaluate import cpu_target

        return cpu_target(1)
    from services.measurer.metaschedule.evaluate import gpu_target

    return gpu_target()


def stock_records(work: Path) -> list[str]:
    path = work / "database_tuning_record.json"
    return path.read_text().splitlines() if path.exists() else []


def stock_trials_from_log(log_text: str) -> int:
    """Candidates stock sent to its runner (timed right away by LocalRunner). Its task scheduler commits a
    task's records to the database only when it comes back to that task, so over a short window on a model
    with many tasks the database holds none of them: its own log is what counts."""
    import re

    return sum(int(m) for m in re.findall(r"Sending (\d+) valid sample\(s\) to runner", log_text))


# ---- compiling a model from N records, serving at a share ---------------------------------------------


def compile_from_records(args) -> int:
    """In its own process: compile the model with a JSON database cut to its first N records."""
    from tvm.s_tir import meta_schedule as ms

    from sharetune.intake import to_relax

    db_dir = Path(args.db)
    cut = Path(args.cut_dir)
    cut.mkdir(parents=True, exist_ok=True)
    (cut / "database_workload.json").write_text((db_dir / "database_workload.json").read_text())
    lines = (db_dir / "database_tuning_record.json").read_text().splitlines()
    valid = db_dir / "trial_valid.json"  # ours: N trials hold this many valid records; stock's file holds all
    lines = lines[: sum(json.loads(valid.read_text())[: args.first]) if valid.exists() else args.first]
    (cut / "database_tuning_record.json").write_text("\n".join(lines) + ("\n" if lines else ""))
    db = ms.database.JSONDatabase(work_dir=str(cut), module_equality="structural")
    target = make_target(args.rehearse)
    ex = ms.relax_integration.compile_relax(db, to_relax(args.model).mod, target, params=None)
    ex.export_library(args.out_module)
    print(json.dumps({"module": args.out_module, "records": len(lines)}), flush=True)
    return 0


def export_job_records(redis_url: str, job_id: str, out: Path) -> int:
    """The job's records in the order they were measured, as a stock JSON database of the valid ones,
    with trial_valid.json saying which trials were valid (so a cut at N trials counts failures too, as
    stock's trial count does); returns the trials."""
    from tvm.s_tir import meta_schedule as ms

    from shared import store
    from services.tuner.metaschedule.codec import load_ir
    from services.tuner.metaschedule.records import tvm_record

    r = store.connect(redis_url)
    out.mkdir(parents=True, exist_ok=True)
    for name in ("database_workload.json", "database_tuning_record.json"):
        (out / name).unlink(missing_ok=True)
    db = ms.database.JSONDatabase(work_dir=str(out), module_equality="structural")
    recs = []
    for task in store.job_tasks(r, job_id):
        wl = db.commit_workload(load_ir(store.workload(r, task.wkey).mod))
        recs += [(rec, wl) for rec in store.records(r, task.wkey) if rec.job_id == job_id]
    recs.sort(key=lambda x: x[0].measured_at)
    valid = [bool(rec.run_secs) and not rec.error for rec, _ in recs]
    for (rec, wl), ok in zip(recs, valid):
        if ok:
            db.commit_tuning_record(tvm_record(rec, wl))
    (out / "trial_valid.json").write_text(json.dumps(valid))
    return len(recs)


def spawn_compile(args, db: Path, first: int, module: Path, cores: str, gpu_uuid: str | None) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", TVM_NUM_THREADS="1")
    if gpu_uuid:
        env["CUDA_VISIBLE_DEVICES"] = gpu_uuid
    cmd = ["taskset", "-c", cores, sys.executable, __file__, "--compile-from", str(db), "--first", str(first),
           "--cut-dir", str(module) + ".db", "--out-module", str(module), "--model", args.model]
    if args.rehearse:
        cmd.append("--rehearse")
    log = open(str(module) + ".log", "w")
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)


def serve(modules: dict[str, str], model: str, share: int, gpu_uuid: str | None, mps_env: dict, rounds: int,
          work: Path) -> dict:
    """Time the modules in one fresh process at `share` % of the GPU (or one core when rehearsing)."""
    import numpy as np

    from sharetune.zoo import get

    _, example = get(model).build()
    inputs = work / f"inputs-{model}.npz"
    np.savez(inputs, **{f"arg{i}": t.detach().numpy() for i, t in enumerate(example)})
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", TVM_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "sharetune.evaluate", "--inputs", str(inputs), "--rounds", str(rounds)]
    if gpu_uuid:
        env.update(mps_env, CUDA_VISIBLE_DEVICES=gpu_uuid, CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=str(share))
        cmd += ["--device", "gpu"]
    else:
        cmd += ["--device", "cpu", "--cores", "0"]
    for label, path in modules.items():
        cmd += ["--module", f"{label}={path}"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    try:
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return {"latency_us": {}, "errors": {"serve": (out.stderr or out.stdout)[-800:]}}


# ---- this service ---------------------------------------------------------------------------------------


def run_config(args, name: str, spec: tuple, gpus: list, work: Path) -> dict:
    from shared import store
    from sharetune.client import Client
    from sharetune.stack import Stack

    lanes_spec, n_gpus, builders, builder_cores, tuner_cores = spec
    os.sched_setaffinity(0, cores_of(tuner_cores))  # the stack's processes inherit it (builders: their own)
    if args.rehearse:
        lanes, share, uuids = [lanes_spec], 50, []
    else:
        count, pct = (int(x) for x in lanes_spec.split("x"))
        uuids = [g.uuid for g in gpus[:n_gpus]]
        lanes = [f"measure.{u.lower().removeprefix('gpu-')[:8]}.p{pct}" for u in uuids for _ in range(count)]
        share = pct
    os.environ["SHARETUNE_SEARCH_THREADS"] = str(max(1, len(cores_of(tuner_cores)) // args.tuners))
    row = {"config": name, "gpus": n_gpus, "lanes": len(lanes), "share": share, "builders": builders,
           "builder_cores": builder_cores, "tuners": args.tuners, "per_iter": args.per_iter, "model": args.model}
    t_up = time.time()
    with Stack(work / name, lanes=lanes, tuners=args.tuners, builders=builders, builder_cores=builder_cores,
               log_level="INFO") as stack:
        row["stack_startup_s"] = round(time.time() - t_up, 1)
        client = Client(stack.redis_url)
        samplers = [BusySampler(u) for u in uuids] or [BusySampler(None)]
        t0 = time.time()
        job = client.submit(args.model, target="cuda" if not args.rehearse else "llvm", share=share,
                            trials=args.trials, trials_per_iter=args.per_iter, seed=0)
        try:
            final = job.wait(timeout_s=args.config_timeout, on_progress=None)
        except TimeoutError:
            job.cancel()
            final = {"state": "timeout"}
        wall = time.time() - t0
        busy = [s.stop() for s in samplers]
        r = store.connect(stack.redis_url)
        status = job.status()
        row.update(state=final.get("state"), wall_s=round(wall, 1), trials=status["trials"],
                   trials_per_min=round(60 * status["trials"] / wall, 1),
                   gpu_busy_frac=round(statistics.mean(b for b in busy if b is not None), 4) if any(
                       b is not None for b in busy) else None,
                   gpu_busy_per_gpu=busy, task_trials={t["task"]: t["trials"] for t in status["tasks"]})
        batches = store.lane_batches(r, job.job_id)
        row.update(lane_clock(batches, t0, t0 + wall))
        if batches:  # from the first candidate measured to the last: the rate once planning is done
            active = max(b.finished_at for b in batches) - min(b.started_at for b in batches)
            row["active_s"] = round(active, 1)
            row["steady_trials_per_min"] = round(60 * status["trials"] / max(active, 1e-9), 1)
        built = [b for b in store.live_builders(r)]
        n_built = sum(b.built + b.failed for b in built)
        row["build_cpu_s_per_candidate"] = round(sum(b.build_s for b in built) / n_built, 3) if n_built else None
        if final.get("state") == "done":
            res = job.result()
            row["tuned_module"] = res.tuned_module_path
            row["split_s"] = res.time_split_s
        row["exported_trials"] = export_job_records(stack.redis_url, job.job_id, work / name / "records_db")
    return row


def lane_clock(batches, start: float, end: float) -> dict:
    """Each lane's own busy clock over the job, as the job result reports it."""
    from shared.messages import lane_utilisation

    stats = lane_utilisation(batches, start, end)
    return {"lane_busy_frac": stats.get("mean_busy_frac"),
            "lane_busy_per_lane": {k: v["busy_frac"] for k, v in stats.get("per_lane", {}).items()}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--part", choices=["A", "B"], default="A")
    ap.add_argument("--configs", default=None, help="comma-separated names (default: the part's)")
    ap.add_argument("--model", default="resnet18")
    ap.add_argument("--trials", type=int, default=1024)
    ap.add_argument("--per-iter", type=int, default=64)
    ap.add_argument("--tuners", type=int, default=4)
    ap.add_argument("--stock-window", type=float, default=360.0)
    ap.add_argument("--stock-max-trials", type=int, default=100000)
    ap.add_argument("--config-timeout", type=float, default=330.0)
    ap.add_argument("--serve-rounds", type=int, default=15)
    ap.add_argument("--work-dir", default="/tmp/scale_bench")
    ap.add_argument("--rehearse", action="store_true", help="CPU lanes and llvm: the code path, on this host")
    ap.add_argument("--merge", nargs="*")
    ap.add_argument("--out", default=None)
    ap.add_argument("--stock-log", default=None, help="with --merge: stock's log, whose trials count")
    # internal: the subprocesses
    ap.add_argument("--stock-tune", action="store_true")
    ap.add_argument("--stock-work", default=None)
    ap.add_argument("--compile-from", default=None)
    ap.add_argument("--first", type=int, default=0)
    ap.add_argument("--cut-dir", default=None)
    ap.add_argument("--out-module", default=None)
    args = ap.parse_args(argv)
    if args.stock_tune:
        return stock_tune(args)
    if args.compile_from:
        args.db = args.compile_from
        return compile_from_records(args)
    if args.merge:
        return merge(args.merge, args.out or "bench/results/scale_h200.json", args.stock_log)
    return run_part(args)


def run_part(args) -> int:
    work = Path(args.work_dir) / f"part{args.part}"
    work.mkdir(parents=True, exist_ok=True)
    gpus = []
    if not args.rehearse:
        from services.measurer.observers import make_observer

        gpus = make_observer().inventory()
    if not args.rehearse:
        result_probe = probe_hidden_gpu_build()
        if not result_probe.get("cubin"):  # keep builders off the lanes' contexts, at least (they open none)
            os.environ["SHARETUNE_BUILDER_HIDE_GPUS"] = "0"
    table = REHEARSAL if args.rehearse else CONFIGS
    default = {"A": "1gpu-4x25,1gpu-1x100", "B": "1gpu-4x25-b32,2gpu-4x25-b32"}[args.part]
    names_ = (args.configs or (",".join(REHEARSAL) if args.rehearse else default)).split(",")
    result = {"model": args.model, "per_iter": args.per_iter, "trials_budget": args.trials, "part": args.part,
              "host_cores": os.cpu_count(), "gpus": [g.uuid for g in gpus], "rows": [], "stock": None,
              "builder_probe": None if args.rehearse else result_probe}
    out_json = out_dir() / f"scale_part{args.part}.json"

    def save():
        out_json.write_text(json.dumps(result, indent=1))

    stock = None
    if args.part == "A":
        stock = start_stock(args, gpus, work)
    for name in names_:
        if stock is not None and result["stock"] is None and time.time() - stock["t0"] >= args.stock_window:
            result["stock"] = stop_stock(stock, args)
            save()
        row = run_config(args, name, table[name], gpus, work)
        result["rows"].append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("lane_busy_per_lane", "task_trials")}), flush=True)
        save()
    if stock is not None and result["stock"] is None:
        remaining = args.stock_window - (time.time() - stock["t0"])
        if remaining > 0:
            time.sleep(remaining)
        result["stock"] = stop_stock(stock, args)
        save()
    if args.part == "A":
        finish_part_a(args, result, gpus, work)
        save()
    print_table(result)
    print("wrote", out_json)
    return 0


PROBE = """
import json, tvm, tvm.support.nvcc
from services.measurer.metaschedule import evaluate
t = evaluate.family_target("cuda.sm_90")
rt = evaluate.build(evaluate.trivial_kernel(t), t)
print(json.dumps({"cubin": all(m.is_runnable() for m in rt.imports if m.kind == "cuda")}))
"""


def probe_hidden_gpu_build() -> dict:
    """Can a process that sees no GPU (as builders run) compile CUDA to a cubin here?"""
    from services.measurer.lanes import builder_environment

    env = dict(os.environ, **builder_environment("cuda.sm_90"),
               PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    try:
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return {"cubin": False, "error": (out.stderr or out.stdout)[-600:]}


def start_stock(args, gpus, work: Path) -> dict:
    stock_work = work / "stock"
    stock_work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    cores = "1" if args.rehearse else "16-31"
    uuid = None
    if not args.rehearse:
        uuid = gpus[1].uuid if len(gpus) > 1 else gpus[0].uuid
        env["CUDA_VISIBLE_DEVICES"] = uuid
    cmd = ["taskset", "-c", cores, sys.executable, __file__, "--stock-tune", "--stock-work", str(stock_work),
           "--model", args.model, "--per-iter", str(args.per_iter), "--stock-max-trials", str(args.stock_max_trials)]
    if args.rehearse:
        cmd.append("--rehearse")
    log = open(work / "stock.log", "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return {"proc": proc, "t0": time.time(), "work": stock_work, "sampler": BusySampler(uuid), "uuid": uuid,
            "cores": cores}


def stop_stock(stock: dict, args) -> dict:
    wall = time.time() - stock["t0"]
    try:
        os.killpg(stock["proc"].pid, signal.SIGKILL)  # its builder pool too: one process group
    except ProcessLookupError:
        pass
    stock["proc"].wait(30)
    busy = stock["sampler"].stop()
    committed = len(stock_records(stock["work"]))
    log = stock["work"].parent / "stock.log"
    trials = max(committed, stock_trials_from_log(log.read_text()) if log.exists() else 0)
    return {"config": "stock", "gpus": 1, "lanes": 0, "builders": len(cores_of(stock["cores"])),
            "per_iter": args.per_iter, "window_s": round(wall, 1), "trials": trials, "committed_records": committed,
            "trials_per_min": round(60 * trials / wall, 1), "gpu_busy_frac": busy,
            "note": "LocalBuilder(max_workers=its cores, timeout_sec=120) + LocalRunner, stopped at the window"}


def finish_part_a(args, result: dict, gpus, work: Path) -> None:
    """Compile stock's model from its records and each configuration's from its first N (N = stock's
    trials), in parallel on the freed cores; time each configuration's pair at its share."""
    stock = result["stock"]
    if not stock or not stock.get("committed_records"):
        # nothing committed: no equal-trials latency (give stock a trial cap it reaches, --stock-max-trials)
        return
    uuid0 = gpus[0].uuid if gpus else None
    compiles = {"stock": spawn_compile(args, work / "stock", stock["committed_records"], work / "stock.so",
                                       "1" if args.rehearse else "16-23", uuid0)}
    for i, row in enumerate(result["rows"]):
        if row.get("exported_trials"):
            row["compared_at_trials"] = min(stock["committed_records"], row["exported_trials"])
            compiles[row["config"]] = spawn_compile(args, work / row["config"] / "records_db", row["compared_at_trials"],
                                                    work / f"{row['config']}.so",
                                                    "0" if args.rehearse else f"{24 + i * 4}-{27 + i * 4}", uuid0)
    for label, proc in compiles.items():
        proc.wait(timeout=420)
    ok = {label: str(work / f"{label}.so") for label in compiles if (work / f"{label}.so").exists()}
    stock["tuned_module_at_trials"] = ok.get("stock")
    mps = None
    if uuid0:  # serving below 100 % needs an MPS daemon; each stack stopped its own
        from services.measurer.gpu import MpsDaemon

        mps = MpsDaemon(work / "serve-mps" / "pipe", work / "serve-mps" / "log")
        mps.start()
    try:
        serve_rows(args, result, ok, uuid0, mps.environment() if mps else {}, work)
    finally:
        if mps is not None:
            mps.stop()


def serve_rows(args, result: dict, ok: dict, uuid0: str | None, mps_env: dict, work: Path) -> None:
    stock = result["stock"]
    for row in result["rows"]:
        label = row["config"]
        mods = {k: v for k, v in {"stock": ok.get("stock"), "ours_at_stock_trials": ok.get(label),
                                  "ours_full": row.get("tuned_module")}.items() if v}
        served = serve(mods, args.model, row["share"], uuid0, mps_env, args.serve_rounds, work)
        lat = served.get("latency_us", {})
        row["tuned_latency_us"] = round(lat["ours_full"], 2) if "ours_full" in lat else None
        row["tuned_latency_us_at_stock_trials"] = round(lat["ours_at_stock_trials"], 2) if "ours_at_stock_trials" in lat else None
        row["stock_latency_us_at_share"] = round(lat["stock"], 2) if "stock" in lat else None
        row["serve_errors"] = served.get("errors") or None
        if "stock" in lat and "ours_at_stock_trials" in lat:
            row["latency_vs_stock"] = round(lat["ours_at_stock_trials"] / lat["stock"], 3)
        if row["share"] == 100 and "stock" in lat:
            stock["tuned_latency_us"] = round(lat["stock"], 2)


def stock_steady_from_log(log_text: str) -> dict:
    """Stock's rate once started: from its first batch sent to the builder to its next task pick after the
    last batch it sent to the runner (that batch then timed)."""
    import datetime
    import re

    def at(line):
        return datetime.datetime.strptime(line[:19], "%Y-%m-%d %H:%M:%S").timestamp()

    lines = log_text.splitlines()
    first = next((at(l) for l in lines if re.search(r"sample\(s\) to builder", l)), None)
    runner = [i for i, l in enumerate(lines) if re.search(r"valid sample\(s\) to runner", l)]
    if first is None or not runner:
        return {}
    after = next((at(l) for l in lines[runner[-1] + 1:] if "TaskScheduler picks" in l), at(lines[runner[-1]]))
    trials = stock_trials_from_log(log_text)
    return {"active_s": round(after - first, 1), "steady_trials_per_min": round(60 * trials / max(after - first, 1e-9), 1)}


def merge(paths: list[str], out_path: str, stock_log: str | None = None) -> int:
    parts = [json.loads(Path(p).read_text()) for p in paths]
    rows = [r for p in parts for r in p["rows"]]
    stock = next((p["stock"] for p in parts if p.get("stock")), None)
    if stock and stock_log and Path(stock_log).exists():  # trials from stock's own log (see stock_trials_from_log)
        text = Path(stock_log).read_text()
        stock["trials"] = max(stock["trials"], stock_trials_from_log(text))
        stock["trials_per_min"] = round(60 * stock["trials"] / stock["window_s"], 1)
        stock.update(stock_steady_from_log(text))
    by = {r["config"]: r for r in rows}
    one = by.get("1gpu-4x25") or by.get("1gpu-1x100")
    summary = {}
    if stock and one:
        best16 = max((r for r in rows if r["config"].startswith("1gpu") and "b32" not in r["config"]),
                     key=lambda r: r["trials_per_min"])
        summary["throughput_vs_stock"] = round(best16["trials_per_min"] / max(stock["trials_per_min"], 1e-9), 2)
        summary["throughput_vs_stock_config"] = best16["config"]
        if stock.get("steady_trials_per_min") and best16.get("steady_trials_per_min"):
            summary["throughput_vs_stock_steady"] = round(best16["steady_trials_per_min"] / stock["steady_trials_per_min"], 2)
        summary["throughput_vs_stock_16_vs_32_cores"] = {
            r["config"]: round(r["trials_per_min"] / max(stock["trials_per_min"], 1e-9), 2) for r in rows if "b32" in r["config"]}
        summary["latency_vs_stock"] = {r["config"]: r.get("latency_vs_stock") for r in rows if r.get("latency_vs_stock")}
    summary["gpu_busy_frac"] = {r["config"]: r.get("gpu_busy_frac") for r in rows}
    summary["build_cpu_s_per_candidate"] = {r["config"]: r.get("build_cpu_s_per_candidate") for r in rows}
    two, one32 = by.get("2gpu-4x25-b32"), by.get("1gpu-4x25")
    if two and one32:
        summary["scaling_efficiency_2gpu"] = round(two["trials_per_min"] / (2 * one32["trials_per_min"]), 3)
    result = {k: v for k, v in parts[0].items() if k not in ("rows", "stock", "part")}
    result.update(rows=rows, stock=stock, summary=summary)
    Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    Path(out_path).write_text(json.dumps(result, indent=1))
    print_table(result)
    return 0


def print_table(result: dict) -> None:
    rows = ([result["stock"]] if result.get("stock") else []) + result["rows"]
    print(f"\nmodel {result.get('model')}, {result.get('per_iter')} a round")
    print(f"{'config':<16}{'gpus':>5}{'lanes':>6}{'bld':>5}{'trials':>8}{'tr/min':>8}{'gpu busy':>9}{'lane busy':>10}"
          f"{'build s/c':>10}{'tuned us':>10}{'vs stock@N':>11}")
    for r in rows:
        print(f"{r['config']:<16}{r.get('gpus', 1):>5}{r.get('lanes', 0):>6}{r.get('builders', 0):>5}{r.get('trials', 0):>8}"
              f"{r.get('trials_per_min', 0):>8}{_f(r.get('gpu_busy_frac')):>9}{_f(r.get('lane_busy_frac')):>10}"
              f"{_f(r.get('build_cpu_s_per_candidate')):>10}{_f(r.get('tuned_latency_us')):>10}{_f(r.get('latency_vs_stock')):>11}")
    if result.get("summary"):
        print("summary:", json.dumps(result["summary"]))


def _f(v) -> str:
    return "-" if v is None else f"{v:.3g}" if isinstance(v, float) else str(v)


if __name__ == "__main__":
    sys.exit(main())

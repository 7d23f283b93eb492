"""Stock MetaSchedule `tune_relax` against sharetune, same model, same trial budget, same 2 cores.

    python -m bench.cpu_tuning [--model small_cnn] [--trials 32] [--per-iter 16] [--out bench/results/cpu_tuning.json]

One run does, in order:

1. stock: a FRESH Python subprocess (`python -m bench.harness.stock relax ...`) runs
   `tvm.s_tir.meta_schedule.tune_relax` with LocalBuilder(max_workers=2, timeout_sec=120) and
   LocalRunner(), seed 0, under `ms.Profiler`, then compiles with `compile_relax` and exports the
   library. Nothing of sharetune's process-level set-up (e.g. the partial tensor-intrinsic import of
   services.tuner.metaschedule.intrinsics) is loaded there; the subprocess checks and reports that.
   Wall = the whole tune_relax call, including building the LocalBuilder/LocalRunner (their pool
   start-ups and sanity checks) and task extraction.
2. ours: a fresh local Stack (embedded Redis in a new directory, so no records or cost-model rows are
   reused; planner, tuner, updater, one single-core lane per core), then
   `Client.submit(model, share=50, trials=N, trials_per_iter=K, seed=0)`. Wall = submit -> result
   (planning, tuning and compiling the tuned + untuned library); the stack start-up (lanes warming)
   is reported separately as `ours_startup_s`.
3. latency: in this process, after both have finished, pinned to one core with TVM_NUM_THREADS=1:
   the stock tuned library, our tuned library, the untuned library (tvm.compile, no database) and
   PyTorch eager (torch.set_num_threads(1)); the TVM libraries take turns round by round (VM
   time_evaluator), and each is checked against PyTorch's output.

Processes outside the benchmark's own process tree (another user's tests on the same cores) are
sampled from /proc during every phase and reported in host.foreign_load.

Both sides tune for the same target, the lanes' target:
Target({"kind": "llvm", "num-cores": 1, "mcpu": <host cpu>}).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

from bench.harness.common import RESULTS, command_line, git_state, rounded, write_report
from bench.harness.samplers import ForeignLoad
from bench.harness.serving import pinned_latency
from bench.harness.stock import lane_target, target_dict, tune_relax

NOTES = [
    "stock LocalBuilder gets timeout_sec=120: its default 30 s fails every build on this machine, because "
    "each build() starts a fresh worker pool whose first build imports tvm.s_tir.tensor_intrin (~40-70 s "
    "on a 2-core host).",
    "stock: LocalBuilder(max_workers=2) builds on both cores; LocalRunner() times on one worker process "
    "(not pinned). ours: two single-core lanes (50 % share each), each builds and times its own candidates.",
    "both sides run with TVM_NUM_THREADS=1 (the target says num-cores 1; the lanes set it themselves).",
    "stock time split comes from ms.Profiler around tune_relax: build = SendToBuilder, run = SendToRunner + "
    "JoinRunnerFutures (LocalRunner times inside run(), so this is wall time of timing incl. its worker "
    "round trips), search = sum of EvoSearch/* scopes, cost_model = MeasureCallback/UpdateCostModel, "
    "other = wall - those (task extraction, TuneContext set-up incl. the tensor-intrinsic import, "
    "builder/runner pool start-ups, database writes). stock has no queue.",
    "ours time split is the tuner's own (JobResult.time_split_s): build and run are SUMMED over candidates "
    "across both lanes (they work in parallel, so build + run can exceed the wall share spent waiting); "
    "queue = summed send->lane-start per batch; search = tune_total - wait - serialize (the tuner process's "
    "own time: evolutionary search, feature extraction, cost-model predictions, callbacks).",
    "which tasks get tuned: with a budget below (tasks x per-iter), MetaSchedule's gradient task scheduler "
    "spends the whole budget in its first round-robin pass, so the tasks reached first are the only ones "
    "tuned. stock goes in extraction order; ours in the order the tuner reads the job's tasks from the store "
    "(sorted by name). latency_ratio then reflects which tasks were tuned as much as search quality; "
    "common_tasks compares the tasks both sides tuned.",
    "cost model: at a 32-trial budget both sides search with random scores: stock's XGBModel predicts only "
    "after 100 samples (num_warmup_samples), ours' updater publishes its first snapshot at 32 rows "
    "(UpdaterSettings.warmup_rows), i.e. after the last batch.",
    "ours wall includes compiling the tuned AND the untuned library (compile_s in the breakdown); stock wall "
    "does not include its compile (stock_compile_s). speedup_tune_only compares stock wall with ours wall "
    "minus that compile.",
]


def common_tasks(stock: dict, ours: dict) -> list[dict]:
    mine = {t["name"]: t for t in ours["tasks"]}
    out = []
    for t in stock.get("tasks", []):
        o = mine.get(t["name"])
        if o and t["best_us"] is not None and o["best_us"] is not None:
            out.append({"name": t["name"], "stock_trials": t["records"], "ours_trials": o["trials"],
                        "stock_best_us": t["best_us"], "ours_best_us": o["best_us"]})
    return out


# ---------------------------------------------------------------------------------------------------
# ours
# ---------------------------------------------------------------------------------------------------


def run_ours(args, work_dir: Path, relax_mod) -> dict:
    from shared.lanes import parse as parse_lane
    from sharetune.client import Client
    from services.measurer.agent import default_cpu_lanes
    from sharetune.stack.local import Stack
    from shared.settings import StackSettings

    lanes = default_cpu_lanes()
    share = parse_lane(lanes[0]).share
    stack = Stack(work_dir / "ours", lanes=lanes, settings=StackSettings())
    print(f"[ours] starting stack, lanes {lanes} ({share} % each), logs {work_dir / 'ours' / 'logs'}", flush=True)
    t0 = time.time()
    try:
        stack.start()
        startup_s = time.time() - t0
        client = Client(stack.redis_url)
        t1 = time.time()
        job = client.submit(relax_mod, target="llvm", share=share, trials=args.trials, name=args.model,
                            trials_per_iter=args.per_iter, seed=0)
        submit_s = time.time() - t1
        job.wait(timeout_s=args.timeout)
        res = job.result()
        wall_s = time.time() - t1
        status = job.status()
    finally:
        stack.stop()
    split = dict(res.time_split_s)
    print(f"[ours] start-up {startup_s:.1f} s, submit->result {wall_s:.1f} s, {res.trials} trials", flush=True)
    return {
        "wall_s": rounded(wall_s),
        "startup_s": rounded(startup_s),
        "submit_s": rounded(submit_s),
        "trials": res.trials,
        "errors": sum(t["errors"] for t in status["tasks"]),
        "reused_trials": sum(t["reused_trials"] for t in status["tasks"]),
        "tuner_wall_s": rounded(res.wall_s),
        "plan_and_queue_s": rounded(wall_s - res.wall_s),
        "time_split_s": split,
        "breakdown_s": {
            "search": rounded(split.get("search")),
            "build": rounded(split.get("build")),
            "queue": rounded(split.get("queue")),
            "run": rounded(split.get("run")),
            "serialize": rounded(split.get("serialize")),
            "wait": rounded(split.get("wait")),
            "compile": rounded(split.get("compile")),
        },
        "compile_s": rounded(split.get("compile")),
        "lanes": lanes,
        "share": share,
        "job_id": res.job_id,
        "tuned_module_path": res.tuned_module_path,
        "untuned_module_path": res.untuned_module_path,
        "target": json.loads(res.target),
        "tasks": [{"name": t.name, "weight": t.weight, "trials": t.trials, "best_us": rounded(t.best_us)}
                  for t in res.tasks],
    }


# ---------------------------------------------------------------------------------------------------
# latency, in this process, after tuning
# ---------------------------------------------------------------------------------------------------


def latencies(args, stock: dict, ours: dict) -> dict:
    libs = {"stock": stock["tuned_module_path"], "ours": ours["tuned_module_path"],
            "untuned": ours["untuned_module_path"]}
    return {"tvm_num_threads": os.environ.get("TVM_NUM_THREADS"), "number": args.number, "repeat": args.repeat,
            "method": "VM time_evaluator, libraries interleaved: median over repeat rounds of the mean of number runs",
            **pinned_latency(args.model, libs, args.number, args.repeat, torch_eager=True)}


# ---------------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------------


def table(rep: dict) -> str:
    cols = ["", "wall s", "trials", "trials/min", "search s", "build s", "queue s", "run s", "tuned lat us",
            "max abs err"]

    def row(name, side, lat):
        b = side["breakdown_s"]
        tpm = 60.0 * side["trials"] / side["wall_s"] if side["wall_s"] else None
        cells = [name, side["wall_s"], side["trials"], tpm, b.get("search"), b.get("build"), b.get("queue"),
                 b.get("run"), lat["median_us"], lat["max_abs_err"]]
        return [_fmt(c) for c in cells]

    rows = [cols, row("stock", rep["stock"], rep["latency"]["stock"]), row("ours", rep["ours"], rep["latency"]["ours"])]
    widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lat = rep["latency"]
    lines += [
        "",
        f"model {rep['model']}, target {json.dumps(rep['target'])}, budget {rep['trials']} trials, {rep['per_iter']} per iter",
        f"speedup (stock wall / ours wall) {rep['speedup']:.2f}x; tune-only (ours wall - compile) "
        f"{rep['speedup_tune_only']:.2f}x; latency ratio (ours / stock) {rep['latency_ratio']:.3f}",
        f"ours stack start-up {rep['ours_startup_s']} s (not in wall); ours compile (tuned + untuned, in wall) "
        f"{rep['ours']['compile_s']} s; stock compile (not in wall) {rep['stock']['compile_s']} s",
        f"stock other (extraction, contexts + tensor_intrin import, pool start-ups) {rep['stock']['breakdown_s']['other']} s, "
        f"cost model {rep['stock']['breakdown_s']['cost_model']} s",
        f"failed candidates: stock {rep['stock']['errors']} of {rep['stock']['trials']} (build errors/timeouts "
        f"{rep['stock']['build_errors']}), ours {rep['ours']['errors']} of {rep['ours']['trials']}",
        "CPU used by processes outside this benchmark (cores, mean): "
        + ", ".join(f"{p} {v['foreign_cores']}" for p, v in rep["host"]["foreign_load"].items() if p != "setup"),
        "stock per task (measured / valid, best us): " + "; ".join(
            f"{t['name']} {t['records']}/{t['valid']} {_fmt(t['best_us'])}" for t in rep["stock"].get("tasks", [])),
        "ours per task (trials, best us): " + "; ".join(
            f"{t['name']} {t['trials']} {_fmt(t['best_us'])}" for t in rep["ours"]["tasks"]),
        "tasks both tuned (best us, each side's own measurement): " + ("; ".join(
            f"{c['name']} stock {_fmt(c['stock_best_us'])} / ours {_fmt(c['ours_best_us'])}" for c in rep["common_tasks"])
            or "none"),
        f"untuned {lat['untuned']['median_us']} us (err {_fmt(lat['untuned']['max_abs_err'])}); "
        f"PyTorch eager 1 thread {lat['torch_eager_us']} us",
    ]
    return "\n".join(lines)


def _fmt(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, str):
        return x
    if isinstance(x, int):
        return str(x)
    if abs(x) != 0 and (abs(x) < 1e-3 or abs(x) >= 1e6):
        return f"{x:.2e}"
    return f"{x:.1f}" if abs(x) >= 10 else f"{x:.3f}" if abs(x) < 1 else f"{x:.2f}"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="small_cnn")
    ap.add_argument("--trials", type=int, default=32)
    ap.add_argument("--per-iter", type=int, default=16)
    ap.add_argument("--out", default=str(RESULTS / "cpu_tuning.json"))
    ap.add_argument("--work-dir", default=None, help="scratch directory (default: a new temp dir, removed unless --keep)")
    ap.add_argument("--keep", action="store_true", help="keep the scratch directory (libraries, logs, databases)")
    ap.add_argument("--timeout", type=float, default=3600.0, help="per side, seconds")
    ap.add_argument("--number", type=int, default=20, help="latency: runs per repeat")
    ap.add_argument("--repeat", type=int, default=30, help="latency: repeats (median reported)")
    args = ap.parse_args(argv)

    os.environ["TVM_NUM_THREADS"] = "1"  # before tvm starts its thread pool, here and in every child
    if os.environ.pop("REDIS_URL", None):
        print("REDIS_URL ignored: ours uses a fresh embedded Redis so no earlier records are reused", flush=True)
    scratch = Path(args.work_dir or tempfile.mkdtemp(prefix="cpu_tuning_")).resolve()
    scratch.mkdir(parents=True, exist_ok=True)
    keep_note = str(scratch) if (args.keep or args.work_dir) else None
    load_start = os.getloadavg()
    t_all = time.time()
    # on a failure the scratch directory stays, with its logs
    from sharetune.intake import to_relax

    code = git_state()
    foreign = ForeignLoad()
    relax_mod = to_relax(args.model).mod  # converted once here, so ours' submit->result excludes torch export
    target = target_dict(lane_target())
    foreign.set_phase("stock")
    stock = tune_relax(args, scratch)
    foreign.set_phase("ours")
    ours = run_ours(args, scratch, relax_mod)
    foreign.set_phase("latency")
    lat = latencies(args, stock, ours)
    load = foreign.report()
    rep = {
        "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "model": args.model,
        "target": target,
        "trials": args.trials,
        "per_iter": args.per_iter,
        "host": {"cpus": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version(),
                 "loadavg_start": load_start, "loadavg_end": os.getloadavg(),
                 "foreign_load": load},
        "stock_wall_s": stock["wall_s"],
        "ours_wall_s": ours["wall_s"],
        "ours_startup_s": ours["startup_s"],
        "stock_trials": stock["trials"],
        "ours_trials": ours["trials"],
        "stock_errors": stock["errors"],
        "ours_errors": ours["errors"],
        "stock_latency_us": lat["stock"]["median_us"],
        "ours_latency_us": lat["ours"]["median_us"],
        "untuned_latency_us": lat["untuned"]["median_us"],
        "torch_eager_latency_us": lat["torch_eager_us"],
        "stock_max_abs_err": lat["stock"]["max_abs_err"],
        "ours_max_abs_err": lat["ours"]["max_abs_err"],
        "speedup": rounded(stock["wall_s"] / ours["wall_s"]),
        "speedup_tune_only": rounded(stock["wall_s"] / (ours["wall_s"] - (ours["compile_s"] or 0.0))),
        "latency_ratio": rounded(lat["ours"]["median_us"] / lat["stock"]["median_us"], 4),
        "common_tasks": common_tasks(stock, ours),
        "stock_breakdown_s": stock["breakdown_s"],
        "ours_breakdown_s": ours["breakdown_s"],
        "stock_compile_s": stock["compile_s"],
        "stock": stock,
        "ours": ours,
        "latency": lat,
        "bench_total_s": rounded(time.time() - t_all),
        "command": command_line("bench.cpu_tuning", argv),
        "code": code,
        "notes": NOTES,
        "scratch_dir": keep_note,
    }
    write_report(rep, args.out, table)
    if keep_note is None:
        shutil.rmtree(scratch, ignore_errors=True)
    else:
        print(f"scratch kept in {scratch}")


if __name__ == "__main__":
    main()

"""Stock MetaSchedule `tune_relax` against sharetune, same model, same trial budget, same 2 cores.

    python bench/cpu_tuning.py [--model small_cnn] [--trials 32] [--per-iter 16] [--out bench/results/cpu_tuning.json]

One run does, in order:

1. stock: a FRESH Python subprocess (`bench/cpu_tuning.py --stock-only ...`) runs
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
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

STOCK_BUILDER_TIMEOUT_S = 120.0
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


# ---------------------------------------------------------------------------------------------------
# helpers shared by both modes
# ---------------------------------------------------------------------------------------------------


def git_state() -> dict:
    """The code that ran: HEAD and the tracked files that differed from it (the tree may be shared)."""
    def git(*a):
        try:
            return subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            return ""
    return {"head": git("rev-parse", "HEAD").strip(),
            "modified": [l[3:] for l in git("status", "--porcelain", "--untracked-files=no").splitlines()]}


def common_tasks(stock: dict, ours: dict) -> list[dict]:
    mine = {t["name"]: t for t in ours["tasks"]}
    out = []
    for t in stock.get("tasks", []):
        o = mine.get(t["name"])
        if o and t["best_us"] is not None and o["best_us"] is not None:
            out.append({"name": t["name"], "stock_trials": t["records"], "ours_trials": o["trials"],
                        "stock_best_us": t["best_us"], "ours_best_us": o["best_us"]})
    return out


def lane_target():
    import tvm

    return tvm.target.Target({"kind": "llvm", "num-cores": 1, "mcpu": tvm.target.codegen.llvm_get_system_cpu()})


def target_dict(target) -> dict:
    return json.loads(str(target))


def write_report(rep: dict, out, table) -> Path:
    """A benchmark's end: its JSON written, its table printed."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rep, indent=2) + "\n")
    print()
    print(table(rep))
    print(f"\nwrote {out}")
    return out


def _r(x, nd=3):
    return None if x is None else round(float(x), nd)


class ForeignLoad:
    """CPU seconds used, per phase, by processes OUTSIDE this benchmark's process tree (e.g. another
    user's test run on the same 2 cores), sampled from /proc every `interval_s`. Processes that start and
    end between two samples are missed, so this is a lower bound."""

    def __init__(self, interval_s: float = 2.0):
        import threading

        self.interval_s = interval_s
        self.tick = os.sysconf("SC_CLK_TCK")
        self.phase = "setup"
        self.cpu_s: dict[str, float] = {}
        self.wall_s: dict[str, float] = {}
        self._phase_t0 = time.time()
        self._stop = threading.Event()
        self._prev = self._snapshot()
        self._thread = threading.Thread(target=self._loop, name="foreign-load", daemon=True)
        self._thread.start()

    @staticmethod
    def _snapshot() -> dict[int, tuple[int, int]]:
        procs = {}
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            try:
                with open(f"/proc/{d}/stat") as f:
                    text = f.read()
            except OSError:
                continue
            fields = text[text.rindex(")") + 2:].split()
            procs[int(d)] = (int(fields[1]), int(fields[11]) + int(fields[12]))  # ppid, utime + stime
        return procs

    def _sample(self) -> None:
        now = self._snapshot()
        mine, frontier = {os.getpid()}, [os.getpid()]
        children: dict[int, list[int]] = {}
        for pid, (ppid, _) in now.items():
            children.setdefault(ppid, []).append(pid)
        while frontier:
            for c in children.get(frontier.pop(), []):
                if c not in mine:
                    mine.add(c)
                    frontier.append(c)
        ticks = sum(max(0, cpu - self._prev[pid][1]) for pid, (_, cpu) in now.items()
                    if pid not in mine and pid in self._prev)
        self.cpu_s[self.phase] = self.cpu_s.get(self.phase, 0.0) + ticks / self.tick
        self._prev = now

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def set_phase(self, name: str) -> None:
        self._sample()
        self.wall_s[self.phase] = self.wall_s.get(self.phase, 0.0) + time.time() - self._phase_t0
        self.phase, self._phase_t0 = name, time.time()

    def report(self) -> dict:
        self.set_phase("done")
        self._stop.set()
        return {p: {"foreign_cpu_s": _r(self.cpu_s.get(p, 0.0), 1), "wall_s": _r(w, 1),
                    "foreign_cores": _r(self.cpu_s.get(p, 0.0) / w, 2) if w else None}
                for p, w in self.wall_s.items()}


# ---------------------------------------------------------------------------------------------------
# stock: runs in its own fresh process
# ---------------------------------------------------------------------------------------------------


def stock_main(args) -> None:
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
        "wall_s": _r(wall_s),
        "profile_s": {k: _r(v, 4) for k, v in sorted(profile.items())},
        "breakdown_s": stock_breakdown(profile, wall_s),
        "import_s": _r(import_s),
        "convert_s": _r(convert_s),
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
    out["compile_s"] = _r(time.time() - t1)
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
                      "valid": len(ok), "best_us": _r(1e6 * min(ok)) if ok else None})
    out["records"] = len(records)
    out["valid_records"] = sum(1 for r in records if _mean_s(r) is not None)
    out["unmatched_records"] = len(records) - matched
    out["tasks"] = tasks
    out["process_s"] = _r(time.time() - t_proc)
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
        "search": _r(search),
        "build": _r(build),
        "queue": None,
        "run": _r(run),
        "cost_model": _r(cost_model),
        "other": _r(wall_s - search - build - run - cost_model),
        "profiler_total": _r(profile.get("Total")),
    }


def run_stock(args, work_dir: Path) -> dict:
    import importlib.util

    if importlib.util.find_spec("cloudpickle") is None:  # TVM's PopenPool (LocalBuilder/LocalRunner) needs it
        raise SystemExit("stock MetaSchedule's LocalBuilder/LocalRunner need cloudpickle: pip install cloudpickle")
    out_path = work_dir / "stock_result.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--stock-only", "--model", args.model,
           "--trials", str(args.trials), "--per-iter", str(args.per_iter), "--work-dir", str(work_dir / "stock"),
           "--stock-out", str(out_path), "--seed", str(getattr(args, "seed", 0))]
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["TVM_NUM_THREADS"] = "1"
    log_path = work_dir / "stock.log"
    print(f"[stock] fresh subprocess, log {log_path}", flush=True)
    t0 = time.time()
    with open(log_path, "wb") as log:
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout)
    if proc.returncode != 0 or not out_path.exists():
        tail = log_path.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"stock subprocess failed (rc {proc.returncode}); log tail:\n{tail}")
    res = json.loads(out_path.read_text())
    res["subprocess_s"] = _r(time.time() - t0)
    # MetaSchedule's task scheduler logs every batch; trials = candidates sent to the builder (as ours
    # counts every measured candidate, failed ones included)
    text = log_path.read_text(errors="replace")
    res["trials"] = sum(int(n) for n in re.findall(r"Sending (\d+) sample\(s\) to builder", text))
    res["build_errors"] = sum(int(n) for n in re.findall(r"Build errors: (\d+) sample", text))
    res["errors"] = res["trials"] - res.get("valid_records", 0)
    print(f"[stock] tune_relax {res['wall_s']} s, {res['trials']} trials, subprocess {res['subprocess_s']} s", flush=True)
    return res


# ---------------------------------------------------------------------------------------------------
# ours
# ---------------------------------------------------------------------------------------------------


def run_ours(args, work_dir: Path, relax_mod) -> dict:
    from shared.lanes import parse as parse_lane
    from sharetune.client import Client
    from services.measurer.agent import default_cpu_lanes
    from sharetune.stack import Stack

    lanes = default_cpu_lanes()
    share = parse_lane(lanes[0]).share
    stack = Stack(work_dir / "ours", lanes=lanes)
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
        "wall_s": _r(wall_s),
        "startup_s": _r(startup_s),
        "submit_s": _r(submit_s),
        "trials": res.trials,
        "errors": sum(t["errors"] for t in status["tasks"]),
        "reused_trials": sum(t["reused_trials"] for t in status["tasks"]),
        "tuner_wall_s": _r(res.wall_s),
        "plan_and_queue_s": _r(wall_s - res.wall_s),
        "time_split_s": split,
        "breakdown_s": {
            "search": _r(split.get("search")),
            "build": _r(split.get("build")),
            "queue": _r(split.get("queue")),
            "run": _r(split.get("run")),
            "serialize": _r(split.get("serialize")),
            "wait": _r(split.get("wait")),
            "compile": _r(split.get("compile")),
        },
        "compile_s": _r(split.get("compile")),
        "lanes": lanes,
        "share": share,
        "job_id": res.job_id,
        "tuned_module_path": res.tuned_module_path,
        "untuned_module_path": res.untuned_module_path,
        "target": json.loads(res.target),
        "tasks": [{"name": t.name, "weight": t.weight, "trials": t.trials, "best_us": _r(t.best_us)}
                  for t in res.tasks],
    }


# ---------------------------------------------------------------------------------------------------
# latency, in this process, after tuning
# ---------------------------------------------------------------------------------------------------


def load_vm(lib_path: str, inputs_np, ref, number: int) -> tuple:
    """(timer, args, max abs error against PyTorch) for an exported Relax library."""
    import numpy as np
    import tvm
    from tvm import relax

    dev = tvm.cpu(0)
    vm = relax.VirtualMachine(tvm.runtime.load_module(lib_path), dev)
    args = [tvm.runtime.tensor(a, dev) for a in inputs_np]
    out = vm["main"](*args)
    while not isinstance(out, tvm.runtime.Tensor):
        out = out[0]
    err = float(np.max(np.abs(out.numpy().astype("float64") - ref.astype("float64"))))
    return vm.time_evaluator("main", dev, number=number, repeat=1), args, err


def interleaved_latency(libs: dict[str, str], inputs_np, ref, number: int, repeat: int) -> dict:
    """Median over `repeat` rounds of the mean of `number` runs; the libraries take turns in every
    round, so a transient disturbance hits all of them alike."""
    loaded = {name: load_vm(path, inputs_np, ref, number) for name, path in libs.items()}
    timers = {name: loaded[name][0] for name in libs}
    for name, (_, args, _) in loaded.items():  # warm-up round
        timers[name](*args)
    samples: dict[str, list[float]] = {name: [] for name in libs}
    for _ in range(repeat):
        for name, (_, args, _) in loaded.items():
            samples[name].append(timers[name](*args).mean)
    return {name: {"median_us": _r(statistics.median(v) * 1e6), "mean_us": _r(statistics.mean(v) * 1e6),
                   "std_us": _r(statistics.pstdev(v) * 1e6), "max_abs_err": loaded[name][2]}
            for name, v in samples.items()}


def torch_eager_latency(module, inputs, number: int, repeat: int) -> float:
    import torch

    torch.set_num_threads(1)
    module.eval()
    with torch.no_grad():
        module(*inputs)
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            for _ in range(number):
                module(*inputs)
            times.append((time.perf_counter() - t0) / number)
    return _r(statistics.median(times) * 1e6)


def latencies(args, stock: dict, ours: dict) -> dict:
    from sharetune import zoo
    from sharetune.intake import reference_output

    core = min(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {core})
    module, inputs = zoo.get(args.model).build()
    if not isinstance(inputs, (tuple, list)):
        inputs = (inputs,)
    ref = reference_output(module, inputs)
    inputs_np = [x.detach().cpu().numpy() for x in inputs]
    n, r = args.number, args.repeat
    out = {
        "pinned_core": core,
        "tvm_num_threads": os.environ.get("TVM_NUM_THREADS"),
        "number": n,
        "repeat": r,
        "method": "VM time_evaluator, libraries interleaved: median over repeat rounds of the mean of number runs",
        **interleaved_latency({"stock": stock["tuned_module_path"], "ours": ours["tuned_module_path"],
                               "untuned": ours["untuned_module_path"]}, inputs_np, ref, n, r),
        "torch_eager_us": torch_eager_latency(module, inputs, n, r),
    }
    return out


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
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "cpu_tuning.json"))
    ap.add_argument("--work-dir", default=None, help="scratch directory (default: a new temp dir, removed unless --keep)")
    ap.add_argument("--keep", action="store_true", help="keep the scratch directory (libraries, logs, databases)")
    ap.add_argument("--timeout", type=float, default=3600.0, help="per side, seconds")
    ap.add_argument("--number", type=int, default=20, help="latency: runs per repeat")
    ap.add_argument("--repeat", type=int, default=30, help="latency: repeats (median reported)")
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)  # stock's seed (bench/search_quality.py)
    ap.add_argument("--stock-only", action="store_true", help=argparse.SUPPRESS)  # the fresh stock subprocess
    ap.add_argument("--stock-out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    os.environ["TVM_NUM_THREADS"] = "1"  # before tvm starts its thread pool, here and in every child
    if args.stock_only:
        stock_main(args)
        return

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
    stock = run_stock(args, scratch)
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
        "speedup": _r(stock["wall_s"] / ours["wall_s"]),
        "speedup_tune_only": _r(stock["wall_s"] / (ours["wall_s"] - (ours["compile_s"] or 0.0))),
        "latency_ratio": _r(lat["ours"]["median_us"] / lat["stock"]["median_us"], 4),
        "common_tasks": common_tasks(stock, ours),
        "stock_breakdown_s": stock["breakdown_s"],
        "ours_breakdown_s": ours["breakdown_s"],
        "stock_compile_s": stock["compile_s"],
        "stock": stock,
        "ours": ours,
        "latency": lat,
        "bench_total_s": _r(time.time() - t_all),
        "command": " ".join([Path(sys.executable).name, "bench/cpu_tuning.py"] + (argv if argv is not None else sys.argv[1:])),
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

"""What padded design spaces (services/tuner/metaschedule/padding.py) give the tasks with awkward extents, on
the GPU, without a tuning: per task, side by side in one process, interleaved,

    default   its default schedule (DLight), what the untuned model runs
    plain     --samples schedules drawn from the task's unpadded design spaces (a cold round's draws)
    padded    --samples drawn from its padded spaces

each kernel's output checked against the default kernel's on the same inputs.

    python -m sharetune.testing.padded_spaces --out $OUT/padded_spaces.json     # the tasks below, on the GPU
    ... --dry                                                                   # build only (no GPU): a rehearsal
    ... --search-cpu --samples 64 --out bench/results/padded_search_cpu.json    # the search's CPU a candidate, no GPU

Writes {"rows": [{model, task, weight, pads, us: {set: {best, median, n}}, max_abs_err: {set: worst}}],
"errors", "summary"}."""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

TASKS = ("wav2vec2-conv:conv1d1,wav2vec2-conv:conv1d2,wav2vec2-conv:conv1d,vit-s-encoder:fused_matmul4_add,"
         "vit-s-encoder:matmul2,vit-s-encoder:matmul1")
SETS = ("default", "plain", "padded")
_TO_BUILD: list = []  # (module, path): filled before the builders fork


def _build_one(i: int) -> str | None:
    from services.measurer.metaschedule.targets import family_target
    from sharetune.experiments.task_timing import _build

    mod, path = _TO_BUILD[i]
    try:
        _build(mod, family_target("cuda.sm_90"), path)
        return None
    except Exception as err:  # noqa: BLE001 -- one schedule lost must not lose the others
        return f"{type(err).__name__}: {str(err).strip()[-300:]}"


def _panel_tasks(tasks: list[str]):
    """(model, task name, task, target) of each `model:task`, extracted for an sm_90 CUDA target."""
    from bench.panel import relax
    from services.measurer.metaschedule.targets import family_target
    from services.tuner.metaschedule.extract import extract
    from services.tuner.metaschedule.intrinsics import load_tensor_intrinsics

    load_tensor_intrinsics("cuda")
    target = family_target("cuda.sm_90")
    extracted: dict[str, dict] = {}
    for spec in tasks:
        model, name = spec.split(":")
        if model not in extracted:
            extracted[model] = {t.name: t for t in extract(relax(model), target)}
        yield model, name, extracted[model][name], target


def draw(tasks: list[str], samples: int, work: Path) -> tuple[list[dict], dict[str, str]]:
    """Every set's schedules of every task, built under `work` (in parallel); the rows, without timings."""
    from tvm.s_tir import meta_schedule as ms

    from services.tuner.metaschedule.context import tune_context
    from services.tuner.metaschedule.defaults import default_module

    rows = []
    for model, name, task, target in _panel_tasks(tasks):
        ctx = tune_context(task.mod, target, name, cold=True, population=64, num_threads=1, rand_state=1,
                           pad_awkward="all")
        spaces = ctx.generate_design_space()
        pads = [[list(map(int, i.attrs[0])) for i in s.trace.insts if i.kind.name == "PadEinsum"] for s in spaces]
        row = {"model": model, "task": name, "weight": task.weight, "pads": sorted({json.dumps(p) for p in pads if p}),
               "files": {s: [] for s in SETS}}
        folder = work / f"{len(rows)}"
        folder.mkdir(parents=True, exist_ok=True)
        _TO_BUILD.append((default_module(task.mod, target), folder / "default.so"))
        row["files"]["default"].append(str(folder / "default.so"))
        for label, chosen in (("plain", [s for s, p in zip(spaces, pads) if not p]),
                              ("padded", [s for s, p in zip(spaces, pads) if p])):
            if not chosen:
                continue
            ctx.pre_tuning(1 << 20, samples, chosen, ms.database.MemoryDatabase(), ms.cost_model.RandomModel())
            for i, cand in enumerate(ctx.generate_measure_candidates() or []):
                path = folder / f"{label}{i}.so"
                _TO_BUILD.append((cand.sch.mod, path))
                row["files"][label].append(str(path))
            ctx.post_tuning()
        row["args_info"] = [a.as_json() for a in ms.arg_info.ArgInfo.from_entry_func(task.mod, remove_preproc=True)]
        rows.append(row)
        print(json.dumps({k: row[k] for k in ("model", "task", "pads")} | {s: len(row["files"][s]) for s in SETS}),
              flush=True)
    with ProcessPoolExecutor(max_workers=16, mp_context=get_context("fork")) as pool:
        results = list(pool.map(_build_one, range(len(_TO_BUILD))))
    errors = {str(path): err for (_, path), err in zip(_TO_BUILD, results) if err}
    return rows, errors


def time_rows(rows: list[dict], rounds: int, errors: dict[str, str]) -> None:
    """Every built kernel timed `rounds` times, interleaved, on the GPU; its output against the default's."""
    import numpy as np
    import tvm

    from sharetune.experiments.task_timing import _argument

    dev = tvm.cuda(0)
    timers = []
    for row in rows:
        reference = None
        row["max_abs_err"] = {}
        for label in SETS:
            for path in row["files"][label]:
                if not Path(path).exists():
                    continue
                try:
                    mod = tvm.runtime.load_module(path)
                    args = [_argument(info, dev) for info in row["args_info"]]
                    mod[mod.entry_name](*args)
                    out = args[-1].numpy()
                    if reference is None:
                        reference = out  # the default kernel comes first
                    err = float(np.max(np.abs(out - reference)))
                    row["max_abs_err"][label] = max(row["max_abs_err"].get(label, 0.0), err)
                    timer = mod.time_evaluator(mod.entry_name, dev, number=1, repeat=1, min_repeat_ms=20)
                    timers.append((row, label, timer, args, []))
                except Exception as err:  # noqa: BLE001
                    errors[path] = f"{type(err).__name__}: {str(err).strip()[-300:]}"
    for _ in range(rounds):
        for _row, _label, timer, args, times in timers:
            times.append(float(timer(*args).mean) * 1e6)
    for row in rows:
        per_set: dict[str, list[float]] = {s: [] for s in SETS}
        for r, label, _, _, times in timers:
            if r is row:
                per_set[label].append(statistics.median(times))
        row["us"] = {s: {"best": round(min(v), 3), "median": round(statistics.median(v), 3), "n": len(v)}
                     for s, v in per_set.items() if v}


def summarise(rows: list[dict]) -> dict:
    """Per task the best padded against the best plain and the default; the weighted sums where all three are."""
    full = [row for row in rows if all(s in row.get("us", {}) for s in SETS)]
    return {"tasks": len(rows), "timed_in_every_set": len(full),
            "weighted_best_us": {s: round(sum(row["weight"] * row["us"][s]["best"] for row in full), 2)
                                 for s in SETS},
            "padded_vs_plain_best": {f"{row['model']}:{row['task']}": round(row["us"]["padded"]["best"]
                                                                            / row["us"]["plain"]["best"], 3)
                                     for row in full}}


MODES = ("off", "matmul", "all")


def search_cpu(tasks: list[str], candidates: int, threads: int = 1) -> list[dict]:
    """What each padding mode costs the search (no GPU): per task and mode, the CPU seconds a candidate of a cold
    round (ValidReplay) and of an evolutionary round (ValidEvolution, from no measured parent, against an
    untrained XGBoost model: the replays and the limits' checks, not a trained model's features), and how many
    of them are padded."""
    from tvm.s_tir import meta_schedule as ms

    from services.tuner.metaschedule.context import tune_context
    from services.tuner.metaschedule.padding import is_padded

    rows = []
    for model, name, task, target in _panel_tasks(tasks):
        for mode in MODES:
            row = {"model": model, "task": name, "mode": mode}
            for kind, cold in (("cold", True), ("evolution", False)):
                ctx = tune_context(task.mod, target, name, cold=cold, population=2 * candidates, num_threads=threads,
                                   rand_state=1, pad_awkward=mode)
                spaces = ctx.generate_design_space()
                model_ = ms.cost_model.RandomModel() if cold else ms.cost_model.XGBModel(adaptive_training=False)
                ctx.pre_tuning(candidates, candidates, spaces, ms.database.MemoryDatabase(), model_)
                t = time.process_time()
                cands = ctx.generate_measure_candidates() or []
                cpu = time.process_time() - t
                padded = sum(is_padded(c.sch.trace) for c in cands)
                row[kind] = {"spaces": len(spaces), "candidates": len(cands), "padded": padded,
                             "cpu_s_per_candidate": round(cpu / max(1, len(cands)), 4)}
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def main(argv=None) -> int:
    from sharetune.experiments.task_timing import kernel_experiment_options

    ap = argparse.ArgumentParser(prog="python -m sharetune.testing.padded_spaces")
    ap.add_argument("--tasks", default=TASKS, help="model:task,...")
    kernel_experiment_options(ap, 32, "/tmp/padded_spaces")
    ap.add_argument("--search-cpu", action="store_true",
                    help="instead: the search's CPU a candidate in each padding mode (off, matmul, all), no GPU")
    args = ap.parse_args(argv)
    t0 = time.time()
    if args.search_cpu:
        result = {"command": "python -m sharetune.testing.padded_spaces " + " ".join(argv or sys.argv[1:]),
                  "what": search_cpu.__doc__.split(":", 1)[1].strip(), "threads": 1,
                  "rows": search_cpu(args.tasks.split(","), args.samples)}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
        return 0
    rows, errors = draw(args.tasks.split(","), args.samples, Path(args.work))
    result = {"command": "python -m sharetune.testing.padded_spaces " + " ".join(argv or sys.argv[1:]),
              "build_s": round(time.time() - t0, 1)}
    if not args.dry:
        time_rows(rows, args.rounds, errors)
        result["summary"] = summarise(rows)
    for row in rows:
        row.pop("args_info", None)
        row["files"] = {s: len(v) for s, v in row["files"].items()}
    result.update(rows=rows, errors=errors)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result.get("summary", {"rows": len(rows), "errors": len(errors)})), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What leaving the dead blocks out of a CUDA design space gives the batch norms (services/tuner/metaschedule/
dead_blocks.py), on the GPU, without a tuning: for every task of the models that has dead blocks, side by side in
one process, interleaved,

    default      its default schedule (DLight), what the untuned model runs
    stock        stock MetaSchedule's best record from its tuning of the model (three kernels or more)
    stock_one    the same record with its dead blocks inlined (one kernel)
    sampled      the best of --samples schedules drawn from the tuner's design space as it is now

    python -m sharetune.testing.dead_blocks --stock-dbs DIR --models efficientnet-mbconv,regnety-stage \
        --out $OUT/dead_blocks.json          # DIR/<model>/: a stock tuning's JSON database
    ... --dry                                 # build only (no GPU): a rehearsal

Writes {"rows": [{model, task, weight, kernels: {set: n}, us: {set: median µs}}], "summary"}."""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

SETS = ("default", "stock", "stock_one", "sampled")


def kernel_count(mod, target) -> int:
    """How many CUDA kernels the scheduled workload launches."""
    import tvm

    with target:
        lib = tvm.compile(mod, target=target)
    source = lib.mod.imports[0].inspect_source()  # a kernel is declared, then defined
    return len(set(re.findall(r"__global__ void (?:__launch_bounds__\(\d+\) )?(\w+)\(", source)))


def _stock_best(db_dir: Path, task):
    """Stock's best record of the task's workload, or None."""
    from tvm.s_tir import meta_schedule as ms

    db = ms.database.JSONDatabase(work_dir=str(db_dir), module_equality="structural")
    if not db.has_workload(task.mod):
        return None
    recs = db.get_top_k(db.commit_workload(task.mod), 1)
    return recs[0] if recs else None


def build_sets(models: list[str], stock_dbs: Path, out: Path, samples: int) -> list[dict]:
    """Each set's kernels (task_timing's kernels.json layout, one folder a set); the rows, without timings."""
    from tvm.s_tir import meta_schedule as ms
    from tvm.s_tir.schedule import Schedule

    from bench.panel import PANEL, build
    from services.measurer.metaschedule.targets import family_target
    from services.tuner.metaschedule.context import tune_context
    from services.tuner.metaschedule.dead_blocks import dead_blocks
    from services.tuner.metaschedule.defaults import default_module
    from services.tuner.metaschedule.extract import extract
    from services.tuner.metaschedule.intrinsics import load_tensor_intrinsics
    from sharetune.experiments.task_timing import KERNELS, _build
    from sharetune.intake import to_relax

    load_tensor_intrinsics("cuda")
    target = family_target("cuda.sm_90")
    manifests = {s: {"kernels": {}, "errors": {}} for s in SETS}
    rows = []
    for model in models:
        mod = to_relax(*build(model)).mod if model in PANEL else to_relax(model).mod
        for task in extract(mod, target):
            dead = dead_blocks(task.mod)
            if not dead:
                continue
            key = f"{len(rows)}"
            row = {"model": model, "task": task.name, "weight": task.weight, "dead_blocks": sorted(dead),
                   "kernels": {}}
            args = [a.as_json() for a in ms.arg_info.ArgInfo.from_entry_func(task.mod, remove_preproc=True)]
            scheduled = {"default": default_module(task.mod, target)}
            rec = _stock_best(stock_dbs / model, task)
            if rec is not None:
                sch = Schedule(task.mod)
                rec.trace.apply_to_schedule(sch, False)
                scheduled["stock"] = sch.mod
                for name in sorted(dead):
                    sch.compute_inline(sch.get_sblock(name))
                scheduled["stock_one"] = sch.mod
            ctx = tune_context(task.mod, target, task.name, cold=True, population=64, num_threads=1, rand_state=1)
            ctx.pre_tuning(1 << 20, samples, ctx.generate_design_space(), None, None)
            for i, cand in enumerate(ctx.generate_measure_candidates() or []):
                scheduled[f"sampled/{i}"] = cand.sch.mod
            for label, sched in scheduled.items():
                group = label.split("/")[0]
                name = f"{key}" if group == label else f"{key}.{label.split('/')[1]}"
                try:
                    if group not in row["kernels"]:
                        row["kernels"][group] = kernel_count(sched, target)
                    folder = out / group
                    folder.mkdir(parents=True, exist_ok=True)
                    _build(sched, target, folder / f"w{name}.so")
                    manifests[group]["kernels"][name] = {"file": f"w{name}.so", "args_info": args}
                except Exception as err:  # noqa: BLE001 -- one schedule lost must not lose the others
                    manifests[group]["errors"][name] = f"{type(err).__name__}: {str(err).strip()[-300:]}"
            rows.append(row)
            print(json.dumps(row), flush=True)
    for group, manifest in manifests.items():
        (out / group).mkdir(parents=True, exist_ok=True)
        (out / group / KERNELS).write_text(json.dumps(manifest))
    return rows


def summarise(rows: list[dict]) -> dict:
    """Per set, the sum over tasks of weight x median µs, where every set has a figure."""
    full = [row for row in rows if all(row.get("us", {}).get(s) is not None for s in SETS)]
    return {"tasks": len(rows), "timed_in_every_set": len(full),
            "weighted_us": {s: round(sum(row["weight"] * row["us"][s] for row in full), 2) for s in SETS}}


def main(argv=None) -> int:
    from sharetune.experiments.task_timing import kernel_experiment_options, time_kernels

    ap = argparse.ArgumentParser(prog="python -m sharetune.testing.dead_blocks")
    ap.add_argument("--models", default="efficientnet-mbconv,regnety-stage")
    ap.add_argument("--stock-dbs", required=True, help="DIR/<model>/: a stock tuning's JSON database")
    kernel_experiment_options(ap, 16, "/tmp/dead_blocks")
    args = ap.parse_args(argv)
    t0 = time.time()
    work = Path(args.work)
    rows = build_sets(args.models.split(","), Path(args.stock_dbs), work, args.samples)
    result = {"command": "python -m sharetune.testing.dead_blocks " + " ".join(argv or sys.argv[1:]),
              "rows": rows, "build_s": round(time.time() - t0, 1)}
    if not args.dry:
        times, errors = time_kernels({s: str(work / s) for s in SETS}, device="gpu", rounds=args.rounds)
        for i, row in enumerate(rows):
            row["us"] = {s: times[s].get(str(i)) for s in SETS if s != "sampled"}
            sampled = [v for k, v in times["sampled"].items() if k.split(".")[0] == str(i)]
            row["us"]["sampled"] = min(sampled) if sampled else None
            row["us"] = {k: (round(v, 3) if v is not None else None) for k, v in row["us"].items()}
        result.update(errors=errors, summary=summarise(rows))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result.get("summary", {"rows": len(rows)})), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What a cold CUDA round's search costs per valid candidate, with and without the limits check that rejects a
sample before TVM lowers it (services/tuner/metaschedule/validity.py). Needs no GPU: the CUDA target's
sampling and TVM's GPU checks run on the CPU.

    python bench/valid_sampling.py --tasks resnet18:conv2d1,resnet18:conv2d3,transformer:fused_matmul_add
    -> a table, and JSON at --out (default bench/results/valid_sampling_cpu.json)
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def cold_round(task, target, valid_sampling: bool, per_round: int, rounds: int) -> dict:
    from tvm.s_tir import meta_schedule as ms
    from tvm.s_tir.meta_schedule.runner import RunnerResult

    from services.tuner.metaschedule.context import tune_context

    ctx = tune_context(task.mod, target, task.name, cold=True, population=16, rand_state=1, num_threads=1,
                       valid_sampling=valid_sampling)
    ctx.pre_tuning(1 << 20, per_round, ctx.generate_design_space(), ms.database.MemoryDatabase(),
                   ms.cost_model.RandomModel())
    from services.tuner.metaschedule.validity import LimitsCheck

    rejected0 = LimitsCheck.rejected
    cpu, valid = 0.0, 0
    for _ in range(rounds):
        t0 = time.process_time()
        cands = ctx.generate_measure_candidates() or []
        cpu += time.process_time() - t0
        valid += len(cands)
        ctx.notify_runner_results(cands, [RunnerResult([1e-4], None)] * len(cands))
    return {"valid_candidates": valid, "search_cpu_s": round(cpu, 2),
            "cpu_s_per_valid_candidate": round(cpu / max(1, valid), 4),
            "rejected_before_lowering": LimitsCheck.rejected - rejected0 if valid_sampling else None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tasks", default="resnet18:conv2d1,resnet18:conv2d3,resnet18:fused_conv2d_add_relu,"
                                       "transformer:fused_matmul_add")
    ap.add_argument("--per-round", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--out", default="bench/results/valid_sampling_cpu.json")
    args = ap.parse_args(argv)
    from services.measurer.metaschedule.targets import family_target
    from services.tuner.metaschedule.extract import extract
    from services.tuner.metaschedule.intrinsics import load_tensor_intrinsics
    from sharetune.intake import to_relax

    load_tensor_intrinsics("cuda")
    target = family_target(f"cuda.{args.arch}")
    models: dict[str, dict] = {}
    rows = []
    for spec in args.tasks.split(","):
        model, name = spec.split(":", 1)
        if model not in models:
            models[model] = {t.name: t for t in extract(to_relax(model).mod, target)}
        task = models[model].get(name)
        if task is None:
            print(f"{spec}: no such task (have {sorted(models[model])})")
            continue
        row = {"model": model, "task": name}
        for label, on in (("without", False), ("with", True)):
            row[label] = cold_round(task, target, on, args.per_round, args.rounds)
        row["cpu_ratio"] = round(row["with"]["cpu_s_per_valid_candidate"]
                                 / max(1e-9, row["without"]["cpu_s_per_valid_candidate"]), 3)
        rows.append(row)
        print(f"{spec:<40} CPU s / valid candidate {row['without']['cpu_s_per_valid_candidate']:.3f} -> "
              f"{row['with']['cpu_s_per_valid_candidate']:.3f} (x{row['cpu_ratio']}), rejected before lowering "
              f"{row['with']['rejected_before_lowering']}", flush=True)
    Path(args.out).write_text(json.dumps({"target": str(target), "per_round": args.per_round, "rounds": args.rounds,
                                          "threads": 1, "rows": rows}, indent=1))
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

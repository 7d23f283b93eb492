"""The kernel-only CUDA compile against TVM 0.27's own NVRTC path, candidate by candidate.

Samples candidates of zoo models for the H200's CUDA target (replay-trace over every task's design space),
generates each one's CUDA source (lowering + codegen, as a builder does), then compiles it both ways with
NVRTC: TVM's path (its CCCL preamble) and services/measurer/metaschedule/cuda_compile.py's. For each: the
kernels' machine code in both cubins (equal or not), each path's seconds to a cubin and to PTX only (the
difference is ptxas), and the source's size. NVRTC needs no GPU, and the cubin does not depend on the host
that compiled it, so the equality holds wherever the candidates are built.

    CUDA_PATH=/usr/local/cuda-13.0 python -m bench.cuda_compile --models resnet18,transformer --per-task 3 \\
        --out-json bench/results/cuda_compile.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

H200 = {"kind": "cuda", "arch": "sm_90", "max_threads_per_block": 1024, "max_shared_memory_per_block": 49152,
        "thread_warp_size": 32}


def sample_candidates(model: str, per_task: int, tasks: int, seed: int = 0):
    """(the H200's target, [(task name, candidate module)]): replay-trace samples of the heaviest tasks."""
    import tvm
    from tvm.s_tir import meta_schedule as ms

    from services.tuner.metaschedule.extract import extract
    from sharetune import intake

    target = tvm.target.Target(H200)
    found = sorted(extract(intake.to_relax(model).mod, target), key=lambda t: -t.flops * t.weight)
    out = []
    for task in found[:tasks]:
        ctx = ms.TuneContext(mod=task.mod, target=target, space_generator="post-order-apply",
                             search_strategy=ms.search_strategy.ReplayTrace(), task_name=task.name,
                             rand_state=seed, num_threads=1)
        spaces = ctx.generate_design_space()
        ctx.pre_tuning(per_task, per_task, spaces, None, None)
        cands = ctx.generate_measure_candidates() or []
        out += [(task.name, c.sch.mod) for c in cands[:per_task]]
        ctx.post_tuning()
    return target, out


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="resnet18,transformer")
    ap.add_argument("--per-task", type=int, default=3)
    ap.add_argument("--tasks", type=int, default=1000, help="at most this many tasks a model, heaviest first")
    ap.add_argument("--out-json", default=os.path.join(os.environ.get("OUT", "/tmp"), "cuda_compile.json"))
    args = ap.parse_args(argv)
    from services.measurer.metaschedule import cuda_compile as cc
    from services.measurer.metaschedule.build import build

    rows = []
    for model in args.models.split(","):
        t0 = time.perf_counter()
        target, cands = sample_candidates(model, args.per_task, args.tasks)
        print(f"{model}: sampled {len(cands)} candidates in {time.perf_counter() - t0:.0f} s", flush=True)
        for task, mod in cands:
            try:
                rt, gen_s = timed(lambda: build(mod, target))
                src = rt.imports[0].inspect_source()
            except Exception as err:  # noqa: BLE001 - lowering failed: neither path gets to compile it
                rows.append({"model": model, "task": task, "error": str(err)[:200]})
                continue
            row = {"model": model, "task": task, "source_kb": round(len(src) / 1024, 1), "codegen_s": round(gen_s, 3)}
            try:
                (ours, path), row["kernel_s"] = timed(lambda: cc.compile_source(src, "sm_90"))
                theirs, row["tvm_s"] = timed(lambda: cc.tvm_compile(src, "sm_90"))
                _, row["kernel_ptx_s"] = timed(lambda: cc.compile_source(src, "compute_90", "ptx"))
                _, row["tvm_ptx_s"] = timed(lambda: cc.tvm_compile(src, "compute_90", "ptx"))
                row.update(path=path, same_machine_code=cc.kernel_code(ours) == cc.kernel_code(theirs),
                           kernels=len(cc.kernel_code(ours)))
            except Exception as err:  # noqa: BLE001
                row["error"] = str(err)[:300]
            rows.append({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()})
            print(json.dumps(rows[-1]), flush=True)
    ok = [r for r in rows if "same_machine_code" in r]

    def stats(key):
        vals = [r[key] for r in ok]
        return {"median": round(statistics.median(vals), 3), "mean": round(statistics.mean(vals), 3),
                "max": round(max(vals), 3)} if vals else None

    big = [r for r in ok if r["source_kb"] > 300]
    summary = {"candidates": len(rows), "compared": len(ok), "same_machine_code": sum(r["same_machine_code"] for r in ok),
               "kernel_path": sum(r["path"] == "kernel" for r in ok), "errors": len(rows) - len(ok),
               "tvm_s": stats("tvm_s"), "kernel_s": stats("kernel_s"), "codegen_s": stats("codegen_s"),
               "ptxas_s": {"median": round(statistics.median(max(0.0, r["kernel_s"] - r["kernel_ptx_s"]) for r in ok), 3)}
               if ok else None,
               "over_300kb": {"count": len(big), "share_of_kernel_s": round(sum(r["kernel_s"] for r in big) /
                                                                             max(sum(r["kernel_s"] for r in ok), 1e-9), 3),
                              "kernel_s_mean": round(statistics.mean(r["kernel_s"] for r in big), 3) if big else None}}
    out = {"models": args.models, "per_task": args.per_task, "host": os.uname().nodename, "summary": summary,
           "rows": rows}
    Path(args.out_json).write_text(json.dumps(out, indent=1))
    print(json.dumps(summary, indent=1))
    print("wrote", args.out_json)
    return 0


if __name__ == "__main__":
    sys.exit(main())

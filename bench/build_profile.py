"""Where the time of building one CUDA candidate goes, stage by stage, and what the builders' settings buy.

Samples real candidates (replay-trace over each task's design space) of a zoo model for the H200's CUDA
target, then builds each in this process: lowering + codegen (tvm.build without the device compile),
the device compile (NVRTC, timed inside TVM's compile callback), packaging (export_library: host code +
link) and, where a GPU is visible, loading. The device compile is split once more by compiling the same
source to PTX only (NVRTC's front end, no ptxas): what is left is ptxas, at TVM's register-usage level 10.

    python bench/build_profile.py --model resnet18 --candidates 24 --out-json /tmp/build_profile.json
On a host without libcuda, TVM skips the device compile (the artifact holds CUDA source); `--nvrtc-direct`
then compiles that source with NVRTC itself, so the compile stage is still measured."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

H200 = {"kind": "cuda", "arch": "sm_90", "max_threads_per_block": 1024, "max_shared_memory_per_block": 49152,
        "thread_warp_size": 32}


def sample_candidates(model: str, per_task: int, tasks: int, seed: int = 0):
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="resnet18")
    ap.add_argument("--tasks", type=int, default=6)
    ap.add_argument("--candidates", type=int, default=4, help="per task")
    ap.add_argument("--nvrtc-direct", action="store_true")
    ap.add_argument("--out-json", default=os.path.join(os.environ.get("OUT", "/tmp"), "build_profile.json"))
    args = ap.parse_args(argv)
    import tvm
    import tvm_ffi
    import tvm.support.nvcc as nvcc

    from services.measurer.metaschedule.build import build
    from services.measurer.metaschedule.targets import device_for

    t0 = time.perf_counter()
    target, cands = sample_candidates(args.model, args.candidates, args.tasks)
    print(f"sampled {len(cands)} candidates in {time.perf_counter() - t0:.1f} s", flush=True)
    compile_s: list[float] = []
    shipped = nvcc.tvm_callback_cuda_compile

    @tvm_ffi.register_global_func("tvm_callback_cuda_compile", override=True)
    def _timed(code):  # noqa: ANN001
        t = time.perf_counter()
        try:
            return shipped(code)
        finally:
            compile_s.append(time.perf_counter() - t)

    gpu = device_for(target).exist if os.environ.get("CUDA_VISIBLE_DEVICES", "x") != "" else False
    rows = {}
    for mode in ["default"]:
        per = []
        for name, mod in cands:
            compile_s.clear()
            t = time.perf_counter()
            try:
                rt = build(mod, target)
            except Exception as err:  # noqa: BLE001
                per.append({"task": name, "error": str(err)[:200]})
                continue
            built = time.perf_counter() - t
            comp = sum(compile_s)
            src = rt.imports[0].inspect_source() if rt.imports else ""
            if args.nvrtc_direct and not compile_s:
                t = time.perf_counter()
                nvcc.compile_cuda(src, "cubin", arch="sm_90", compiler="nvrtc")
                comp = time.perf_counter() - t
            t = time.perf_counter()
            try:
                nvcc.compile_cuda(src, "ptx", arch="sm_90", compiler="nvrtc")
                front = time.perf_counter() - t
            except Exception:  # noqa: BLE001 - a host without NVRTC: the split is unknown
                front = None
            with tempfile.TemporaryDirectory() as d:
                t = time.perf_counter()
                path = os.path.join(d, "c.so")
                rt.export_library(path)
                pack = time.perf_counter() - t
                size = os.path.getsize(path)
                load = None
                if gpu:
                    t = time.perf_counter()
                    tvm.runtime.load_module(path)
                    load = time.perf_counter() - t
            per.append({"task": name, "lower_codegen_s": built - sum(compile_s), "device_compile_s": comp,
                        "nvrtc_frontend_s": front, "ptxas_s": None if front is None else max(0.0, comp - front),
                        "package_s": pack, "load_s": load, "bytes": size,
                        "total_s": built - sum(compile_s) + comp + pack})
        ok = [p for p in per if "error" not in p]
        med = {k: round(statistics.median([p[k] for p in ok]), 4) for k in
               ("lower_codegen_s", "device_compile_s", "nvrtc_frontend_s", "ptxas_s", "package_s", "total_s")
               if all(p[k] is not None for p in ok)} if ok else {}
        rows[mode] = {"median": med, "candidates": len(ok), "errors": len(per) - len(ok), "per_candidate": per}
        print(f"{mode:8} {len(ok)} built  median s: " + "  ".join(f"{k} {v}" for k, v in med.items()), flush=True)
    out = {"model": args.model, "target": H200, "gpu_visible": bool(gpu), "nvrtc_direct": args.nvrtc_direct,
           "modes": rows}
    Path(args.out_json).write_text(json.dumps(out, indent=1))
    print("wrote", args.out_json)
    return 0


if __name__ == "__main__":
    sys.exit(main())

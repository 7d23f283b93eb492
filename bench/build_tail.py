"""The build tail: which CUDA candidates are slow to compile, how close they come to their task's best, and what a
compile CPU limit (LaneSettings.cuda_compile_cpu_limit_s) saves. Needs no GPU: every record of stock
MetaSchedule's databases of the time-to-quality panel on the H200 (kept in the repo) is built again here, its
kernel compiled with NVRTC with no limit and, when it took longer than a limit, again under it; its H200 time
against its task's best says what a limit would have cut.

    python -m bench.build_tail --limits 2,4        # ~15 min on 2 cores; bench/results/build_tail.json
"""
from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ProcessPoolExecutor

from bench.harness.common import kept_in_repo, results_path, write_results
from bench.panel import PANEL
from sharetune.experiments.throughput import compile_limit_figures

H200 = {"kind": "cuda", "arch": "sm_90", "max_threads_per_block": 1024, "max_shared_memory_per_block": 49152,
        "thread_warp_size": 32}
WARM_UP = '#ifdef __CUDACC_RTC__\n#else\n#endif\nextern "C" __global__ void k(float* a) { a[0] = 1.0f; }\n'


def _compile_cpu(cc, source: str, limit: float) -> tuple[float, bool]:
    cc.configure(cc.CompileOptions("kernel", limit, cache_mb=0))  # NVRTC's own cost, never a cached binary
    t0 = time.process_time()
    try:
        cc.compile_source(source, "sm_90")
        return time.process_time() - t0, False
    except cc.CompileLimitExceeded:
        return time.process_time() - t0, True


def nvrtc_setup():
    """(the H200's target, the lanes' CUDA compile module, their build), NVRTC's start-up (~4 s of CPU) paid
    before anything is counted."""
    import os

    os.environ.setdefault("CUDA_PATH", "/usr/local/cuda")
    import tvm

    from services.measurer.metaschedule import cuda_compile as cc
    from services.measurer.metaschedule.build import build
    from services.tuner.metaschedule.intrinsics import load_tensor_intrinsics

    load_tensor_intrinsics("cuda")
    _compile_cpu(cc, WARM_UP, 0.0)
    return tvm.target.Target(H200), cc, build


def lowered(rec, target, build, count_trace: bool) -> tuple[str, float]:
    """A record's CUDA source (no libcuda here: lowering and codegen only) and the CPU seconds it took (the
    trace's replay counted with `count_trace`)."""
    import tvm

    sch = tvm.s_tir.Schedule(rec.workload.mod)
    t0 = time.process_time()
    rec.trace.apply_to_schedule(sch, remove_postproc=False)
    t1 = time.process_time()
    source = build(sch.mod, target).imports[0].inspect_source()
    return source, time.process_time() - (t0 if count_trace else t1)
def model_rows(model: str, limits: list[float]) -> list[dict]:
    """Each valid stock record of the model: its kernel source's size, lowering and NVRTC CPU (no limit, and
    under each limit it exceeds), its H200 time."""
    import tvm_ffi
    from tvm.s_tir import meta_schedule as ms

    target, cc, build = nvrtc_setup()
    db = ms.database.JSONDatabase(work_dir=str(kept_in_repo("time_to_quality_stock") / model),
                                  module_equality="structural")
    rows = []
    for rec in db.get_all_tuning_records():
        secs = [float(x) for x in rec.run_secs or []]
        if not secs or max(secs) > 1e9:
            continue
        source, lower = lowered(rec, target, build, count_trace=False)
        nvrtc, _ = _compile_cpu(cc, source, 0.0)
        row = {"model": model, "workload": str(tvm_ffi.structural_hash(rec.workload.mod)),
               "us": 1e6 * sum(secs) / len(secs), "source_kb": round(len(source) / 1e3, 1),
               "lower_cpu_s": round(lower, 3), "nvrtc_cpu_s": round(nvrtc, 3), "limited": {}}
        for limit in limits:
            if nvrtc > limit:
                spent, stopped = _compile_cpu(cc, source, limit)
                row["limited"][str(limit)] = {"cpu_s": round(spent, 3), "stopped": stopped}
        rows.append(row)
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(PANEL))
    ap.add_argument("--limits", default="2,4", help="compile CPU limits to try, seconds")
    ap.add_argument("--workers", type=int, default=2, help="processes, a model each at a time")
    args = ap.parse_args(argv)
    models, limits = args.models.split(","), [float(x) for x in args.limits.split(",")]
    with ProcessPoolExecutor(args.workers) as pool:
        rows = [r for part in pool.map(model_rows, models, [limits] * len(models)) for r in part]
    body = {"summary": compile_limit_figures(rows, limits),
            "per_model": {m: compile_limit_figures([r for r in rows if r["model"] == m], limits) for m in models}, "rows": rows}
    print(json.dumps(body["summary"], indent=1))
    write_results(body, results_path("build_tail.json"), "bench.build_tail", argv)


if __name__ == "__main__":
    main()

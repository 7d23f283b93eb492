"""A lane's timing on a host busy with builds, at each CommonSettings.batch_priority of the builds.

The timer does what a lane does for a candidate: TVM's time_evaluator, 3 repeats of at least 50 ms (a GPU lane's
TimingConfig), then a short pause for the next one. Here the kernel is a small CPU kernel, so the timer's thread
is busy through each repeat, as a GPU lane's thread is while it launches kernels of a few microseconds back to
back. Beside it, build processes (twice the host's cores, as 16 builders and 4 tuner clients on 16 cores)
compile sampled CUDA candidates of a panel convolution again and again (TVM's lowering and NVRTC, what a
builder does; no GPU needed), at the priority under test. Per priority: the spread of each timing's repeats
((max - min) / median, shared.ranking.repeat_spread), how far its median sits above the quiet host's, how often
a GPU lane's full timing would settle at 10 ms (services/measurer/metaschedule/timing.py full_costs), and the
builds a minute. `python -m bench.timing_contention` runs it (bench/results/timing_contention_cpu.json)."""
from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import time

from shared.cpu_priority import PRIORITIES, current, yield_cpu
from shared.messages import TimingConfig
from shared.ranking import repeat_spread, spread_summary

SETTLING = TimingConfig(repeat=3, min_repeat_ms=50, settle_ms=10)  # a GPU lane's (shared.lanes.gpu)


def sampled_candidates(relax_model, task: str, count: int) -> list[str]:
    """`count` sampled schedules of a model's task on sm_90, packed as a builder receives them."""
    from tvm.s_tir import meta_schedule as ms

    from services.measurer.metaschedule.candidate_codec import dump_ir
    from services.measurer.metaschedule.targets import family_target
    from services.tuner.metaschedule import validity
    from services.tuner.metaschedule.extract import extract
    from services.tuner.metaschedule.intrinsics import load_tensor_intrinsics
    from services.tuner.metaschedule.sampling import ValidReplay

    load_tensor_intrinsics("cuda")
    target = family_target("cuda.sm_90")
    found = {t.name: t for t in extract(relax_model.mod, target)}[task]
    ctx = ms.TuneContext(mod=found.mod, target=target, task_name=found.name, rand_state=1, num_threads=1,
                         space_generator=ms.space_generator.PostOrderApply(postprocs=validity.cuda_postprocs(target)),
                         search_strategy=ValidReplay(seed=1, threads=1))
    ctx.pre_tuning(count, count, ctx.generate_design_space(), ms.database.MemoryDatabase(),
                   ms.cost_model.RandomModel())
    return [dump_ir(c.sch.mod) for c in ctx.generate_measure_candidates() or []]


def build_loop(priority: str, candidates: list[str], stop, built) -> None:
    """A build process: its priority given first (as a builder's entry point does), then builds until `stop`."""
    yield_cpu(priority)
    from services.measurer.metaschedule import cuda_compile
    from services.measurer.metaschedule.build import build
    from services.measurer.metaschedule.candidate_codec import load_ir
    from services.measurer.metaschedule.targets import family_target

    cuda_compile.configure(cuda_compile.CompileOptions(cache_mb=0))  # every build compiles, as a new candidate does
    target = family_target("cuda.sm_90")
    i = 0
    while not stop.is_set():
        try:  # a failed build is a build too (as a builder's error record)
            source = build(load_ir(candidates[i % len(candidates)]), target).imports[0].inspect_source()
            cuda_compile.compile_source(source, "sm_90")
        except Exception:  # noqa: BLE001
            pass
        with built.get_lock():
            built.value += 1
        i += 1


def timer():
    """A small CPU kernel's evaluator, `evaluate(floor_ms, repeat)`, as a GPU lane times a candidate."""
    import numpy as np
    import tvm
    from tvm import te

    a = te.placeholder((4096,), name="a")
    b = te.compute((4096,), lambda i: a[i] * 2.0 + 1.0, name="b")
    f = tvm.build(tvm.IRModule({"main": te.create_prim_func([a, b])}), target="llvm")
    dev = tvm.cpu()
    x, y = (tvm.runtime.tensor(np.zeros(4096, "float32"), dev) for _ in range(2))
    return lambda floor_ms, repeat: f.time_evaluator("main", dev, number=100, repeat=repeat,
                                                    min_repeat_ms=floor_ms)(x, y).results


def run(priority: str | None, builders: int, candidates: list[str], timings: int, settle_s: float) -> dict:
    """`timings` timings beside `builders` build processes at `priority` (None: a quiet host), once they have
    built twice their number (or `settle_s` has passed)."""
    from services.measurer.metaschedule.timing import full_costs  # here: a build process gives way before TVM loads

    ctx = multiprocessing.get_context("spawn")
    stop, built = ctx.Event(), ctx.Value("i", 0)
    procs = [ctx.Process(target=build_loop, args=(priority, candidates, stop, built)) for _ in range(builders)] \
        if priority else []
    for p in procs:
        p.start()
    try:
        deadline = time.time() + settle_s  # the builders past their imports and first compiles
        while procs and built.value < 2 * len(procs) and time.time() < deadline:
            time.sleep(0.5)
        got = [current(p.pid) for p in procs if p.is_alive()]
        evaluate = timer()
        n0, t0 = built.value, time.time()
        results, settled = [], []
        for _ in range(timings):  # each pause: the lane between candidates, loading the next, reporting the last
            results.append(evaluate(50, 3))
            time.sleep(0.05)
            settled.append(full_costs(evaluate, SETTLING)[1] == SETTLING.settle_ms)  # as a GPU lane's full timing
            time.sleep(0.05)
        minutes = (time.time() - t0) / 60
        n = built.value - n0
    finally:
        stop.set()
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    return {"priority": priority or "quiet host", "builders": len(procs), "builder_priorities": sorted(set(got)),
            "timings": len(results), "spread": spread_summary([repeat_spread(r) for r in results]),
            "spread_max": round(max(repeat_spread(r) for r in results), 4),
            "median_s": statistics.median(statistics.median(r) for r in results),
            "settled_frac": round(sum(settled) / len(settled), 3),
            "builds_per_min": round(n / minutes, 1) if procs else None}


DURATION_BINS_US = (0, 5, 10, 20, 50, 1e9)


def archived_spreads(archive: str) -> dict:
    """The spread of the full timings' repeats in the service's databases kept in a time-to-quality archive
    (`*/database/database_repeats.json`: every repeat of every exported record), by the kernel's median
    duration; and how often the first repeat is the slowest where the spread is over 5 %."""
    import json
    import tarfile

    found: list[list[float]] = []
    with tarfile.open(archive) as tar:
        for member in tar.getmembers():
            if member.isfile() and member.name.endswith("/database/database_repeats.json"):
                for line in tar.extractfile(member).read().decode().splitlines():
                    secs = json.loads(line).get("run_secs") or []
                    if len(secs) >= 3:
                        found.append(secs)
    by_bin = {}
    for lo, hi in zip(DURATION_BINS_US, DURATION_BINS_US[1:]):
        inside = [s for s in found if lo <= 1e6 * statistics.median(s) < hi]
        by_bin[f"{lo:g}-{hi:g} us" if hi < 1e9 else f">= {lo:g} us"] = spread_summary([repeat_spread(s) for s in inside])
    wide = [s for s in found if repeat_spread(s) > 0.05]
    first = sum(s.index(max(s)) == 0 for s in wide)
    return {"archive": archive, "timings": len(found), "by_kernel_duration": by_bin, "over_5pct": len(wide),
            "first_repeat_slowest_of_over_5pct": round(first / len(wide), 3) if wide else None}


def main(build_model, write_results, argv=None) -> int:
    """The bench: `build_model(name)` gives a panel model's (module, inputs), `write_results` writes the JSON."""
    from sharetune.intake import to_relax

    ap = argparse.ArgumentParser(prog="python -m bench.timing_contention")
    ap.add_argument("--builders", type=int, default=2 * (os.cpu_count() or 1))
    ap.add_argument("--timings", type=int, default=60)
    ap.add_argument("--task", default="efficientnet-mbconv:conv2d1", help="model:task whose candidates are built")
    ap.add_argument("--candidates", type=int, default=16)
    ap.add_argument("--settle-s", type=float, default=180.0, help="at most this long for the builders to start")
    ap.add_argument("--priorities", default=",".join(PRIORITIES))
    ap.add_argument("--out", default="bench/results/timing_contention_cpu.json")
    ap.add_argument("--archive", default="bench/results/time_to_quality_dbs.tar.xz",
                    help="the H200 runs' databases whose repeats are summarised too ('' : none)")
    args = ap.parse_args(argv)
    h200 = archived_spreads(args.archive) if args.archive else None
    if h200:
        print(f"{h200['timings']} archived full timings, spread by kernel duration: {h200['by_kernel_duration']}; "
              f"first repeat the slowest in {h200['first_repeat_slowest_of_over_5pct']} of those over 5 %")
    model, _, task = args.task.partition(":")
    candidates = sampled_candidates(to_relax(*build_model(model)), task, args.candidates)
    rows = [run(None, 0, candidates, args.timings, 0)]
    for priority in args.priorities.split(","):
        rows.append(run(priority, args.builders, candidates, args.timings, args.settle_s))
    quiet = rows[0]["median_s"]
    for row in rows:
        row["median_vs_quiet"] = round(row["median_s"] / quiet, 3)
        print(f"{row['priority']:<12} builders {row['builders']:>2} {row['builder_priorities']} spread "
              f"{row['spread']} max {row['spread_max']} median x{row['median_vs_quiet']} settled {row['settled_frac']} "
              f"builds/min {row['builds_per_min']}", flush=True)
    write_results({"host_cores": os.cpu_count(), "task": args.task, "candidates": len(candidates),
                   "repeats": 3, "min_repeat_ms": 50, "rows": rows, "archived_h200": h200}, args.out, "bench.timing_contention", argv)
    print("wrote", args.out)
    return 0

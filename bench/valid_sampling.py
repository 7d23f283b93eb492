"""What valid sampling saves in a cold CUDA round: per task, one round of 64 candidates on one thread, three ways
(MODES: TVM's replay-trace with its postprocessors alone, with the precheck first, and tile draws within the limits,
what a cold round runs); with --evolution, an evolutionary round after a cold one, three ways (EVOLUTION_MODES).
Reported: search CPU seconds per valid candidate, samples replayed, which postprocessor rejected them. Needs no
GPU. A model is a zoo or panel name. Protocol and results: docs/time_to_quality.md (Valid first rounds).

    python -m bench.valid_sampling --tasks resnet18:conv2d1,regnety-stage:conv2d6   # bench/results/valid_sampling_cpu.json
    python -m bench.valid_sampling --evolution --tasks efficientnet-mbconv:conv2d1 --out /tmp/evolution.json
"""
from __future__ import annotations

import argparse
import sys
import time
from bench.harness.common import write_results

DEFAULT_TASKS = ("resnet18:conv2d1,resnet18:conv2d9,transformer:fused_matmul_add,"
                 "efficientnet-mbconv:conv2d1,efficientnet-mbconv:fused_conv2d3_add1_tir_sigmoid3_multiply3,"
                 "efficientnet-mbconv:conv2d,regnety-stage:conv2d1,regnety-stage:conv2d6,"
                 "regnety-stage:fused_conv2d8_add1_tir_sigmoid_multiply,wav2vec2-conv:conv1d1,"
                 "wav2vec2-conv:conv1d2,vit-s-encoder:fused_matmul_add,vit-s-encoder:matmul2")
MODES = ("off", "precheck", "tile draws")


def counting(postprocs, skip: tuple = ()):
    """The postprocessors, each wrapped to count its calls and rejections (so samples drawn = calls of
    the first, rejected by X = X's rejections); those named in `skip` left as they are."""
    from tvm.ir.utils import derived_object
    from tvm.s_tir.meta_schedule.postproc import PyPostproc

    @derived_object
    class Counted(PyPostproc):
        def __init__(self, inner, name):
            super().__init__()
            self.inner, self.name, self.calls, self.rejects = inner, name, 0, 0

        def _initialize_with_tune_context(self, context):
            self.inner._initialize_with_tune_context(context)  # noqa: SLF001

        def apply(self, sch):
            self.calls += 1
            ok = bool(self.inner.apply(sch))
            self.rejects += not ok
            return ok

        def clone(self):
            return self

    return [p if type(p).__name__ in skip else Counted(p, type(p).__name__) for p in postprocs]


def cold_round(task, target, mode: str, candidates: int) -> dict:
    from tvm.s_tir import meta_schedule as ms

    from services.tuner.metaschedule import validity
    from services.tuner.metaschedule.sampling import ValidReplay

    precheck = mode != "off"
    base = validity.cuda_postprocs(target) if precheck else ms.postproc.Postproc.create(validity.rule_kind(target))
    wrapped = counting(base)
    strategy = ValidReplay(seed=1, threads=1) if mode == "tile draws" else "replay-trace"
    # the same space generator context.py builds, with every postprocessor counted
    ctx = ms.TuneContext(mod=task.mod, target=target,
                         space_generator=ms.space_generator.PostOrderApply(postprocs=wrapped),
                         search_strategy=strategy, task_name=task.name, rand_state=1, num_threads=1)
    ctx.pre_tuning(candidates, candidates, ctx.generate_design_space(), ms.database.MemoryDatabase(),
                   ms.cost_model.RandomModel())
    t0, c0 = time.perf_counter(), time.process_time()
    cands = ctx.generate_measure_candidates() or []
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    drawn = wrapped[0].calls
    rejected = {w.name: w.rejects for w in wrapped if w.rejects}
    return {"mode": mode, "precheck": precheck, "valid": len(cands), "drawn": drawn,
            "tile_draws": strategy.drawn if mode == "tile draws" else None, "search_cpu_s": round(cpu, 2),
            "search_wall_s": round(wall, 2), "cpu_s_per_valid": round(cpu / max(1, len(cands)), 3),
            "rejected": rejected,
            "frac_rejected_precheck": round(rejected.get("GPUPrecheck", 0) / max(1, drawn), 3),
            "frac_rejected_verify_gpu": round(rejected.get("VerifyGPUCode", 0) / max(1, drawn), 3)}


# ValidEvolution as it runs (VerifyGPUCode on the proposals only), and with VerifyGPUCode on every mutant it scores
EVOLUTION_MODES = ("EvolutionarySearch", "ValidEvolution, all verified", "ValidEvolution")


def evolution_round(task, target, mode: str, candidates: int, population: int = 128) -> dict:
    import random

    from tvm.s_tir import meta_schedule as ms
    from tvm.s_tir.meta_schedule.runner import RunnerResult

    from services.tuner.metaschedule import evolution, validity
    from services.tuner.metaschedule.evolution import ValidEvolution
    from services.tuner.metaschedule.sampling import ValidReplay

    db, model = ms.database.MemoryDatabase(), ms.cost_model.XGBModel(num_warmup_samples=0)
    rng = random.Random(0)

    def context(strategy, postprocs):
        ctx = ms.TuneContext(mod=task.mod, target=target, search_strategy=strategy, task_name=task.name,
                             rand_state=1, num_threads=1,
                             space_generator=ms.space_generator.PostOrderApply(postprocs=postprocs))
        ctx.pre_tuning(1 << 20, candidates, ctx.generate_design_space(), db, model)
        return ctx

    ctx = context(ValidReplay(seed=1, threads=1), validity.cuda_postprocs(target))
    first = ctx.generate_measure_candidates() or []
    results = [RunnerResult([rng.uniform(1e-5, 1e-4)], None) for _ in first]
    workload = db.commit_workload(task.mod)
    for c, r in zip(first, results):
        db.commit_tuning_record(ms.database.TuningRecord(c.sch.trace, workload, r.run_secs, target, c.args_info))
    model.update(ctx, first, results)
    # ValidEvolution must see VerifyGPUCode as itself (it checks only what it proposes): its rejections are its own
    wrapped = counting(validity.cuda_postprocs(target), skip=("VerifyGPUCode",) if mode == "ValidEvolution" else ())
    lazy = mode == "ValidEvolution"
    strategy = (ms.search_strategy.EvolutionarySearch(population_size=population, init_min_unmeasured=16)
                if mode == "EvolutionarySearch" else ValidEvolution(seed=1, threads=1, population=population // 2))
    verifies = evolution._verifies
    if mode == "ValidEvolution, all verified":
        evolution._verifies = lambda _p: False  # VerifyGPUCode stays in the replays' chain
    try:
        ctx = context(strategy, wrapped)
        c0 = time.process_time()
        cands = ctx.generate_measure_candidates() or []
        cpu = time.process_time() - c0
    finally:
        evolution._verifies = verifies
    return {"mode": mode, "valid": len(cands), "drawn": wrapped[0].calls, "search_cpu_s": round(cpu, 2),
            "cpu_s_per_valid": round(cpu / max(1, len(cands)), 3),
            "rejected": {**{w.name: w.rejects for w in wrapped if getattr(w, "rejects", 0)},
                         **({"VerifyGPUCode": strategy.verify_rejected} if lazy else {})}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tasks", default=DEFAULT_TASKS, help="comma-separated model:task")
    ap.add_argument("--candidates", type=int, default=64)
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--out", default="bench/results/valid_sampling_cpu.json")
    ap.add_argument("--evolution", action="store_true", help="an evolutionary round, two ways, instead")
    args = ap.parse_args(argv)
    from services.measurer.metaschedule.targets import family_target
    from bench.panel import PANEL, build
    from services.tuner.metaschedule.extract import extract
    from sharetune.intake import to_relax

    from services.tuner.metaschedule.intrinsics import load_tensor_intrinsics

    load_tensor_intrinsics("cuda")  # as a CUDA tuner does before its first TuneContext
    target = family_target(f"cuda.{args.arch}")
    models: dict = {}
    rows = []
    print(f"{'task':<58} {'mode':<10} {'valid':>5} {'drawn':>6} {'CPU s':>6} {'s/valid':>8} "
          f"{'rej pre':>7} {'rej VGC':>7}")
    for spec in args.tasks.split(","):
        model, _, name = spec.partition(":")
        if model not in models:
            relax_model = to_relax(*build(model)) if model in PANEL else to_relax(model)
            models[model] = {t.name: t for t in extract(relax_model.mod, target)}
        if args.evolution:
            for mode in EVOLUTION_MODES:
                r = {"model": model, "task": name, **evolution_round(models[model][name], target, mode,
                                                                     args.candidates)}
                rows.append(r)
                print(f"{model + ':' + name:<58} {mode:<18} {r['valid']:>5} {r['drawn']:>6} {r['search_cpu_s']:>6} "
                      f"{r['cpu_s_per_valid']:>8} {r['rejected']}", flush=True)
            continue
        for mode in MODES:
            r = {"model": model, "task": name, **cold_round(models[model][name], target, mode, args.candidates)}
            rows.append(r)
            print(f"{model + ':' + name:<58} {mode:<10} {r['valid']:>5} {r['drawn']:>6} "
                  f"{r['search_cpu_s']:>6} {r['cpu_s_per_valid']:>8} {r['frac_rejected_precheck']:>7} "
                  f"{r['frac_rejected_verify_gpu']:>7}", flush=True)
    write_results({"target": str(target), "candidates": args.candidates, "threads": 1,
                   "modes": list(EVOLUTION_MODES if args.evolution else MODES), "rows": rows}, args.out,
                  "bench.valid_sampling", argv)
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""How much of an evolutionary round's search buys its proposals: ValidEvolution's round on a CUDA task, with a
cost model trained on real GPU timings, at several populations and generation counts. No GPU.

A stock MetaSchedule database of a panel model (bench/results/time_to_quality_dbs.tar.xz,
time_to_quality_stock/<model>/: every record timed on the H200) trains two XGB models: the search's, on a random
half of the records (a model mid-job), and a judge, on all of them. Each variant runs one round of 64 from
fresh state (no measured parents: the stock traces come from stock's design spaces) for several seeds; the
report is its search CPU and the judge's view of what it proposed (the mean judged score of its proposals and of
their best eight; scores are the XGB ranking's, higher is faster), and how many of the default's proposals it
shares. It says which budget cuts could keep a round's proposals; only a GPU run says whether the tuned model
keeps its latency (sharetune.testing.settings_ab with SHARETUNE_SEARCH_POPULATION). Results: docs/time_to_quality.md
(What an evolutionary round's budget buys).

    python -m sharetune.testing.evolution_budget --stock-db DIR --model regnety-stage --tasks conv2d6 \\
        --variants 64x3,64x2,32x3 --seeds 3 --out /tmp/evolution_budget.json
"""
from __future__ import annotations

import argparse
import json
import random
import time


def _records_by_task(db, tasks: dict) -> dict:
    """{task name: [TuningRecord, ...]} for the tasks whose workload the stock database holds."""

    out = {}
    for name, task in tasks.items():
        if db.has_workload(task.mod):
            recs = [r for r in db.get_top_k(db.commit_workload(task.mod), 1 << 16) if r.run_secs]
            if recs:
                out[name] = recs
    return out


def _train(model, target, tasks: dict, records: dict, keep) -> None:
    """Update `model` with the records `keep(i)` selects, task by task, as a runner's results would."""
    from tvm.s_tir import meta_schedule as ms
    from tvm.s_tir.meta_schedule.runner import RunnerResult

    for name, recs in records.items():
        chosen = [r for i, r in enumerate(recs) if keep(name, i)]
        if not chosen:
            continue
        ctx = ms.TuneContext(mod=tasks[name].mod, target=target, task_name=name, num_threads=1)
        model.update(ctx, [r.as_measure_candidate() for r in chosen],
                     [RunnerResult([float(s) for s in r.run_secs], None) for r in chosen])


def one_round(task, target, model, population: int, generations: int, seed: int,
              screen: bool = False) -> tuple[list, float]:
    """(the round's proposals, its search CPU seconds)."""
    from tvm.s_tir import meta_schedule as ms

    from services.tuner.metaschedule import evolution
    from services.tuner.metaschedule.context import tune_context

    ctx = tune_context(task.mod, target, task.name, cold=False, population=2 * population, rand_state=seed,
                       num_threads=1, pad_awkward="matmul", evolution_screen=screen)
    ctx.pre_tuning(1 << 20, 64, ctx.generate_design_space(), ms.database.MemoryDatabase(), model)
    kept, evolution.GENERATIONS = evolution.GENERATIONS, generations
    try:
        c0 = time.process_time()
        cands = ctx.generate_measure_candidates() or []
        return cands, time.process_time() - c0
    finally:
        evolution.GENERATIONS = kept


def variant(text: str) -> tuple[int, int, bool]:
    """`64x3` -> (population 64, 3 generations, unscreened); `64x3s`: the same with screened mutants."""
    screen = text.endswith("s")
    population, generations = (int(x) for x in text.rstrip("s").split("x"))
    return population, generations, screen


def study(task, target, searcher, judge, variants: list[tuple[int, int, bool]], seeds: int) -> list[dict]:
    import numpy as np
    import tvm_ffi
    from tvm.s_tir import meta_schedule as ms

    rows, base = [], {}
    judge_ctx = ms.TuneContext(mod=task.mod, target=target, task_name=task.name, num_threads=1)
    for population, generations, screen in variants:
        for seed in range(1, seeds + 1):
            cands, cpu = one_round(task, target, searcher, population, generations, seed, screen)
            scores = np.sort(np.asarray(judge.predict(judge_ctx, cands), dtype=float))[::-1] if cands else []
            keys = {tvm_ffi.structural_hash(c.sch.mod) for c in cands}
            base.setdefault(seed, keys)
            rows.append({"task": task.name, "population": population, "generations": generations,
                         "screened": screen, "seed": seed,
                         "proposed": len(cands), "search_cpu_s": round(cpu, 2),
                         "cpu_s_per_candidate": round(cpu / max(1, len(cands)), 4),
                         "judged_mean": round(float(np.mean(scores)), 4) if len(scores) else None,
                         "judged_top8": round(float(np.mean(scores[:8])), 4) if len(scores) else None,
                         "shared_with_first_variant": len(keys & base[seed])})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stock-db", required=True, help="a stock JSONDatabase folder (time_to_quality_stock/<model>)")
    ap.add_argument("--model", required=True, help="the panel model whose tasks the database holds")
    ap.add_argument("--tasks", required=True, help="comma-separated task names to search")
    ap.add_argument("--variants", default="64x3,64x2,32x3",
                    help="population x generations, comma-separated; a trailing s screens the mutants")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--out", default="/tmp/evolution_budget.json")
    args = ap.parse_args(argv)
    from tvm.s_tir import meta_schedule as ms

    from bench.panel import build
    from services.measurer.metaschedule.targets import family_target
    from services.tuner.metaschedule.extract import extract
    from services.tuner.metaschedule.intrinsics import load_tensor_intrinsics
    from sharetune.intake import to_relax

    load_tensor_intrinsics("cuda")
    target = family_target(f"cuda.{args.arch}")
    tasks = {t.name: t for t in extract(to_relax(*build(args.model)).mod, target)}
    db = ms.database.JSONDatabase(work_dir=args.stock_db, allow_missing=False)
    records = _records_by_task(db, tasks)
    half = random.Random(0)
    picks = {(n, i): half.random() < 0.5 for n, recs in records.items() for i in range(len(recs))}
    searcher, judge = ms.cost_model.XGBModel(num_warmup_samples=0), ms.cost_model.XGBModel(num_warmup_samples=0)
    _train(searcher, target, tasks, records, lambda n, i: picks[(n, i)])
    _train(judge, target, tasks, records, lambda n, i: True)
    variants = [variant(v) for v in args.variants.split(",")]
    rows = []
    for name in args.tasks.split(","):
        rows += study(tasks[name], target, searcher, judge, variants, args.seeds)
    with open(args.out, "w") as f:
        json.dump({"model": args.model, "records": {n: len(r) for n, r in records.items()}, "rows": rows}, f,
                  indent=1)
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

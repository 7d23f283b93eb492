"""Would an evolutionary round rank its pool as well without TVM's RewriteCooperativeFetch in the chain it scores
with? That postprocessor costs about half of a CUDA replay. A stock MetaSchedule database of a panel model
(bench/results/time_to_quality_dbs.tar.xz, time_to_quality_stock/<model>/: every record timed on the H200) trains
an XGB judge; random schedules of a task, drawn within the limits as ValidEvolution draws them, are replayed with
the search's chain and with the chain less the rewrite, and the judge ranks both. The report: replay and feature
CPU a schedule each way, the rank correlation of the two rankings, the overlap of their top quarters, and the
judged score (the full chain's) of the top quarter each picks. No GPU.

    python -m sharetune.testing.scoring_chain --stock-db DIR --model regnety-stage --tasks conv2d1 --draws 128
"""
from __future__ import annotations

import argparse
import json
import time

SKIPPED = "RewriteCooperativeFetch"


def compare(task, target, judge, draws: int) -> dict:
    import numpy as np
    from tvm.s_tir import meta_schedule as ms

    from services.tuner.metaschedule import validity
    from services.tuner.metaschedule.evolution import ValidEvolution
    from services.tuner.metaschedule.sampling import candidate, replay

    strategy = ValidEvolution(seed=3, threads=1, population=64)
    ctx = ms.TuneContext(mod=task.mod, target=target, search_strategy=strategy, task_name=task.name, rand_state=3,
                         num_threads=1, space_generator=ms.space_generator.PostOrderApply(
                             postprocs=validity.cuda_postprocs(target)))
    ctx.pre_tuning(1 << 20, 64, ctx.generate_design_space(), ms.database.MemoryDatabase(), judge)
    lite = [p for p in strategy.postprocs if type(p).__name__ != SKIPPED]
    c0 = time.process_time()
    keys = [k for k in dict.fromkeys(strategy._random(draws)) if strategy.replays.get(k) is not None]  # noqa: SLF001
    full_replay = (time.process_time() - c0) / max(1, draws)
    c0 = time.process_time()
    pairs = []
    for s, genome in keys:
        space = strategy.spaces[s]
        decisions = {inst: (list(d) if isinstance(d, tuple) else d) for inst, d in zip(space.sampled, genome)}
        sch = replay(ctx.mod, space.trace, decisions, lite, hash((s, genome)) & 0x7FFFFFFF)
        if sch is not None:
            pairs.append((strategy.replays[(s, genome)], candidate(sch)))
    lite_replay = (time.process_time() - c0) / max(1, len(keys))
    scores, feature_s = [], []
    for side in (0, 1):
        c0 = time.process_time()
        scores.append(np.asarray(judge.predict(ctx, [p[side] for p in pairs]), dtype=float))
        feature_s.append((time.process_time() - c0) / max(1, len(pairs)))
    full, rough = scores
    quarter = max(1, len(pairs) // 4)
    top_full, top_rough = np.argsort(-full)[:quarter], np.argsort(-rough)[:quarter]
    ranks = [np.argsort(np.argsort(-s)) for s in scores]
    return {"task": task.name, "schedules": len(pairs),
            "replay_cpu_s": {"full": round(full_replay, 4), "without": round(lite_replay, 4)},
            "feature_cpu_s": {"full": round(feature_s[0], 4), "without": round(feature_s[1], 4)},
            "spearman": round(float(np.corrcoef(*ranks)[0, 1]), 3),
            "top_quarter_overlap": round(len(set(top_full) & set(top_rough)) / quarter, 3),
            "judged_top_quarter": {"full": round(float(full[top_full].mean()), 4),
                                   "without": round(float(full[top_rough].mean()), 4)},
            "judged_mean": round(float(full.mean()), 4)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stock-db", required=True, help="a stock JSONDatabase folder (time_to_quality_stock/<model>)")
    ap.add_argument("--model", required=True, help="the panel model whose tasks the database holds")
    ap.add_argument("--tasks", required=True, help="comma-separated task names")
    ap.add_argument("--draws", type=int, default=128)
    ap.add_argument("--out", default="/tmp/scoring_chain.json")
    args = ap.parse_args(argv)
    from tvm.s_tir import meta_schedule as ms

    from bench.panel import build
    from services.measurer.metaschedule.targets import family_target
    from services.tuner.metaschedule.extract import extract
    from services.tuner.metaschedule.intrinsics import load_tensor_intrinsics
    from sharetune.intake import to_relax
    from sharetune.testing.evolution_budget import _records_by_task, _train

    load_tensor_intrinsics("cuda")
    target = family_target("cuda.sm_90")
    tasks = {t.name: t for t in extract(to_relax(*build(args.model)).mod, target)}
    db = ms.database.JSONDatabase(work_dir=args.stock_db, allow_missing=False)
    judge = ms.cost_model.XGBModel(num_warmup_samples=0)
    _train(judge, target, tasks, _records_by_task(db, tasks), lambda n, i: True)
    rows = []
    for name in args.tasks.split(","):
        rows.append(compare(tasks[name], target, judge, args.draws))
        print(json.dumps(rows[-1]), flush=True)
    with open(args.out, "w") as f:
        json.dump({"model": args.model, "skipped": SKIPPED, "rows": rows}, f, indent=1)
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

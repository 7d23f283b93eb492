"""What one round of MetaSchedule's search costs on this host's CPU, per task of a zoo model: a cold round
(replay-trace: random samples of the design space) and evolutionary rounds at given populations, with the
cost model (XGBoost) trained on made-up timings in between. Needs no GPU: the CUDA target's search (GPU
checks included) runs on the CPU.

    python bench/search_cost.py --model resnet18 --tasks conv2d1 --populations 128,512 --threads 1
    -> a table, and JSON at --out (default bench/results/search_cost.json)
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def round_costs(task, target, cold: bool, population: int, threads: int, rounds: int, iters: int) -> list[dict]:
    from tvm.s_tir import meta_schedule as ms
    from tvm.s_tir.meta_schedule.runner import RunnerResult

    strategy = "replay-trace" if cold else ms.search_strategy.EvolutionarySearch(
        population_size=population, genetic_num_iters=iters)
    ctx = ms.TuneContext(mod=task.mod, target=target, space_generator="post-order-apply", search_strategy=strategy,
                         task_name=task.name, rand_state=1, num_threads=threads)
    model = ms.cost_model.RandomModel() if cold else ms.cost_model.XGBModel(num_warmup_samples=0)
    ctx.pre_tuning(1 << 20, 64, ctx.generate_design_space(), ms.database.MemoryDatabase(), model)
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        cands = ctx.generate_measure_candidates() or []
        search_s = time.perf_counter() - t0
        results = [RunnerResult([random.uniform(1e-5, 1e-4)], None) for _ in cands]
        ctx.notify_runner_results(cands, results)
        if not cold:
            model.update(ctx, list(cands), results)
        out.append({"search_s": round(search_s, 2), "candidates": len(cands)})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="resnet18")
    ap.add_argument("--tasks", default="conv2d1", help="comma-separated task names")
    ap.add_argument("--populations", default="128,512")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--iters", type=int, default=4, help="evolutionary search's genetic iterations")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--out", default="bench/results/search_cost.json")
    args = ap.parse_args(argv)
    random.seed(0)
    from services.measurer.metaschedule.targets import family_target
    from services.tuner.metaschedule.extract import extract
    from sharetune.intake import to_relax

    target = family_target(f"cuda.{args.arch}")
    tasks = {t.name: t for t in extract(to_relax(args.model).mod, target)}
    rows = []
    for name in args.tasks.split(","):
        configs = [("cold", 0)] + [("evolutionary", int(p)) for p in args.populations.split(",") if p]
        for how, pop in configs:
            rounds = round_costs(tasks[name], target, how == "cold", pop, args.threads, args.rounds, args.iters)
            rows.append({"task": name, "search": how, "population": pop or None, "threads": args.threads,
                         "iters": None if how == "cold" else args.iters, "rounds": rounds,
                         "cpu_s_per_candidate": round(sum(r["search_s"] for r in rounds) * args.threads
                                                      / max(1, sum(r["candidates"] for r in rounds)), 3)})
            r = rows[-1]
            print(f"{name:<32} {how:<13} pop {str(pop or '-'):>4}  rounds {[x['search_s'] for x in rounds]}  "
                  f"{r['cpu_s_per_candidate']} CPU s a candidate", flush=True)
    Path(args.out).write_text(json.dumps({"model": args.model, "target": str(target), "rows": rows}, indent=1))
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

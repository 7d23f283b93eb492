"""Does a cost model trained on other models' records rank a new model's first-round samples? Offline, on the
H200: stock MetaSchedule's databases of the four panel models (`time_to_quality_stock/<model>/` in
bench/results/time_to_quality_dbs.tar.xz; ~400 fully timed records a model, mostly random first rounds). Leave
one model out: train the central model's XGBoost (services.tuner.updater.train, on the features the tuner
extracts, SnapshotCostModel's) on the other three's records, score the held-out model's records task by task,
and pick as a ranked first round would (sampling.ValidReplay: `pool` times the round drawn, the model's best
proposed, a quarter of the round drawn at random from the rest). Per task: the best of the picked round against
the task's best record, and the same for a round drawn at random. No GPU.

    python -m sharetune.testing.ranked_pools [--archive bench/results/time_to_quality_dbs.tar.xz] [--out F.json]
    python -m sharetune.testing.ranked_pools --rounds 8,12,16   # each round size, ranked from 3x and at random
(`random_2x`: a random round twice the ranked one's size, which allocation.ranked_first_round rests on)
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import tarfile
import tempfile
from pathlib import Path

import numpy as np

MODELS = ("efficientnet-mbconv", "regnety-stage", "vit-s-encoder", "wav2vec2-conv")


def model_rows(folder: Path, model: str, target) -> list[tuple[str, np.ndarray, float]]:
    """(workload, feature vector, median seconds) of every valid record of a model's stock database."""
    import tvm_ffi
    from tvm.s_tir import Schedule
    from tvm.s_tir import meta_schedule as ms
    from tvm.s_tir.meta_schedule.feature_extractor import PerStoreFeature

    from services.tuner.metaschedule.cost_model import _vectors

    db = ms.database.JSONDatabase(str(folder / model / "database_workload.json"),
                                  str(folder / model / "database_tuning_record.json"), allow_missing=False)
    by_workload: dict[str, tuple] = {}
    for rec in db.get_all_tuning_records():
        secs = [float(x) for x in rec.run_secs or []]
        if secs and max(secs) < 1e9:
            key = f"{model}:{tvm_ffi.structural_hash(rec.workload.mod)}"
            by_workload.setdefault(key, (rec.workload, []))[1].append(rec)
    extractor, out = PerStoreFeature(extract_workload=True), []
    for key, (workload, recs) in by_workload.items():
        cands, kept = [], []
        for rec in recs:
            sch = Schedule(workload.mod)
            rec.trace.apply_to_schedule(sch, remove_postproc=False)
            cands.append(ms.MeasureCandidate(sch, rec.args_info))
            kept.append(rec)
        ctx = ms.TuneContext(mod=workload.mod, target=target, task_name=key)
        for rec, vec in zip(kept, _vectors(extractor, ctx, cands)):
            if vec is not None:
                out.append((key, vec, float(np.median([float(x) for x in rec.run_secs]))))
    return out


def picked_round(pred: np.ndarray, costs: np.ndarray, pool: int, k: int,
                 rng: random.Random) -> tuple[float, float, float]:
    """One draw: (best of the ranked round, best of a random round of k, of a random round of 2k, the pool's
    first 2k) over the task's best; the round picked as the tuner picks it (sampling.ranked_pick)."""
    from services.tuner.metaschedule.sampling import ranked_pick

    idx = rng.sample(range(len(costs)), pool * k)
    chosen = [idx[i] for i in ranked_pick(pred[idx], k, rng)]
    return (float(costs[chosen].min() / costs.min()), float(costs[idx[:k]].min() / costs.min()),
            float(costs[idx[:2 * k]].min() / costs.min()))


def leave_one_out(data: dict[str, list], pools=(2, 3), k: int = 16, draws: int = 300, min_records: int = 48) -> dict:
    import xgboost as xgb

    from services.tuner import updater
    from shared.messages import TrainingRow

    rng, out = random.Random(0), {}
    for held in data:
        rows = [TrainingRow(group=g, features=v.tolist(), cost_s=c) for m in data if m != held for g, v, c in data[m]]
        booster = xgb.Booster()
        booster.load_model(bytearray(updater.train(rows, rounds=100, threads=2)))
        tasks: dict[str, list] = {}
        for g, v, c in data[held]:
            tasks.setdefault(g, []).append((v, c))
        per_task = []
        for g, items in tasks.items():
            if len(items) < min_records:
                continue
            pred = booster.predict(xgb.DMatrix(np.array([v for v, _ in items], dtype="float32")))
            costs = np.array([c for _, c in items])
            row = {"task": g, "records": len(items)}
            for pool in pools:
                got = [picked_round(pred, costs, pool, k, rng) for _ in range(draws) if pool * k <= len(items)]
                if got:
                    row[f"pool_{pool}x"] = {"ranked": round(statistics.mean(g[0] for g in got), 3),
                                            "random": round(statistics.mean(g[1] for g in got), 3),
                                            # a random round twice the ranked one's size, from the same draws
                                            "random_2x": round(statistics.mean(g[2] for g in got), 3)}
            per_task.append(row)
        out[held] = per_task
    return out


def summary(result: dict, pools=(2, 3)) -> dict:
    """Per pool: the mean over tasks of the ranked round's best and the random round's, over the task's best."""
    out = {}
    for pool in pools:
        rows = [r[f"pool_{pool}x"] for rs in result.values() for r in rs if f"pool_{pool}x" in r]
        if rows:
            out[f"pool_{pool}x"] = {"tasks": len(rows), "ranked": round(statistics.mean(r["ranked"] for r in rows), 3),
                                    "random": round(statistics.mean(r["random"] for r in rows), 3),
                                    "random_2x": round(statistics.mean(r["random_2x"] for r in rows), 3),
                                    "ranked_worse": sum(r["ranked"] > r["random"] for r in rows)}
    return out


def main(argv=None) -> int:
    from services.measurer.metaschedule.targets import family_target
    from services.tuner.metaschedule.intrinsics import load_tensor_intrinsics

    ap = argparse.ArgumentParser(prog="python -m sharetune.testing.ranked_pools")
    ap.add_argument("--archive", default="bench/results/time_to_quality_dbs.tar.xz")
    ap.add_argument("--out", default=None, help="a JSON file for the per-task figures")
    ap.add_argument("--rounds", default="16", help="round sizes, comma-separated (more than one: 3x pools only)")
    args = ap.parse_args(argv)
    rounds = [int(k) for k in args.rounds.split(",")]
    load_tensor_intrinsics("cuda")
    target = family_target("cuda.sm_90")
    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(args.archive) as tar:
            tar.extractall(tmp, members=[m for m in tar.getmembers() if m.name.startswith("time_to_quality_stock/")],
                           filter="data")
        data = {m: model_rows(Path(tmp) / "time_to_quality_stock", m, target) for m in MODELS}
    if len(rounds) > 1:
        figures = {"records": {m: len(v) for m, v in data.items()}, "pool": 3,
                   # the same tasks at every size: those with a 3x pool of the largest round
                   "rounds": {k: summary(leave_one_out(data, pools=(3,), k=k, min_records=3 * max(rounds)),
                                         pools=(3,)).get("pool_3x") for k in rounds}}  # None: no task that large
        print(json.dumps(figures["rounds"]))
    else:
        result = leave_one_out(data, k=rounds[0])
        figures = {"records": {m: len(v) for m, v in data.items()}, "round": rounds[0], "summary": summary(result),
                   "per_model": result}
        print(json.dumps(figures["summary"]), json.dumps(figures["records"]))
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""This service's cost model (updater features + XGBoost) against MetaSchedule's own `XGBModel`, on the
same measured rows; and the updater's training time per update as the store grows.

    python -m bench.cost_model_quality [--model small_cnn] [--trials 384] [--per-iter 32]
                                       [--records runs/cmq/records.json] [--out bench/results/cost_model_quality.json]

1. Rows: a fresh local Stack (CPU lanes) tunes `--model` for `--trials` trials (seed 0); every valid record
   of the job (trace, run_secs, measured_at) and its task's workload are saved to `--records`, which a
   later run reads instead of tuning again (`--reuse`).
2. Ranking, per task: its records sorted by measured_at, the first `--train-frac` train, the rest are
   held out. Both models train on the train rows of ALL tasks together (as both do in a search) and rank
   each task's held-out candidates. Candidates are rebuilt from their traces (postprocessing included),
   so both extract features from the very schedules that were measured.
   - ours: `candidate_vectors` (PerStoreFeature(extract_workload=True), sum + max over stores) and
     `services.tuner.updater.train` (its XGB_PARAMS, `UpdaterSettings().boost_rounds` rounds, target:
     the group's best / cost);
   - MetaSchedule: `XGBModel()` defaults (PerStoreFeature() per-block features, its PackSum
     segment-sum objective, early stopping); trained by its own `_train` on the same normalised targets
     its `update` computes, once, on all train rows.
   Metrics per task, averaged over tasks: best_in_top{1,5,10} (the true best held-out candidate is among
   the model's k highest), recall@{5,10} (|true top k ∩ predicted top k| / k), Spearman of score against
   throughput, NDCG@10 (relevance = best/cost). The random ranking's expectation is given beside.
3. Updater cost: `services.tuner.updater.ingest` (the updater's real path: rpush, keep-best, training set
   from Redis, XGBoost train, snapshot) against a real redis-server, one 64-row batch at 1k, 5k, 20k,
   50k stored rows. The stored rows are the real rows replicated with jitter (features x (1 + N(0, 0.02)),
   cost x (1 + N(0, 0.05))), in two shapes: `same_workloads` (the store grows within the model's
   workloads) and `growing_workloads` (every ~500 rows a new workload: a store that grows by more jobs).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from bench.harness.common import RESULTS, command_line, git_state, rounded, write_report
from bench.harness.jobs import job_records, run_job
from bench.harness.stock import lane_target

SIZES = (1000, 5000, 20000, 50000)
KS = (1, 5, 10)


# ---- 1. rows ------------------------------------------------------------------------------------------


def collect(args, work_dir: Path) -> dict:
    """Tune the model with the service; every valid record of the job with its workload."""
    from shared import store
    from sharetune.client import Client
    from sharetune.intake import to_relax
    from services.measurer.agent import default_cpu_lanes
    from sharetune.stack.local import Stack
    from shared.settings import StackSettings
    from shared.lanes import parse as parse_lane

    lanes = default_cpu_lanes()
    share = parse_lane(lanes[0]).share
    t0 = time.time()
    with Stack(work_dir / "stack", lanes=lanes, settings=StackSettings()) as stack:
        client = Client(stack.redis_url)
        job, _, _ = run_job(client, 3600, model=to_relax(args.model).mod, target="llvm", share=share,
                            trials=args.trials, name=args.model, trials_per_iter=args.per_iter, seed=0)
        r = client.redis
        recs = job_records(r, job.job_id, valid_only=True)
        tasks = [{"name": t.name, "wkey": t.wkey, "weight": t.weight, "flops": t.flops,
                  "mod": store.workload(r, t.wkey).mod,
                  "records": [{"trace": x.trace, "run_secs": x.run_secs, "measured_at": x.measured_at}
                              for x, xt in recs if xt.wkey == t.wkey]}
                 for t in store.job_tasks(r, job.job_id)]
    return {"model": args.model, "trials": args.trials, "per_iter": args.per_iter, "lanes": lanes, "share": share,
            "tune_wall_s": rounded(time.time() - t0), "tasks": tasks}


# ---- 2. ranking ---------------------------------------------------------------------------------------


def rebuild(task: dict, target):
    """(TuneContext, [MeasureCandidate], [cost s]) of a task's records, in measurement order."""
    from tvm import s_tir
    from tvm.s_tir import meta_schedule as ms

    from services.tuner.metaschedule.records import tuning_record
    from services.tuner.metaschedule.ir_codec import load_ir
    from shared.ranking import rank_secs

    mod = load_ir(task["mod"])
    wl = ms.database.Workload(mod)
    ctx = ms.TuneContext(mod=mod, target=target, task_name=task["name"])
    cands, costs = [], []
    for rec in task["records"]:
        trec = tuning_record(rec["trace"], wl)
        sch = s_tir.Schedule(mod)
        trec.trace.apply_to_schedule(sch, remove_postproc=False)
        cands.append(ms.MeasureCandidate(sch, trec.args_info))
        costs.append(rank_secs(rec["run_secs"]))
    return ctx, cands, costs


def rank_metrics(scores, costs) -> dict:
    """Higher score = predicted faster."""
    import numpy as np

    scores, costs = np.asarray(scores, dtype="float64"), np.asarray(costs, dtype="float64")
    n = len(costs)
    order_pred = np.argsort(-scores, kind="stable")
    order_true = np.argsort(costs, kind="stable")
    best = order_true[0]
    out = {"n": n}
    for k in KS:
        out[f"best_in_top{k}"] = float(best in set(order_pred[:k].tolist()))
        out[f"random_best_in_top{k}"] = min(1.0, k / n)
    for k in (5, 10):
        kk = min(k, n)
        out[f"recall@{k}"] = len(set(order_pred[:kk].tolist()) & set(order_true[:kk].tolist())) / kk
    thr = costs.min() / costs
    rank = lambda v: np.argsort(np.argsort(v, kind="stable"), kind="stable").astype("float64")  # noqa: E731
    rs, rt = rank(scores), rank(thr)
    out["spearman"] = float(np.corrcoef(rs, rt)[0, 1]) if n > 2 and rs.std() > 0 and rt.std() > 0 else None
    kk = min(10, n)
    disc = 1.0 / np.log2(np.arange(2, kk + 2))
    ideal = float((np.sort(thr)[::-1][:kk] * disc).sum())
    out["ndcg@10"] = float((thr[order_pred[:kk]] * disc).sum()) / ideal if ideal > 0 else None
    return out


def mean_metrics(per_task: list[dict]) -> dict:
    keys = [k for k in per_task[0] if k != "n"]
    out = {}
    for k in keys:
        vals = [m[k] for m in per_task if m[k] is not None]
        out[k] = rounded(statistics.mean(vals), 4) if vals else None
    out["tasks"] = len(per_task)
    out["held_out_candidates"] = sum(m["n"] for m in per_task)
    return out


def compare(data: dict, train_frac: float) -> dict:
    import numpy as np
    import xgboost as xgb
    from tvm.s_tir.meta_schedule.cost_model import XGBModel
    from tvm.s_tir.meta_schedule.feature_extractor import PerStoreFeature

    from services.tuner import updater
    from services.tuner.metaschedule.cost_model import candidate_vectors
    from shared.messages import TrainingRow
    from shared.settings import UpdaterSettings

    target = lane_target()
    threads = os.cpu_count() or 1
    ours_ext = PerStoreFeature(extract_workload=True)  # what SnapshotCostModel uses
    ms_model = XGBModel(num_warmup_samples=0)
    ms_ext = ms_model.extractor  # the default "per-store-feature"
    feat_s = {"ours": 0.0, "metaschedule": 0.0}
    splits = []
    train_rows, ms_train_x, ms_train_y = [], [], []
    for task in data["tasks"]:
        n = len(task["records"])
        n_train = int(round(n * train_frac))
        if n < 4 or n - n_train < 2:
            continue
        ctx, cands, costs = rebuild(task, target)
        t0 = time.time()
        ov = candidate_vectors(ours_ext, ctx, cands)
        feat_s["ours"] += time.time() - t0
        t0 = time.time()
        mv = [f.numpy().astype("float32") for f in ms_ext.extract_from(ctx, cands)]
        feat_s["metaschedule"] += time.time() - t0
        train_best = min(costs[:n_train]) if n_train else None
        for i in range(n_train):
            train_rows.append(TrainingRow(group=task["wkey"], features=ov[i].tolist(), cost_s=costs[i]))
            if len(mv[i]):  # XGBModel.update drops candidates without features; so do we
                ms_train_x.append(mv[i])
                ms_train_y.append(train_best / costs[i])
        splits.append({"name": task["name"], "n_train": n_train, "n_test": n - n_train,
                       "ours_x": ov[n_train:], "ms_x": mv[n_train:], "costs": costs[n_train:]})

    rounds = UpdaterSettings().boost_rounds
    t0 = time.time()
    raw = updater.train(train_rows, rounds, None, threads)
    ours_train_s = time.time() - t0
    booster = xgb.Booster(params={"nthread": 1})
    booster.load_model(bytearray(raw))

    t0 = time.time()
    ms_model._train(xs=ms_train_x, ys=np.array(ms_train_y, dtype="float32"))  # what XGBModel.update ends with
    ms_train_s = time.time() - t0

    per = {"ours": [], "metaschedule": []}
    tasks_out = []
    for s in splits:
        ours_scores = booster.predict(xgb.DMatrix(np.asarray(s["ours_x"], dtype="float32")))
        keep = [i for i, x in enumerate(s["ms_x"]) if len(x)]
        ms_scores = np.full(len(s["costs"]), -np.inf)
        if keep:
            ms_scores[keep] = ms_model._predict(xs=[s["ms_x"][i] for i in keep])
        mo, mm = rank_metrics(ours_scores, s["costs"]), rank_metrics(ms_scores, s["costs"])
        per["ours"].append(mo)
        per["metaschedule"].append(mm)
        tasks_out.append({"name": s["name"], "n_train": s["n_train"], "n_test": s["n_test"],
                          "best_test_us": rounded(1e6 * min(s["costs"])), "ours": mo, "metaschedule": mm})
    return {
        "train_frac": train_frac,
        "train_rows": len(train_rows),
        "threads": threads,
        "ours": {**mean_metrics(per["ours"]), "train_s": rounded(ours_train_s), "feature_s": rounded(feat_s["ours"]),
                 "boost_rounds": rounds, "feature_dim": int(len(train_rows[0].features))},
        "metaschedule": {**mean_metrics(per["metaschedule"]), "train_s": rounded(ms_train_s),
                         "feature_s": rounded(feat_s["metaschedule"]),
                         "boost_rounds": int(ms_model.booster.num_boosted_rounds())},
        "per_task": tasks_out,
    }


# ---- 3. updater cost as the store grows ---------------------------------------------------------------


def synthetic_rows(real: list, n: int, rows_per_group: int | None, rng):
    """n rows: the real rows replicated with jitter; rows_per_group None keeps the real workloads, else a new
    workload name every rows_per_group rows."""
    import numpy as np

    from shared.messages import TrainingRow

    out = []
    for i in range(n):
        r = real[i % len(real)]
        f = (np.asarray(r.features) * (1.0 + rng.normal(0.0, 0.02, len(r.features)))).tolist()
        group = r.group if rows_per_group is None else f"{r.group}#{i // rows_per_group}"
        out.append(TrainingRow(group=group, features=f, cost_s=r.cost_s * (1.0 + abs(rng.normal(0.0, 0.05)))))
    return out


def updater_cost(data: dict, work_dir: Path, repeats: int) -> dict:
    import numpy as np

    from services.broker.server import EmbeddedRedis
    from services.tuner import updater
    from services.tuner.metaschedule.cost_model import candidate_vectors
    from shared import names
    from shared.messages import TrainingBatch, TrainingRow
    from shared.settings import UpdaterSettings
    from tvm.s_tir.meta_schedule.feature_extractor import PerStoreFeature

    settings = UpdaterSettings()
    target = lane_target()
    ext = PerStoreFeature(extract_workload=True)
    real = []
    for task in data["tasks"]:
        if not task["records"]:
            continue
        ctx, cands, costs = rebuild(task, target)
        for v, c in zip(candidate_vectors(ext, ctx, cands), costs):
            real.append(TrainingRow(group=task["wkey"], features=v.tolist(), cost_s=c))
    rng = np.random.default_rng(0)
    train_times: list[float] = []
    real_train = updater.train

    def timed_train(*a, **kw):  # the XGBoost part of an ingest, timed apart from the Redis reads and writes
        t0 = time.time()
        try:
            return real_train(*a, **kw)
        finally:
            train_times.append(time.time() - t0)

    updater.train = timed_train
    threads = settings.train_threads or os.cpu_count() or 1
    out = {"window": settings.train_window, "best_per_group": settings.train_best_per_group,
           "best_rows": settings.train_best_rows,
           "boost_rounds": settings.boost_rounds, "threads": threads, "batch_rows": 64, "real_rows": len(real),
           "repeats": repeats, "shapes": {}}
    with EmbeddedRedis(work_dir / "redis") as srv:
        import redis as _redis

        r = _redis.Redis.from_url(srv.url)
        for shape, per_group in (("same_workloads", None), ("growing_workloads", 500)):
            rows_out = []
            for size in SIZES:
                tkey = f"bench-{shape}-{size}"
                stored = synthetic_rows(real, size - 64, per_group, rng)
                for i in range(0, len(stored), 2000):  # filled directly: only the measured update trains
                    chunk = stored[i:i + 2000]
                    r.rpush(names.training_rows_key(tkey), *[x.model_dump_json() for x in chunk])
                    updater.keep_best(r, tkey, chunk, settings.train_best_per_group)
                times, snap = [], None
                train_times.clear()
                for k in range(repeats):
                    batch = TrainingBatch(target_key=tkey, rows=synthetic_rows(real, 64, per_group, rng))
                    t0 = time.time()
                    snap = updater.ingest(r, batch, settings.warmup_rows, settings.boost_rounds,
                                          settings.train_window, settings.train_best_per_group, threads,
                                          settings.train_best_rows)
                    times.append(time.time() - t0)
                rows_out.append({"stored_rows": int(snap.n_rows), "train_rows": int(snap.train_rows),
                                 "groups": len(r.hkeys(names.training_rows_key(tkey) + ":best")),
                                 "update_s": [rounded(t) for t in times], "update_s_median": rounded(statistics.median(times)),
                                 "xgb_train_s_median": rounded(statistics.median(train_times))})
                r.delete(names.training_rows_key(tkey), names.training_rows_key(tkey) + ":best")
                print(f"  updater {shape:18s} stored {snap.n_rows:6d} train rows {snap.train_rows:6d} "
                      f"update {statistics.median(times):6.2f} s (XGBoost {statistics.median(train_times):6.2f} s)",
                      flush=True)
            base = rows_out[0]["update_s_median"]
            out["shapes"][shape] = {"rows": rows_out,
                                    "max_over_1k": rounded(max(x["update_s_median"] for x in rows_out) / base, 2)}
    updater.train = real_train
    out["flat_within_2x"] = out["shapes"]["same_workloads"]["max_over_1k"] <= 2.0
    return out


# ---- report -------------------------------------------------------------------------------------------


def table(rep: dict) -> str:
    c = rep["ranking"]
    cols = ["model", "best@1", "best@5", "best@10", "recall@5", "recall@10", "spearman", "ndcg@10", "train s", "feat s"]
    lines = ["  ".join(f"{x:>12s}" for x in cols)]
    for side in ("ours", "metaschedule"):
        m = c[side]
        cells = [side, m["best_in_top1"], m["best_in_top5"], m["best_in_top10"], m["recall@5"], m["recall@10"],
                 m["spearman"], m["ndcg@10"], m["train_s"], m["feature_s"]]
        lines.append("  ".join(f"{x:>12s}" if isinstance(x, str) else f"{x:12.3f}" if x is not None else f"{'-':>12s}"
                               for x in cells))
    m = c["ours"]
    lines.append(f"{'random':>12s}  {m['random_best_in_top1']:12.3f}  {m['random_best_in_top5']:12.3f}  "
                 f"{m['random_best_in_top10']:12.3f}")
    lines.append(f"{c['ours']['tasks']} tasks, {c['train_rows']} train rows, {c['ours']['held_out_candidates']} held out")
    for shape, s in rep["updater_cost"]["shapes"].items():
        lines.append(f"updater ingest ({shape}): " + ", ".join(
            f"{x['stored_rows']} rows -> {x['update_s_median']} s (train {x['train_rows']})" for x in s["rows"])
            + f"; max/1k {s['max_over_1k']}x")
    lines.append("verdict: " + rep["verdict"])
    return "\n".join(lines)


def verdict(c: dict) -> str:
    o, m = c["ours"], c["metaschedule"]
    score = lambda x: (x["best_in_top1"] + x["best_in_top5"] + x["best_in_top10"]) / 3  # noqa: E731
    so, sm = score(o), score(m)
    faster = "ours" if o["train_s"] <= m["train_s"] else "MetaSchedule's"
    timing = (f"training on the same {c['train_rows']} rows: ours {o['train_s']} s, MetaSchedule {m['train_s']} s "
              f"({faster} faster)")
    if sm > so + 0.1:
        lead = (f"MetaSchedule's XGBModel ranks better here (mean best-in-top-k {sm:.2f} vs ours {so:.2f}, "
                f"{o['tasks']} tasks)")
        if o["tasks"] < 10:
            lead += ", but on so few tasks one task's hit decides it: not a clear difference"
        return f"{lead}; {timing}. Not switched here: the maintainer decides."
    if so > sm + 0.1:
        return f"ours ranks better (mean best-in-top-k {so:.2f} vs {sm:.2f}, {o['tasks']} tasks); {timing}."
    return (f"no clear difference in ranking (mean best-in-top-k ours {so:.2f}, MetaSchedule {sm:.2f}, "
            f"{o['tasks']} tasks); {timing}. Not switched here: the maintainer decides.")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="small_cnn")
    ap.add_argument("--trials", type=int, default=384)
    ap.add_argument("--per-iter", type=int, default=32)
    ap.add_argument("--train-frac", type=float, default=0.6)
    ap.add_argument("--records", default=None, help="JSON of collected records (written, or read with --reuse)")
    ap.add_argument("--reuse", action="store_true", help="read --records instead of tuning")
    ap.add_argument("--repeats", type=int, default=2, help="updater cost: measured updates per size")
    ap.add_argument("--out", default=str(RESULTS / "cost_model_quality.json"))
    args = ap.parse_args(argv)
    os.environ["TVM_NUM_THREADS"] = "1"
    os.environ.pop("REDIS_URL", None)
    work = Path(tempfile.mkdtemp(prefix="cmq_"))
    load_start = os.getloadavg()
    t_all = time.time()
    if args.reuse:
        data = json.loads(Path(args.records).read_text())
    else:
        print(f"[rows] tuning {args.model}, {args.trials} trials, {args.per_iter} a round", flush=True)
        data = collect(args, work)
        if args.records:
            Path(args.records).parent.mkdir(parents=True, exist_ok=True)
            Path(args.records).write_text(json.dumps(data))
    print(f"[rows] {sum(len(t['records']) for t in data['tasks'])} valid records over {len(data['tasks'])} tasks",
          flush=True)
    ranking = compare(data, args.train_frac)
    print("[updater] ingest cost as the store grows", flush=True)
    cost = updater_cost(data, work, args.repeats)
    rep = {
        "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "rows_from": {k: v for k, v in data.items() if k != "tasks"} | {
            "tasks": [{"name": t["name"], "weight": t["weight"], "valid_records": len(t["records"])}
                      for t in data["tasks"]]},
        "ranking": ranking,
        "updater_cost": cost,
        "host": {"cpus": os.cpu_count(), "loadavg_start": load_start, "loadavg_end": os.getloadavg(),
                 "note": "a shared 2-core host: other people's tests may run at the same time (see loadavg)"},
        "notes": [
            "same rows for both models: the job's valid records, per task split by measurement time "
            f"(first {args.train_frac:.0%} train, the rest held out); candidates rebuilt from their traces",
            "MetaSchedule's XGBModel trained once by its own _train (the call its update() ends with) on all "
            "train rows with its per-workload normalisation (group min cost / cost); ours by updater.train",
            "updater cost rows are real rows replicated with jitter, pre-filled straight into Redis; only the "
            "timed 64-row ingest trains",
        ],
        "bench_total_s": rounded(time.time() - t_all),
        "command": command_line("bench.cost_model_quality", argv),
        "code": git_state(),
    }
    rep["verdict"] = verdict(ranking)
    write_report(rep, args.out, table)


if __name__ == "__main__":
    main()

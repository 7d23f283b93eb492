"""The central cost-model updater's pure core: keep every training row, retrain an XGBoost model, publish
a versioned snapshot. Like MetaSchedule's XGBModel, the target is normalised
throughput (the group's best cost / this cost, per workload), and no model is published before a
warm-up number of rows (the tuner samples at random until then). No TVM here: rows are numbers.

The cost of an update is bounded whatever the store holds, in rows and in workloads: a model is trained on
the newest `window` rows plus at most `best_rows` of the fastest rows ever seen of the workloads those rows
belong to (the workloads being tuned now, whose candidates the search must rank; each workload's fastest
first, then each one's second, ...), normalised by each workload's best cost ever seen. Workloads no longer
tuned leave the training set with the window. The store keeps the newest `keep_rows` rows (older ones are
never trained on again) and each workload's fastest: it stays bounded however long the stack runs."""
from __future__ import annotations

import base64
import os
import time
from collections import defaultdict

import numpy as np

from shared import store
from shared.messages import CostModelSnapshot, TrainingBatch, TrainingRow

XGB_PARAMS = {
    "max_depth": 10,
    "gamma": 0.001,
    "min_child_weight": 0,
    "eta": 0.2,
    "objective": "reg:squarederror",
    "nthread": 1,
    "verbosity": 0,
}


TRAIN_WINDOW = 1536  # newest rows a model is trained on
BEST_PER_GROUP = 64  # each workload's fastest rows kept, however old
BEST_ROWS = 512  # of which at most this many join a training set
KEEP_ROWS = 20_000  # newest rows kept in the store
# While more batches wait in the updater's queue, a batch's rows are stored and the training is left to the
# last of them, as long as the published model is younger than this: under several jobs' rounds the updater
# otherwise trains back to back on sets that differ by a round, each model stale before it is published.
DEFER_WHILE_QUEUED_S = 10.0


def normalised_targets(rows: list[TrainingRow], best: dict[str, float] | None = None) -> np.ndarray:
    """best cost of the row's workload / the row's cost; `best` (workload -> best cost ever seen) when the
    rows are a window of the store, else the rows' own best."""
    seen: dict[str, float] = defaultdict(lambda: float("inf"))
    for row in rows:
        seen[row.group] = min(seen[row.group], row.cost_s)
    if best:
        for group, cost in best.items():
            seen[group] = min(seen[group], cost)
    return np.array([seen[r.group] / r.cost_s for r in rows], dtype="float32")


# A row timed by the brief screening window (a candidate well off its task's best) counts this much: its
# figure is noisier, and the search needs the model's ranking most among the contenders, which are timed fully.
BRIEF_WEIGHT = 0.5


def train(rows: list[TrainingRow], rounds: int, best: dict[str, float] | None = None, threads: int = 1) -> bytes:
    import xgboost as xgb

    xs = np.array([r.features for r in rows], dtype="float32")
    params = dict(XGB_PARAMS, nthread=max(1, threads))
    weights = np.array([BRIEF_WEIGHT if r.brief else 1.0 for r in rows], dtype="float32")
    booster = xgb.train(params, xgb.DMatrix(xs, label=normalised_targets(rows, best), weight=weights),
                        num_boost_round=rounds)
    return bytes(booster.save_raw(raw_format="json"))


def keep_best(redis, target_key: str, rows: list[TrainingRow], per_group: int) -> None:
    """Fold new rows into each workload's fastest `per_group` (one updater consumes the queue, so this
    read-modify-write has no concurrent writer)."""
    by_group: dict[str, list[TrainingRow]] = defaultdict(list)
    for r in rows:
        by_group[r.group].append(r)
    for group, new in by_group.items():
        kept = store.best_rows(redis, target_key, group)
        store.put_best_rows(redis, target_key, group, sorted(kept + new, key=lambda r: r.cost_s)[:per_group])


def training_set(redis, target_key: str, window: int, per_group: int,
                 best_rows: int = BEST_ROWS) -> tuple[list[TrainingRow], dict[str, float]]:
    """The newest `window` rows, plus up to `best_rows` kept fastest rows of their workloads not among them
    (round-robin by rank over the workloads, the most recently tuned first); and each workload's best cost."""
    rows = store.newest_training_rows(redis, target_key, window)
    have = {r.model_dump_json() for r in rows}
    recent: dict[str, None] = {}
    for r in reversed(rows):
        recent.setdefault(r.group, None)
    kept = {g: ks[:per_group] for g, ks in store.best_rows_of(redis, target_key, list(recent)).items()}
    best = {g: ks[0].cost_s for g, ks in kept.items() if ks}
    extra: list[TrainingRow] = []
    for rank in range(per_group):
        if len(extra) >= best_rows:
            break
        for g in recent:
            if rank < len(kept.get(g, ())) and kept[g][rank].model_dump_json() not in have:
                extra.append(kept[g][rank])
                if len(extra) >= best_rows:
                    break
    return rows + extra, best


def ingest(redis, batch: TrainingBatch, warmup_rows: int, rounds: int, window: int = TRAIN_WINDOW,
           best_per_group: int = BEST_PER_GROUP, threads: int | None = None,
           best_rows: int = BEST_ROWS, keep_rows: int = KEEP_ROWS, more_queued: bool = False,
           now: float | None = None) -> CostModelSnapshot | None:
    """Append the batch's rows (the newest `keep_rows` stay); retrain and publish when enough rows exist.
    Returns the new snapshot; None before the warm-up, or when the training is left to a batch queued behind
    this one (`more_queued`, while the published model is younger than DEFER_WHILE_QUEUED_S)."""
    good = [r for r in batch.rows if np.isfinite(r.cost_s) and r.cost_s > 0]
    if good:
        store.push_training_rows(redis, batch.target_key, good, keep=max(keep_rows, window))
        keep_best(redis, batch.target_key, good, best_per_group)
    stored = store.training_row_count(redis, batch.target_key)
    if stored < warmup_rows:
        return None
    if more_queued and _fresh(latest_snapshot(redis, batch.target_key), now or time.time()):
        return None
    rows, best = training_set(redis, batch.target_key, window, best_per_group, best_rows)
    dims = {len(r.features) for r in rows}
    if len(dims) != 1:
        return None
    model = train(rows, rounds, best, threads or os.cpu_count() or 1)
    snap = CostModelSnapshot(
        target_key=batch.target_key,
        version=store.next_snapshot_version(redis, batch.target_key),
        n_rows=stored,
        train_rows=len(rows),
        feature_dim=dims.pop(),
        model=base64.b64encode(model).decode("ascii"),
        trained_at=time.time(),
    )
    store.put_snapshot(redis, snap)
    return snap


def _fresh(snap: CostModelSnapshot | None, now: float) -> bool:
    return snap is not None and now - snap.trained_at < DEFER_WHILE_QUEUED_S


def latest_version(redis, target_key: str) -> int:
    return store.snapshot_version(redis, target_key)


def latest_snapshot(redis, target_key: str) -> CostModelSnapshot | None:
    return store.snapshot(redis, target_key)


def load_booster(snap: CostModelSnapshot):
    import xgboost as xgb

    booster = xgb.Booster(params={"nthread": 1})
    booster.load_model(bytearray(base64.b64decode(snap.model)))
    return booster

"""The central cost-model updater's pure core: keep every training row, retrain an XGBoost model on all
of them, publish a versioned snapshot. Like MetaSchedule's XGBModel, the target is normalised
throughput (the group's best cost / this cost, per workload), and no model is published before a
warm-up number of rows (the tuner samples at random until then). No TVM here: rows are numbers."""
from __future__ import annotations

import base64
import time
from collections import defaultdict

import numpy as np

from shared import names
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


def normalised_targets(rows: list[TrainingRow]) -> np.ndarray:
    best: dict[str, float] = defaultdict(lambda: float("inf"))
    for row in rows:
        best[row.group] = min(best[row.group], row.cost_s)
    return np.array([best[r.group] / r.cost_s for r in rows], dtype="float32")


def train(rows: list[TrainingRow], rounds: int) -> bytes:
    import xgboost as xgb

    xs = np.array([r.features for r in rows], dtype="float32")
    booster = xgb.train(XGB_PARAMS, xgb.DMatrix(xs, label=normalised_targets(rows)), num_boost_round=rounds)
    return bytes(booster.save_raw(raw_format="json"))


def ingest(redis, batch: TrainingBatch, warmup_rows: int, rounds: int) -> CostModelSnapshot | None:
    """Append the batch's rows; retrain and publish when enough rows exist. Returns the new snapshot."""
    key = names.training_rows_key(batch.target_key)
    good = [r for r in batch.rows if np.isfinite(r.cost_s) and r.cost_s > 0]
    if good:
        redis.rpush(key, *[r.model_dump_json() for r in good])
    rows = [TrainingRow.model_validate_json(raw) for raw in redis.lrange(key, 0, -1)]
    dims = {len(r.features) for r in rows}
    if len(rows) < warmup_rows or len(dims) != 1:
        return None
    model = train(rows, rounds)
    version = int(redis.incr(names.snapshot_key(batch.target_key) + ":version"))
    snap = CostModelSnapshot(
        target_key=batch.target_key,
        version=version,
        n_rows=len(rows),
        feature_dim=dims.pop(),
        model=base64.b64encode(model).decode("ascii"),
        trained_at=time.time(),
    )
    redis.hset(names.snapshot_key(batch.target_key), mapping={"version": version, "snapshot": snap.model_dump_json()})
    return snap


def latest_version(redis, target_key: str) -> int:
    v = redis.hget(names.snapshot_key(target_key), "version")
    return int(v) if v else 0


def latest_snapshot(redis, target_key: str) -> CostModelSnapshot | None:
    raw = redis.hget(names.snapshot_key(target_key), "snapshot")
    return CostModelSnapshot.parse(raw) if raw else None


def load_booster(snap: CostModelSnapshot):
    import xgboost as xgb

    booster = xgb.Booster(params={"nthread": 1})
    booster.load_model(bytearray(base64.b64decode(snap.model)))
    return booster

"""The central cost model's training rows (bounded), each workload's fastest rows, versioned snapshots."""
from __future__ import annotations

import json

import redis

from shared import names
from shared.messages import CostModelSnapshot, TrainingRow


# ---- cost models ---------------------------------------------------------------------------------------------


def push_training_rows(r: redis.Redis, target_key: str, rows: list[TrainingRow], keep: int | None = None) -> None:
    """Append rows; with `keep`, only the newest `keep` rows of the family stay."""
    if rows:
        key = names.training_rows_key(target_key)
        with r.pipeline() as p:
            p.rpush(key, *[row.model_dump_json() for row in rows])
            if keep is not None:
                p.ltrim(key, -keep, -1)
            p.execute()


def training_row_count(r: redis.Redis, target_key: str) -> int:
    return int(r.llen(names.training_rows_key(target_key)))


def newest_training_rows(r: redis.Redis, target_key: str, n: int) -> list[TrainingRow]:
    return [TrainingRow.model_validate_json(raw) for raw in r.lrange(names.training_rows_key(target_key), -n, -1)]


def best_rows(r: redis.Redis, target_key: str, group: str) -> list[TrainingRow]:
    """A workload group's kept fastest rows, fastest first."""
    raw = r.hget(names.training_best_key(target_key), group)
    return [TrainingRow.model_validate(d) for d in json.loads(raw)] if raw else []


def put_best_rows(r: redis.Redis, target_key: str, group: str, rows: list[TrainingRow]) -> None:
    r.hset(names.training_best_key(target_key), group, json.dumps([row.model_dump() for row in rows]))


def best_rows_of(r: redis.Redis, target_key: str, groups: list[str]) -> dict[str, list[TrainingRow]]:
    """The kept fastest rows of these workload groups only (one read, however many groups the store has)."""
    if not groups:
        return {}
    raws = r.hmget(names.training_best_key(target_key), groups)
    return {g: [TrainingRow.model_validate(d) for d in json.loads(raw)] for g, raw in zip(groups, raws) if raw}


def next_snapshot_version(r: redis.Redis, target_key: str) -> int:
    return int(r.incr(names.snapshot_version_key(target_key)))


def put_snapshot(r: redis.Redis, snap: CostModelSnapshot) -> None:
    r.hset(names.snapshot_key(snap.target_key), mapping={"version": snap.version, "snapshot": snap.model_dump_json()})


def snapshot_version(r: redis.Redis, target_key: str) -> int:
    """The newest published version (0: none yet); cheap, for a client polling for a new model."""
    v = r.hget(names.snapshot_key(target_key), "version")
    return int(v) if v else 0


def snapshot(r: redis.Redis, target_key: str) -> CostModelSnapshot | None:
    raw = r.hget(names.snapshot_key(target_key), "snapshot")
    return CostModelSnapshot.parse(raw) if raw else None

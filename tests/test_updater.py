"""The cost-model updater's core against a real Redis server (no TVM)."""
import numpy as np
import pytest

from shared.messages import TrainingBatch, TrainingRow
from services.tuner import updater


@pytest.fixture
def fresh_redis(tmp_path):
    from services.broker.server import EmbeddedRedis
    from shared import store

    with EmbeddedRedis(tmp_path / "redis") as srv:
        yield store.connect(srv.url)


def test_normalised_targets_per_group():
    rows = [TrainingRow(group="a", features=[0], cost_s=1.0), TrainingRow(group="a", features=[0], cost_s=2.0),
            TrainingRow(group="b", features=[0], cost_s=10.0)]
    assert np.allclose(updater.normalised_targets(rows), [1.0, 0.5, 1.0])


def test_no_snapshot_before_warmup_then_versions_increase(fresh_redis):
    rng = np.random.default_rng(0)

    def batch(n):
        xs = rng.uniform(size=(n, 4))
        return TrainingBatch(target_key="t", rows=[TrainingRow(group="g", features=x.tolist(), cost_s=1e-3 * (1 + x[0]))
                                                   for x in xs])

    assert updater.ingest(fresh_redis, batch(10), warmup_rows=16, rounds=10) is None
    assert updater.latest_snapshot(fresh_redis, "t") is None
    snap = updater.ingest(fresh_redis, batch(10), warmup_rows=16, rounds=20)
    assert snap.version == 1 and snap.n_rows == 20 and snap.feature_dim == 4
    snap2 = updater.ingest(fresh_redis, batch(10), warmup_rows=16, rounds=20)
    assert snap2.version == 2 and snap2.n_rows == 30
    assert updater.latest_version(fresh_redis, "t") == 2
    import xgboost as xgb

    booster = updater.load_booster(updater.latest_snapshot(fresh_redis, "t"))
    pred = booster.predict(xgb.DMatrix(np.array([[0.0, 0.5, 0.5, 0.5], [1.0, 0.5, 0.5, 0.5]], dtype="float32")))
    assert pred[0] > pred[1]  # cheaper (lower x0) candidates score higher: normalised throughput


def test_bad_rows_are_not_kept(fresh_redis):
    b = TrainingBatch(target_key="t2", rows=[TrainingRow(group="g", features=[1.0], cost_s=float("inf")),
                                             TrainingRow(group="g", features=[1.0], cost_s=0.0)])
    updater.ingest(fresh_redis, b, warmup_rows=1, rounds=1)
    assert fresh_redis.llen("st:cm:rows:t2") == 0


def test_training_is_bounded_and_keeps_each_workloads_best(fresh_redis):
    """However many rows the store holds, a model trains on the newest window plus each workload's fastest
    rows, normalised by the best cost ever seen (here an early row far faster than the window's)."""
    rng = np.random.default_rng(1)
    fast = TrainingRow(group="g0", features=[0.0, 0.0], cost_s=1e-6)
    updater.ingest(fresh_redis, TrainingBatch(target_key="b", rows=[fast]), warmup_rows=10**9, rounds=1)
    for _ in range(10):
        rows = [TrainingRow(group=f"g{i % 5}", features=rng.uniform(size=2).tolist(), cost_s=1e-3 * (1 + rng.uniform()))
                for i in range(100)]
        updater.ingest(fresh_redis, TrainingBatch(target_key="b", rows=rows), warmup_rows=10**9, rounds=1)
    rows, best = updater.training_set(fresh_redis, "b", window=50, per_group=3)
    assert fresh_redis.llen("st:cm:rows:b") == 1001  # every row stays in the store
    assert len(rows) <= 50 + 5 * 3
    assert fast in rows and best["g0"] == 1e-6
    targets = updater.normalised_targets(rows, best)
    assert targets[rows.index(fast)] == 1.0 and max(t for r, t in zip(rows, targets) if r.group == "g0" and r != fast) < 0.01
    snap = updater.ingest(fresh_redis, TrainingBatch(target_key="b", rows=rows[:1]), warmup_rows=1, rounds=2,
                          window=50, best_per_group=3, threads=1)
    assert snap.n_rows == 1002 and snap.train_rows <= 50 + 5 * 3


def test_training_set_is_bounded_in_workloads_too(fresh_redis):
    """A store that grows by new workloads (a long-lived deployment) does not grow the training set: only
    the window's workloads bring their kept fastest rows, at most best_rows of them, each workload's fastest
    first."""
    rng = np.random.default_rng(2)
    for g in range(200):  # 200 old workloads, 10 rows each
        rows = [TrainingRow(group=f"old{g}", features=rng.uniform(size=2).tolist(), cost_s=1e-3 * (1 + k))
                for k in range(10)]
        updater.ingest(fresh_redis, TrainingBatch(target_key="w", rows=rows), warmup_rows=10**9, rounds=1)
    now = [TrainingRow(group=f"new{i % 4}", features=rng.uniform(size=2).tolist(), cost_s=1e-3 * (1 + rng.uniform()))
           for i in range(40)]
    early = TrainingRow(group="new0", features=[9.0, 9.0], cost_s=1e-7)  # new0's fastest, older than the window
    updater.ingest(fresh_redis, TrainingBatch(target_key="w", rows=[early]), warmup_rows=10**9, rounds=1)
    updater.ingest(fresh_redis, TrainingBatch(target_key="w", rows=now), warmup_rows=10**9, rounds=1)
    rows, best = updater.training_set(fresh_redis, "w", window=20, per_group=8, best_rows=6)
    assert len(rows) <= 20 + 6
    assert {r.group for r in rows} <= {f"new{i}" for i in range(4)}  # old workloads left with the window
    assert early in rows and best["new0"] == 1e-7  # the first rank of every window workload comes first
    assert set(best) == {f"new{i}" for i in range(4)}


def test_the_store_keeps_the_newest_rows_and_each_workloads_fastest(fresh_redis):
    """A stack that runs for weeks: rows beyond `keep_rows` (never trained on again) leave the store; a
    workload's fastest row, however old, stays among its kept best."""
    from shared import store

    fastest = TrainingRow(group="a", features=[0.0], cost_s=1e-9)
    updater.ingest(fresh_redis, TrainingBatch(target_key="k", rows=[fastest]), warmup_rows=10**9, rounds=1,
                   window=4, keep_rows=6)
    for i in range(10):
        row = TrainingRow(group="a", features=[float(i)], cost_s=1e-3 * (i + 1))
        updater.ingest(fresh_redis, TrainingBatch(target_key="k", rows=[row]), warmup_rows=10**9, rounds=1,
                       window=4, keep_rows=6)
    assert store.training_row_count(fresh_redis, "k") == 6
    assert [r.features[0] for r in store.newest_training_rows(fresh_redis, "k", 6)] == [4.0, 5, 6, 7, 8, 9]
    assert fastest in store.best_rows(fresh_redis, "k", "a")


def test_a_batch_with_more_queued_behind_it_leaves_the_training_to_them_while_the_model_is_fresh(fresh_redis):
    rng = np.random.default_rng(1)

    def batch():
        xs = rng.uniform(size=(8, 4))
        return TrainingBatch(target_key="q", rows=[TrainingRow(group="g", features=x.tolist(), cost_s=1e-3 * (1 + x[0]))
                                                   for x in xs])

    # nothing published yet: a queue behind does not hold back the first model
    first = updater.ingest(fresh_redis, batch(), warmup_rows=8, rounds=5, more_queued=True)
    assert first is not None and first.version == 1
    # a fresh model and more batches waiting: the rows are kept, the training left to the last batch
    assert updater.ingest(fresh_redis, batch(), warmup_rows=8, rounds=5, more_queued=True) is None
    assert updater.latest_version(fresh_redis, "q") == 1
    last = updater.ingest(fresh_redis, batch(), warmup_rows=8, rounds=5, more_queued=False)
    assert last.version == 2 and last.n_rows == 24  # trained on every batch's rows
    # a queue that never empties still gets a model once the published one is older than the bound
    later = last.trained_at + updater.DEFER_WHILE_QUEUED_S + 1
    again = updater.ingest(fresh_redis, batch(), warmup_rows=8, rounds=5, more_queued=True, now=later)
    assert again is not None and again.version == 3

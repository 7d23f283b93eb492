"""One "best": a candidate is ranked by the median of its repeats wherever it is ranked, recorded as
best, exported to TVM's database or shown."""
from __future__ import annotations

import json

import pytest

tvm = pytest.importorskip("tvm")


def _store_with_two_candidates():
    """A workload with two measured candidates: repeats [1, 1, 10] (one burst) and [2, 2, 2]."""
    from tvm.s_tir import meta_schedule as ms

    from fakes import store_with_records
    from services.tuner.metaschedule.records import tuning_record
    from shared import store

    r, mod = store_with_records([("bursty", 8, [1.0, 1.0, 10.0], "full"), ("steady", 4, [2.0, 2.0, 2.0], "full")])
    wl = ms.database.Workload(mod)
    return r, mod, {k: tvm.ir.save_json(tuning_record(v.trace, wl).trace.as_json())
                    for k, v in ((x.candidate_key, x) for x in store.records(r, "w"))}


def test_the_median_ranks_everywhere(tmp_path):
    from tvm.s_tir import meta_schedule as ms

    from services.tuner.metaschedule.records import REPEATS_FILE, export_json_database, ranked, seed_database
    from services.tuner.search import _best_record
    from shared import store
    from shared.ranking import rank_secs

    r, mod, traces = _store_with_two_candidates()
    assert rank_secs([1, 1, 10]) == 1 < rank_secs([2, 2, 2]) == 2  # the mean would say 4 > 2
    assert [x.candidate_key for x in ranked(store.records(r, "w"))] == ["bursty", "steady"]  # re-timing's order
    assert _best_record(r, "w").candidate_key == "bursty"  # the job's result (best_us = 1e6 x the median)

    # TVM's databases rank by the mean of run_secs: what they pick must be our best too
    db_dir, n, kept = export_json_database(r, ["w"], str(tmp_path / "db"))
    assert (n, kept) == (2, 0)
    for db in (ms.database.JSONDatabase(work_dir=db_dir), seed_database(r, ["w"])[0]):
        top = db.get_top_k(db.commit_workload(mod), 2)
        assert [[float(s) for s in t.run_secs] for t in top] == [[1.0], [2.0]]
        assert tvm.ir.save_json(top[0].trace.as_json()) == traces["bursty"]
    repeats = [json.loads(line) for line in (tmp_path / "db" / REPEATS_FILE).read_text().splitlines()]
    assert {x["candidate_key"]: x["run_secs"] for x in repeats} == {"bursty": [1.0, 1.0, 10.0], "steady": [2.0, 2.0, 2.0]}

"""The scale benchmark's idle attribution (pure logic over timeline rows): each idle core-second goes to one cause,
and the lanes' drain after the last build is told apart from a job waiting on them mid-run."""
from __future__ import annotations

import pytest

from sharetune.experiments.throughput import idle_attribution


def _row(t, busy, builder=0.0, tuner=0.0, build_q=0, measure_q=0, lanes=0.0):
    return {"t": float(t), "host_busy_cores": busy, "cores_by_role": {"builder": builder, "tuner": tuner},
            "queued": {"build": build_q, "measure": measure_q}, "lanes_busy": lanes}


def test_idle_seconds_go_to_one_cause_each_and_the_drain_comes_after_the_last_build():
    rows = [_row(1, 4, tuner=4.0),  # the clients' first searches: search-bound
            _row(2, 14, builder=12.0, build_q=30),  # builds queued, 2 cores idle
            _row(3, 10, builder=9.0, lanes=0.9, measure_q=20),  # nothing queued to build: waiting on the lane
            _row(4, 16, builder=14.0, build_q=5),  # full
            _row(5, 3, builder=1.5, tuner=0.5),  # a builder still busy, nothing queued anywhere: starved
            _row(6, 2, lanes=1.0, measure_q=40),  # the last build is done: the lane's drain
            _row(7, 1, lanes=0.8, measure_q=10)]
    got = idle_attribution(rows, cores=16, start=0.5, end=7.0, tuners=4)
    assert got["idle_core_s_by_cause"] == {"drain": 29.0, "builds_waiting": 2.0, "search_bound": 12.0,
                                           "waiting_on_lanes": 6.0, "starved": 13.0}
    assert got["idle_core_s"] == 62.0 and got["drain_from_s"] == 5.0
    assert got["host_busy_frac"] == pytest.approx(50 / (16 * 7), abs=1e-4)
    assert got["host_busy_frac_before_drain"] == pytest.approx(1 - 33 / (16 * 5), abs=1e-4)


def test_a_run_that_builds_to_its_end_has_no_drain():
    rows = [_row(t, 12, builder=10.0, build_q=8) for t in range(1, 5)]
    got = idle_attribution(rows, cores=16, start=0.0, end=4.0, tuners=4)
    assert got["idle_core_s_by_cause"]["drain"] == 0.0
    assert got["idle_core_s_by_cause"]["builds_waiting"] == 16.0 and got["host_busy_frac_before_drain"] == 0.75


def test_the_summary_names_the_worst_rows_busy_share_with_and_without_the_drain():
    from sharetune.experiments.throughput import pipeline_summary

    def row(model, busy, before):
        return {"config": "1gpu-1x100", "model": model, "state": "done", "trials_per_min": 600.0, "cpu_s_per_trial": 1.0,
                "pipeline": {"host_busy_frac": busy, "host_busy_frac_before_drain": before}}

    got = pipeline_summary({"rows": [row("a", 0.71, 0.90), row("b", 0.78, 0.82)], "stocks": {}})
    assert (got["host_cpu_busy_min"], got["host_cpu_busy_min_at"]) == (0.71, "1gpu-1x100/a")
    assert (got["host_cpu_busy_before_drain_min"], got["host_cpu_busy_before_drain_min_at"]) == (0.82, "1gpu-1x100/b")

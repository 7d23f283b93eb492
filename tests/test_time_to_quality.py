"""The time-to-quality benchmark's arithmetic (estimated model latency over time, time to a latency) and its
panel: pure logic and model construction, no stack."""
from __future__ import annotations

import pytest

from sharetune.experiments.time_to_quality import (heaviest_task_landed, latency_curve, seed_tasks, summarise_model,
                                                   time_to_reach, untuned_estimate)


def test_the_estimate_counts_an_unmeasured_task_at_its_default_and_only_improvements():
    weights, defaults = {"conv": 2, "dense": 1}, {"conv": 10.0, "dense": 4.0}
    assert untuned_estimate(weights, defaults) == 24.0
    events = [(3.0, "dense", 5.0), (1.0, "conv", 6.0), (2.0, "conv", None), (4.0, "conv", 8.0), (5.0, "dense", 1.0)]
    curve = latency_curve(events, weights, defaults)
    # in time order; a failed trial and a slower one change nothing; a slower-than-default one neither
    assert [(t, n) for t, n, _ in curve] == [(1.0, 1), (2.0, 2), (3.0, 3), (4.0, 4), (5.0, 5)]
    assert [e for _, _, e in curve] == [16.0, 16.0, 16.0, 16.0, 13.0]


def test_trials_committed_at_the_same_second_keep_their_order_even_when_one_failed():
    # stock commits a task's records together: one timestamp, a failed trial (None) beside timed ones
    events = [(2.0, "conv", 6.0), (2.0, "conv", None), (2.0, "conv", 5.0), (1.0, "dense", 3.0)]
    curve = latency_curve(events, {"conv": 1, "dense": 1}, {"conv": 10.0, "dense": 4.0})
    assert [e for _, _, e in curve] == [13.0, 9.0, 9.0, 8.0]


def test_stock_compiles_its_best_trial_even_where_the_default_schedule_is_faster():
    events = [(1.0, "norm", 12.0), (2.0, "norm", 9.0)]
    guarded = latency_curve(events, {"norm": 1}, {"norm": 5.0})
    stock = latency_curve(events, {"norm": 1}, {"norm": 5.0}, keeps_default=False)
    assert [e for _, _, e in guarded] == [5.0, 5.0]
    assert [e for _, _, e in stock] == [12.0, 9.0]


def test_a_task_without_a_default_counts_at_its_first_valid_trial():
    curve = latency_curve([(1.0, "a", 3.0), (2.0, "b", 9.0), (3.0, "b", 2.0)], {"a": 1, "b": 1}, {"a": 5.0})
    assert [e for _, _, e in curve] == [12.0, 12.0, 5.0]


def test_time_to_reach_is_the_first_point_at_or_below_the_target():
    curve = [(1.0, 1, 9.0), (2.0, 2, 5.0), (7.0, 3, 4.0)]
    assert time_to_reach(curve, 5.0) == (2.0, 2)
    assert time_to_reach(curve, 3.0) == (None, None)


def test_the_summary_compares_each_run_with_stock_and_the_warm_run_with_the_cold_one():
    weights, defaults = {"t": 1}, {"t": 10e-6}
    row = {"stock": {"wall_s": 100.0, "events": [[50.0, "t", 6e-6], [90.0, "t", 5e-6]], "weights": weights},
           "cold": {"events": [[1.0, "t", 7e-6], [4.0, "t", 5e-6], [8.0, "t", 4e-6]], "weights": weights,
                    "defaults": defaults, "search_cpu_s_per_valid_candidate": 0.2},
           "warm": {"events": [[1.0, "t", 4e-6], [2.0, "t", 3.9e-6]], "weights": weights, "defaults": defaults,
                    "search_cpu_s_per_valid_candidate": 0.3},
           "served": {"latency_us": {"stock": 10.0, "cold": 6.0, "warm": 5.0, "untuned": 20.0}}}
    summarise_model(row)
    s = row["summary"]
    # the search CPU goal is the worse of the two runs' (the warm run's evolutionary rounds cost more)
    assert (s["search_cpu_s_per_valid_candidate"], s["search_cpu_s_per_valid_candidate_run"]) == (0.3, "warm")
    assert s["cold_time_to_stock_latency_s"] == 4.0 and s["cold_time_to_stock_latency_ratio"] == 0.04
    assert s["warm_time_to_stock_latency_s"] == 1.0
    assert s["warm_trials_ratio"] == round(1 / 3, 4)  # the cold run's final 4 us: warm's first trial
    assert s["latency_vs_stock_equal_trials"] == 0.6 and s["never_slower_than_untuned"] is True
    assert s["untuned_estimate_us"] == 10.0


@pytest.mark.parametrize("name", ["efficientnet-mbconv", "regnety-stage", "vit-s-encoder", "wav2vec2-conv"])
def test_each_panel_model_builds_into_6_to_15_cuda_tasks(name):
    pytest.importorskip("transformers")
    from bench.panel import build
    from services.measurer.metaschedule.targets import family_target
    from services.tuner.metaschedule.extract import extract
    from sharetune.intake import to_relax

    module, inputs = build(name)
    tasks = extract(to_relax(module, inputs).mod, family_target("cuda.sm_90"))
    assert 6 <= len(tasks) <= 15


def test_the_heaviest_task_lands_at_its_first_fully_timed_record():
    weights, defaults = {"dw": 1, "bn": 4, "pw": 1}, {"dw": 31e-6, "bn": 3.5e-6, "pw": 12e-6}
    events = [(2.0, "pw", 9e-6), (5.0, "dw", None), (9.5, "dw", 20e-6), (12.0, "dw", 18e-6)]
    assert heaviest_task_landed(events, weights, defaults) == ("dw", 9.5)  # a brief timing does not count
    assert heaviest_task_landed(events, {"dw": 1, "bn": 10, "pw": 1}, defaults) == ("bn", None)  # 35 us, none yet
    assert heaviest_task_landed(events, weights, {}) == (None, None)


def test_the_search_cpu_is_split_between_evolution_and_sampling_per_candidate_each_proposed():
    from sharetune.experiments.time_to_quality import search_cpu_split

    splits = [{"sample_cpu": 10.0, "evolve_cpu": 6.0, "evolved": 60, "drawn": 100},
              {"sample_cpu": 2.0, "evolve_cpu": 0.0, "evolved": 0, "drawn": 100}]
    got = search_cpu_split(splits)
    assert got["evolve_cpu_s_per_candidate"] == 0.1 and got["sample_cpu_s_per_candidate"] == 0.03
    assert (got["evolved_candidates"], got["drawn_candidates"]) == (60, 200)
    assert search_cpu_split([{"sample_cpu": 1.0}]) == {}  # splits from before the split: nothing made up


def test_a_row_is_compared_with_its_strict_control_on_rate_lane_time_and_time_to_the_slower_final():
    from sharetune.experiments.throughput import estimated_us, variant_pairs

    weights, defaults = {"a": 1, "b": 2}, {"a": 3e-6, "b": 4e-6}
    row = {"config": "1gpu-1x100", "model": "m", "trials_per_min": 600.0, "lane_s_per_candidate_mean": 0.05,
           "quality": {"events": [(1.0, "a", 2e-6), (2.0, "b", 1e-6), (3.0, "b", None)], "weights": weights,
                       "defaults": defaults}}
    ctl = {"config": "1x100-strict", "model": "m", "trials_per_min": 400.0, "lane_s_per_candidate_mean": 0.09,
           "quality": {"events": [(1.5, "b", 2e-6), (4.0, "a", 2.5e-6)], "weights": weights, "defaults": defaults}}
    assert estimated_us(row) == pytest.approx(4.0) and estimated_us(ctl) == pytest.approx(6.5)
    pair = variant_pairs([row, ctl, {"config": "1gpu-4x25", "model": "m"}], "-strict")["m"]
    assert pair["trials_per_min"] == {"default": 600.0, "strict": 400.0}
    assert pair["estimated_latency_ratio"] == pytest.approx(4.0 / 6.5, abs=1e-4)
    # the slower final (6.5 µs): the default row's estimate is 2 + 8 = 10 at 1 s, 2 + 2 = 4 at 2 s
    assert pair["seconds_to_slower_final"] == {"default": 2.0, "strict": 4.0}
    assert variant_pairs([row], "-strict") == {} and estimated_us({"config": "x"}) is None


def test_a_served_module_whose_output_is_not_the_models_is_flagged_and_meets_no_goal():
    """A tuned module with NaN in its output (a kernel TVM lowered wrongly can win its task: nothing checks what
    a timed kernel computes) or far from the reference is wrong; its latency is no tuned latency."""
    from sharetune.experiments.time_to_quality import settings_ab, summarise, wrong_outputs

    assert wrong_outputs({"max_abs_err": {"untuned": 4.9e-6, "stock": 4.9e-6, "cold": 5.2e-6, "warm": 3e-3}}) == ["warm"]
    assert wrong_outputs({"max_abs_err": {"untuned": 4.9e-6, "cold": float("nan")}}) == ["cold"]
    assert wrong_outputs({"max_abs_err": {"untuned": 0.0, "cold": 5e-5}}) == []  # under the floor
    assert wrong_outputs({"max_abs_err": {"cold": None}}) == ["cold"] and wrong_outputs({}) == []
    weights, defaults = {"t": 1}, {"t": 10e-6}
    row = {"stock": {"wall_s": 100.0, "events": [[50.0, "t", 6e-6]], "weights": weights},
           "cold": {"events": [[1.0, "t", 4e-6]], "weights": weights, "defaults": defaults,
                    "wall_s": 10.0, "trials": 1},
           "served": {"latency_us": {"stock": 10.0, "cold": 6.0, "untuned": 20.0},
                      "max_abs_err": {"stock": 4.9e-6, "cold": float("nan"), "untuned": 4.9e-6}}}
    summarise_model(row)
    assert row["summary"]["wrong_output"] == ["cold"] and "latency_vs_stock_equal_trials" not in row["summary"]
    assert summarise({"models": {"m": row}})["wrong_output"] == {"m": ["cold"]}
    ab = settings_ab([("on", {"models": {"m": row}})], "m")
    assert ab["runs"][0]["wrong_output"] == ["cold"] and ab["runs"][0]["max_abs_err"]["cold"] == "nan"
    assert ab["summary"]["runs_with_wrong_output"] == {"on": 1}


def test_an_ab_of_settings_keeps_each_run_and_means_each_figure_per_value():
    from sharetune.experiments.time_to_quality import settings_ab

    def run(best_mm: float | None, served: float, cpu: float) -> dict:
        events = [(1.0, "mm", None), (2.0, "mm", best_mm), (3.0, "ln", 3e-6)]
        cold = {"events": events, "weights": {"mm": 2, "ln": 1}, "defaults": {"mm": 10e-6, "ln": 4e-6},
                "wall_s": 30.0, "trials": 3, "lease": "l", "search_cpu_s_per_valid_candidate": cpu,
                "launch_floor_us": 3.6}
        return {"models": {"m": {"cold": cold, "served": {"latency_us": {"cold": served, "untuned": 30.0,
                                                                         "stock": 40.0}}}}}

    ab = settings_ab([("matmul", run(6e-6, 20.0, 0.2)), ("off", run(None, 26.0, 0.1)),
                      ("matmul", run(8e-6, 22.0, 0.3))], "m")
    assert [r["label"] for r in ab["runs"]] == ["matmul", "off", "matmul"]
    first = ab["runs"][0]
    assert first["final_estimate_us"] == 15.0 and first["untuned_estimate_us"] == 24.0
    assert first["tasks"]["mm"] == {"untuned_us": 10.0, "best_us": 6.0, "trials": 2}
    assert first["launch_floor_us"] == 3.6  # what the gradients counted from
    assert ab["runs"][1]["tasks"]["mm"]["best_us"] is None  # no fully timed trial: none, not the default
    s = ab["summary"]
    assert s["final_estimate_us"] == {"matmul": 17.0, "off": 23.0}  # off: the default kept where faster
    assert s["served_cold_us"] == {"matmul": 21.0, "off": 26.0}
    assert s["served_cold_vs_stock"] == {"matmul": 0.525, "off": 0.65}  # each run against stock in its process
    assert s["search_cpu_s_per_valid_candidate"] == {"matmul": 0.25, "off": 0.1}
    assert s["mm_best_us"] == {"matmul": 7.0, "off": None} and "ln_best_us" not in s  # heavy tasks only


def test_a_row_records_the_sharetune_settings_its_services_ran_under_and_no_secret():
    from sharetune.experiments.time_to_quality import settings_in_effect

    env = {"SHARETUNE_COLUMN_REDUCTIONS": "wide", "SHARETUNE_REDIS_PASSWORD": "x", "SHARETUNE_API_TOKEN": "y",
           "PATH": "/bin", "SHARETUNE_EVOLUTION_SCREEN": "1"}
    assert settings_in_effect(env) == {"SHARETUNE_COLUMN_REDUCTIONS": "wide", "SHARETUNE_EVOLUTION_SCREEN": "1"}


def test_each_seeded_task_reports_its_best_seed_beside_its_best_trial():
    events = [(1.0, "mm", 20e-6), (1.1, "mm", None), (2.0, "mm", 8e-6), (3.0, "conv", 5e-6)]
    got = seed_tasks({"mm": [20e-6, None], "ln": [None]}, events)
    assert got == {"mm": {"seeds": 2, "best_seed_us": 20.0, "task_best_us": 8.0},
                   "ln": {"seeds": 1, "best_seed_us": None, "task_best_us": None}}


def test_each_runs_kernels_come_from_its_best_record_a_workload_and_are_named_by_stocks_tasks(tmp_path):
    """Stock's database holds every trial: the kernel timed is the record its compile applies (lowest mean seconds,
    failed trials left out); a kernel is named by stock's task of the same structural hash."""
    import json

    from sharetune.experiments.time_to_quality import best_record_db, kernel_names, run_databases

    src = tmp_path / "stock"
    src.mkdir()
    (src / "database_workload.json").write_text('[111, {}]\n[222, {}]\n')
    recs = [[0, ["t-a", [3e-6, 3e-6], "x", []]], [0, ["t-b", [2e-6, 2.2e-6], "x", []]],
            [0, ["t-c", [1e10], "x", []]], [1, ["t-d", [5e-6], "x", []]]]
    (src / "database_tuning_record.json").write_text("".join(json.dumps(r) + "\n" for r in recs))
    best = best_record_db(src, tmp_path / "best")
    kept = [json.loads(line) for line in (best / "database_tuning_record.json").read_text().splitlines()]
    assert [(i, r[0]) for i, r in kept] == [(0, "t-b"), (1, "t-d")]
    lines = (best / "database_workload.json").read_text().splitlines()
    named = kernel_names({"stock": {"0": 2.04, "1": 5.1}, "cold": {"0": 1.5}}, {"stock": lines, "cold": lines[1:]},
                         [{"name": "conv2d4", "shash": "111"}, {"name": "mean", "shash": "222"}])
    assert named == {"stock": {"conv2d4": 2.04, "mean": 5.1}, "cold": {"mean": 1.5}}
    exported = tmp_path / "export"
    exported.mkdir()
    row = {"cold": {"database_dir": str(exported)}, "warm": {"database_dir": str(tmp_path / "gone")}}
    assert run_databases(row, src, lambda phase: None) == {"stock": src, "cold": exported}
    (tmp_path / "kept" / "database").mkdir(parents=True)
    assert run_databases(row, None, lambda phase: tmp_path / "kept")["warm"] == tmp_path / "kept" / "database"


def test_a_run_s_database_lines_are_every_trial_for_stock_and_the_fully_timed_ones_for_an_export():
    from sharetune.experiments.time_to_quality import curve_steps, event_lines

    events = [(1.0, "a", 5.0), (2.0, "a", None), (3.0, "b", 4.0), (4.0, "a", 3.0), (5.0, "a", 4.0)]
    assert event_lines(events, every_trial=True) == [0, 1, 2, 3, 4]
    assert event_lines(events, every_trial=False) == [0, None, 1, 2, 3]
    # the records that were their task's best when measured: what the module would run had the run stopped there
    assert curve_steps(events, event_lines(events, every_trial=False)) == {0: "a", 1: "b", 2: "a"}


def test_a_retimed_curve_counts_each_tasks_kernel_in_effect_at_its_common_timing():
    """The kernel in effect is chosen by the run's own timings (a run's best so far); its figure is the one all the
    runs' kernels got in one process, and the guarded run keeps the default where the common timing says so."""
    from sharetune.experiments.time_to_quality import event_lines

    weights, defaults = {"conv": 1, "norm": 1}, {"conv": 10e-6, "norm": 3e-6}
    # the norm's only trial looked faster than its default on a loaded host; timed again it is slower
    events = [(1.0, "norm", 2.5e-6), (2.0, "conv", 6e-6), (3.0, "conv", 7e-6), (4.0, "conv", 4e-6)]
    lines = event_lines(events, every_trial=False)
    again = {"steps": {"0": 3.4, "1": 6.5, "3": 5.0}, "defaults": {"conv": 9.0, "norm": 3.1}}
    curve = latency_curve(events, weights, defaults, lines=lines, retimed=again)
    assert [round(e * 1e6, 3) for _, _, e in curve] == [12.1, 9.6, 9.6, 8.1]
    # stock compiles its best trial, default or not; a kernel without a common timing keeps its own figure
    stock = latency_curve(events, weights, defaults, keeps_default=False, lines=event_lines(events, every_trial=True),
                          retimed={"steps": {"0": 3.4, "3": 5.0}, "defaults": {"conv": 9.0}})
    assert [round(e * 1e6, 3) for _, _, e in stock] == [12.4, 9.4, 9.4, 8.4]


def test_the_summary_gives_the_retimed_curves_figures_beside_the_runs_own():
    from sharetune.experiments.time_to_quality import summarise

    weights, defaults = {"t": 1}, {"t": 10e-6}
    row = {"stock": {"wall_s": 100.0, "events": [[50.0, "t", 6e-6], [90.0, "t", 5e-6]], "weights": weights},
           "cold": {"events": [[1.0, "t", 7e-6], [4.0, "t", 4e-6]], "weights": weights, "defaults": defaults},
           "warm": {"events": [[1.0, "t", 4.5e-6], [2.0, "t", 4.2e-6]], "weights": weights, "defaults": defaults},
           # timed again together: cold's 4 us kernel is 5.5, warm's first 4.8, stock's best 6.0
           "retimed": {"stock": {"steps": {"0": 7.0, "1": 6.0}, "defaults": {"t": 10.0}},
                       "cold": {"steps": {"0": 7.5, "1": 5.5}, "defaults": {"t": 10.0}},
                       "warm": {"steps": {"0": 4.8, "1": 5.2}, "defaults": {"t": 10.0}}}}
    summarise_model(row)
    s = row["summary"]
    assert s["warm_trials_ratio"] is None  # by the runs' own timings warm never reached cold's 4 us
    assert s["retimed_cold_final_estimate_us"] == 5.5 and s["retimed_warm_final_estimate_us"] == 5.2
    assert s["retimed_warm_trials_ratio"] == 0.5 and s["retimed_cold_time_to_stock_latency_ratio"] == 0.04
    assert row["curves_retimed"]["stock"][-1][2] == 6.0
    panel = summarise({"models": {"m": row}})
    assert panel["retimed_warm_trials_ratio"] == 0.5 and panel["models_retimed"] == 1
    from sharetune.experiments.time_to_quality import markdown_table

    assert "| 4.2 (5.2) |" in markdown_table({"models": {"m": row}})  # each run's final estimate, re-timed beside it


def test_the_warm_run_is_served_at_a_quarter_of_the_cold_runs_trials_and_compared_with_the_cold_module(tmp_path):
    from sharetune.experiments.time_to_quality import summarise, trial_cuts

    (tmp_path / "cold" / "records_db").mkdir(parents=True)
    (tmp_path / "warm" / "records_db").mkdir(parents=True)
    row = {"stock": {"trials": 300}, "cold": {"trials": 384}, "warm": {"trials": 384}}
    cuts = trial_cuts(row, lambda phase: tmp_path / phase)
    assert cuts == {"cold_at_stock_trials": (tmp_path / "cold" / "records_db", 300),
                    "warm_at_quarter": (tmp_path / "warm" / "records_db", 96)}
    # nothing kept to cut from, or a stock run as long as the cold one: no module
    assert trial_cuts(row, lambda phase: None) == {}
    assert list(trial_cuts({**row, "stock": {"trials": 400}}, lambda phase: tmp_path / phase)) == ["warm_at_quarter"]
    weights, defaults = {"t": 1}, {"t": 10e-6}
    row = {"cold": {"events": [[1.0, "t", 5e-6]], "weights": weights, "defaults": defaults},
           "warm": {"events": [[1.0, "t", 4e-6]], "weights": weights, "defaults": defaults},
           "served": {"latency_us": {"cold": 40.0, "warm": 39.0, "warm_at_quarter": 41.0}}}
    summarise_model(row)
    assert row["summary"]["warm_quarter_vs_cold_latency"] == 1.025
    assert summarise({"models": {"m": row}})["warm_quarter_vs_cold_latency"] == 1.025
    from sharetune.experiments.time_to_quality import markdown_table

    assert "| m | warm, first quarter | 0 | - | - | - | 41.0 (1.025x cold's) |" in markdown_table({"models": {"m": row}})

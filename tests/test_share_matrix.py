"""The matrix's pure logic on recorded matrices: normalisation, the robust share, the knee, the share
list's validation. No processes, no TVM."""
import json

import pytest

from shared.errors import ShareError
from sharetune.experiments.share_matrix import (NOISE, ShareMatrix, bootstrap_ci, compare, cores_for_share, cross_costs,
                                    default_trials, diagonal_wins, fit_trials, good_range, knee, normalise,
                                    parse_shares, robust_choice, shares_from_cores)

SHARES = [10, 25, 50, 100]
# A paper-like matrix (µs, rows tuned at, columns served at): each column is won by its diagonal, tuning
# at 25 % stays within 5 % of the best from 10 to 50 %, and serving past 50 % gains under 5 %.
RECORDED = [
    [1000.0, 520.0, 330.0, 350.0],
    [1040.0, 500.0, 310.0, 320.0],
    [1200.0, 540.0, 300.0, 295.0],
    [1500.0, 700.0, 340.0, 290.0],
]


def test_each_column_is_normalised_to_its_best():
    norm = normalise(RECORDED)
    assert [min(row[s] for row in norm) for s in range(4)] == [1.0] * 4
    assert norm[1][0] == pytest.approx(1.04)
    assert norm[3][0] == pytest.approx(1.5)
    assert norm[2][3] == pytest.approx(295 / 290)


def test_recommended_share_is_the_widest_range_within_tolerance():
    share, rows = robust_choice(SHARES, RECORDED)
    assert share == 25
    by_share = {r["tuned_share"]: r for r in rows}
    assert by_share[25]["range"] == [10, 50]
    assert by_share[10]["range"] == [10, 25]
    assert by_share[50]["range"] == [50, 100]
    assert by_share[100]["range"] == [100, 100]


def test_knee_is_where_serving_stops_improving():
    assert knee(SHARES, RECORDED) == 50
    # still improving by more than 5 % at every step: the knee is the largest share
    assert knee([25, 50, 100], [[400.0, 300.0, 200.0]] * 3) == 100
    # flat from the start
    assert knee([25, 50, 100], [[100.0, 99.0, 98.0]] * 3) == 25


def test_range_must_be_contiguous():
    # within tolerance at 10, 25 and 100 but not 50: its widest range is 10..25, not three shares
    assert good_range([1.0, 1.02, 1.2, 1.0]) == (0, 1)
    assert good_range([1.2, 1.3]) is None


def test_ties_go_to_more_cells_within_then_lower_mean_then_smaller_share():
    lat = [[100.0, 200.0, 130.0],   # x1, x1, x1.3: range 25..50
           [130.0, 200.0, 100.0],   # x1.3, x1, x1: range 50..100, same length, same count, same mean
           [100.0, 260.0, 100.0]]   # x1, x1.3, x1: two cells within but not contiguous: range of one
    share, rows = robust_choice([25, 50, 100], lat)
    assert [r["range_len"] for r in rows] == [2, 2, 1]
    assert share == 25  # full tie: the smaller share
    lat[1][0] = 120.0  # now row 50 has the lower mean normalised latency
    assert robust_choice([25, 50, 100], lat)[0] == 50


def test_failed_cells_are_not_counted_and_the_rest_still_recommends():
    lat = [row[:] for row in RECORDED]
    lat[1] = [None, None, None, None]  # the 25 % job failed
    m = ShareMatrix.build("resnet18", "gpu", SHARES, lat, errors={"25@*": "tuning job x timeout"})
    assert not m.complete
    assert m.normalised[1] == [None] * 4
    assert m.normalised[0][1] == pytest.approx(1.0)  # the 10 % model is now the best served at 25 %
    assert m.recommended_share in (10, 50)
    assert "failed" in m.table() and "25@*" in m.table()


def test_json_round_trip_and_shape_check():
    m = ShareMatrix.build("transformer", "gpu", SHARES, RECORDED)
    again = ShareMatrix.model_validate_json(m.model_dump_json())
    assert again == m
    body = json.loads(m.model_dump_json())
    assert body["latency_us"][0][0] == 1000.0 and body["recommended_share"] == 25 and body["knee_share"] == 50
    assert all(d["diagonal_wins"] for d in body["diagonal"])
    with pytest.raises(ValueError, match="4 x 4"):
        ShareMatrix(model="m", device="gpu", shares=SHARES, latency_us=RECORDED[:3])


def rounds_around(matrix, spread=0.005, n=30):
    """Serving rounds scattered +-spread around each cell (seeded): what a quiet device gives."""
    import numpy as np

    rng = np.random.default_rng(1)
    return [[list(v * (1 + rng.uniform(-spread, spread, n))) for v in row] for row in matrix]


def test_table_names_the_recommendation_the_diagonal_and_the_intervals():
    m = ShareMatrix.build("resnet18", "gpu", SHARES, RECORDED, rounds_us=rounds_around(RECORDED), tasks_tuned="all",
                          trials_per_share=704)
    text = m.table()
    assert "recommended tuning share: 25 %" in text and "knee of serving latency: 50 %" in text
    assert "served at 10 %: tuning here wins by 3.9 % [3.7, 4.1] % over tuning at 25 %" in text
    assert "tasks tuned: all, 704 trials a share" in text
    lo, hi = m.ci95_us[0][0]
    assert f"[{lo:.0f}-{hi:.0f}]" in text
    assert "served at 100 %, the model tuned at 25 % is 1.10x slower than the one tuned at 100 %" in text
    assert "served at 25 %, the model tuned at 100 % is 1.40x slower than the one tuned at 25 %" in text


def test_without_rounds_there_are_no_intervals_and_no_claims():
    m = ShareMatrix.build("resnet18", "gpu", SHARES, RECORDED)
    assert m.ci95_us == [[None] * 4] * 4
    assert set(m.diagonal_wins.values()) == {NOISE}
    assert "tuned-at-same-share wins" not in m.table()


def test_bootstrap_interval_is_seeded_and_holds_the_median():
    import numpy as np

    x = list(np.random.default_rng(3).normal(100.0, 2.0, 40))
    a, b = bootstrap_ci(x), bootstrap_ci(x)
    assert a == b  # fixed seed
    assert a[0] < float(np.median(x)) < a[1]
    assert a[1] - a[0] < 4.0  # the median's interval is much narrower than the spread of the rounds
    wide = bootstrap_ci(list(np.random.default_rng(3).normal(100.0, 20.0, 40)))
    assert wide[1] - wide[0] > a[1] - a[0]
    assert bootstrap_ci([5.0]) is None and bootstrap_ci([]) is None
    assert bootstrap_ci([7.0, 7.0, 7.0]) == [7.0, 7.0]


def test_compare_claims_only_separated_intervals():
    assert compare([1, 2], [3, 4]) is True
    assert compare([3, 4], [1, 2]) is False
    assert compare([1, 3], [2, 4]) == NOISE
    assert compare(None, [1, 2]) == NOISE


def test_diagonal_wins_true_false_and_within_noise():
    shares = [25, 50, 100]
    lat = [[100.0, 80.0, 60.0],
           [120.0, 70.0, 61.0],
           [130.0, 75.0, 40.0]]
    ci = [[[98, 102], [78, 82], [58, 62]],
          [[118, 122], [68, 72], [59, 63]],
          [[128, 132], [74, 76], [39, 41]]]
    # 25: the diagonal beats both others clearly; 50: the diagonal [68,72] overlaps nobody -> wins too
    assert diagonal_wins(shares, lat, ci) == {"25": True, "50": True, "100": True}
    ci[2][1] = [70, 76]  # tuned at 100 % served at 50 % now overlaps the diagonal
    lat[0][2], ci[0][2] = 35.0, [34, 36]  # tuned at 25 % is clearly faster at 100 %: the diagonal loses
    wins = diagonal_wins(shares, lat, ci)
    assert wins == {"25": True, "50": NOISE, "100": False}
    lat[1] = [None, None, None]  # the 50 % job failed: its diagonal cannot be judged
    assert diagonal_wins(shares, lat, ci)["50"] is None
    assert json.loads(json.dumps(wins)) == {"25": True, "50": "within noise", "100": False}


def test_cross_costs_both_ways():
    lat = [[100.0, 90.0], [150.0, 60.0]]
    ci = [[[99, 101], [89, 91]], [[148, 152], [59, 61]]]
    costs = cross_costs([25, 100], lat, ci)
    assert costs["serve_full"] == [{"tuned_share": 25, "served_share": 100, "reference_tuned_share": 100,
                                    "slowdown": 1.5, "separated": True}]
    assert costs["tuned_full"][0]["slowdown"] == 1.5 and costs["tuned_full"][0]["served_share"] == 25
    ci[0][1] = [55, 95]
    assert cross_costs([25, 100], lat, ci)["serve_full"][0]["separated"] is False
    lat[1][1] = None
    assert cross_costs([25, 100], lat, ci)["serve_full"][0]["slowdown"] is None


def test_json_carries_intervals_verdicts_and_advice():
    import numpy as np

    rounds = rounds_around(RECORDED)
    medians = [[float(np.median(r)) for r in row] for row in rounds]  # a cell's figure is its rounds' median
    m = ShareMatrix.build("transformer", "gpu", SHARES, medians, rounds_us=rounds, tasks_tuned="all",
                          trials_per_share=544)
    body = json.loads(m.model_dump_json())
    assert body["tasks_tuned"] == "all" and body["trials_per_share"] == 544
    assert len(body["ci95_us"]) == 4 and all(lo <= v <= hi for row, crow in zip(body["latency_us"], body["ci95_us"])
                                             for v, (lo, hi) in zip(row, crow))
    assert body["diagonal_wins"] == {"10": True, "25": True, "50": True, "100": True}
    assert body["advice"]["recommended_share"] == 25 and body["advice"]["knee_share"] == 50
    assert [c["tuned_share"] for c in body["advice"]["serve_full"]] == [10, 25, 50]
    assert ShareMatrix.model_validate(body) == m


def test_budget_scales_with_the_model_and_every_task_gets_its_round():
    assert default_trials(3) == 256 and default_trials(8) == 256 and default_trials(22) == 704
    from services.tuner.allocation import first_round_size

    assert first_round_size(704, 22, 64) == 32  # 704 < 64 x 22: each task's first round its even part
    assert first_round_size(256, 3, 64) == 64  # a full round each fits


def test_fit_trials_fits_the_time():
    small = fit_trials(22, 3, 375)
    assert small > 0 and small % 8 == 0
    assert fit_trials(22, 4, 375) < small  # a fourth share leaves less for each
    assert fit_trials(17, 3, 375) > small  # fewer tasks, fewer rounds
    assert fit_trials(22, 3, 60) == 0  # not even the fixed part fits


@pytest.mark.parametrize("spec, why", [
    ("", "not a share list"),
    ("25,,50", "not a share list"),
    ("25,half", "whole percentages"),
    ("0,50", "outside 1..100"),
    ("50,101", "outside 1..100"),
    ("25,50,25", "more than once"),
    ("50", "at least two shares"),
    ([25, 50.5], "whole percentages"),
    ([True, 50], "whole percentages"),
])
def test_bad_share_lists_are_refused_clearly(spec, why):
    with pytest.raises(ShareError, match=why):
        parse_shares(spec)


def test_share_lists_are_sorted_and_may_carry_percent_signs():
    assert parse_shares("100, 25%,50") == [25, 50, 100]


def test_cpu_shares_are_whole_cores():
    assert parse_shares("50,100", "cpu", host_cores=2) == [50, 100]
    assert cores_for_share(50, 2) == 1 and cores_for_share(100, 2) == 2
    assert shares_from_cores("1,2", host_cores=2) == [50, 100]
    assert shares_from_cores([1, 3], host_cores=4) == [25, 75]
    with pytest.raises(ShareError, match="whole number of cores.*30 %"):
        parse_shares("30,100", "cpu", host_cores=2)
    with pytest.raises(ShareError, match="outside 1..2"):
        shares_from_cores("1,4", host_cores=2)


def test_lanes_and_serving_placement_per_share():
    from sharetune.experiments.share_matrix import Placement

    cpu = Placement("cpu", host_cores=4)
    assert cpu.lanes([25, 50, 100]) == ["measure.cpu.local.p25.c0", "measure.cpu.local.p25.c1",
                                        "measure.cpu.local.p25.c2", "measure.cpu.local.p25.c3",
                                        "measure.cpu.local.p50.c0-1", "measure.cpu.local.p50.c2-3",
                                        "measure.cpu.local.p100.c0-3"]
    args, env = cpu.serve_args(50)
    assert args[-2:] == ["--cores", "0,1"] and env["TVM_NUM_THREADS"] == "2"
    gpu = Placement("gpu", gpu_uuid="GPU-3f2a1c9b-0000-0000-0000-000000000000", mps_env={"CUDA_MPS_PIPE_DIRECTORY": "/p"})
    assert gpu.lanes([10, 25, 50, 100]) == (["measure.3f2a1c9b.p10"] * 4 + ["measure.3f2a1c9b.p25"] * 4
                                            + ["measure.3f2a1c9b.p50"] * 2 + ["measure.3f2a1c9b.p100"])
    args, env = gpu.serve_args(25)
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25" and env["CUDA_VISIBLE_DEVICES"].startswith("GPU-3f2a1c9b")
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == "/p" and args == ["--device", "gpu"]


# ---- replicates: several tunings a share ------------------------------------------------------------

def quiet_rounds(value, n=30, spread=0.003, seed=0):
    import numpy as np

    return list(value * (1 + np.random.default_rng(seed).uniform(-spread, spread, n)))


def two_share_cells(diag_tunings, other_tunings):
    """Served at 25 %: the model tuned at 25 % (diagonal) against the one tuned at 100 %; the 100 % column
    plain. Each argument: each tuning's median latency (µs); its rounds are quiet around it."""
    col25 = [[quiet_rounds(v, seed=i) for i, v in enumerate(diag_tunings)],
             [quiet_rounds(v, seed=10 + i) for i, v in enumerate(other_tunings)]]
    col100 = [[quiet_rounds(500.0, seed=20 + i) for i in range(len(diag_tunings))],
              [quiet_rounds(480.0, seed=30 + i) for i in range(len(other_tunings))]]
    return [[col25[0], col100[0]], [col25[1], col100[1]]]


def test_tunings_that_disagree_turn_a_single_tunings_win_into_noise():
    from sharetune.experiments.share_stats import serving_verdict

    one = two_share_cells([1000.0], [1050.0])  # one tuning each: 1000 against 1050, quiet rounds
    assert serving_verdict([25, 100], one, 0)["verdict"] == "wins"
    # the same first tunings, and two more of each share that land on the other side: a search's spread
    many = two_share_cells([1000.0, 1120.0, 1060.0], [1050.0, 980.0, 1010.0])
    v = serving_verdict([25, 100], many, 0)
    assert v["verdict"] == NOISE and v["tunings"] == 3
    lo, hi = v["margin_ci95"]
    assert lo < 0 < hi and "within noise" in v["says"]


def test_the_hierarchical_interval_covers_the_spread_between_tunings():
    from sharetune.experiments.share_stats import cell_figure, hierarchical_ci

    tunings = [quiet_rounds(v, seed=i) for i, v in enumerate([1000.0, 1100.0, 1050.0])]
    rounds_only = bootstrap_ci(tunings[0])
    both = hierarchical_ci(tunings)
    assert both == hierarchical_ci(tunings)  # fixed seed: the same data, the same interval
    assert both[1] - both[0] > 20 * (rounds_only[1] - rounds_only[0])
    assert both[0] <= 1010 and both[1] >= 1090  # it reaches towards the outer tunings
    assert both[0] <= cell_figure(tunings) <= both[1] and abs(cell_figure(tunings) - 1050) < 5
    same = [quiet_rounds(1000.0, seed=i) for i in range(3)]  # tunings that agree: as narrow as serving noise
    assert hierarchical_ci(same)[1] - hierarchical_ci(same)[0] < 10
    assert hierarchical_ci([tunings[0]]) == rounds_only  # one tuning: the rounds' bootstrap, as before
    assert hierarchical_ci([[5.0], [7.0]]) is not None and hierarchical_ci([[5.0]]) is None


def test_a_loss_names_the_faster_share_and_the_advice_its_margin_with_interval():
    from sharetune.experiments.share_stats import serving_advice, serving_verdicts

    cells = two_share_cells([1100.0, 1110.0, 1105.0], [1000.0, 1004.0, 998.0])
    verdicts = serving_verdicts([25, 100], cells)
    at25, at100 = verdicts
    assert at25["verdict"] == "loses" and at25["against_tuned_share"] == 100 and at25["margin"] < -0.09
    assert at100["verdict"] == "wins" and at100["against_tuned_share"] == 25
    advice = serving_advice(verdicts, recommended_share=100)
    assert [a["tune_at"] for a in advice] == [100, 100]
    lo, hi = sorted(-x for x in at25["margin_ci95"])
    assert advice[0]["says"] == (f"serving at 25 %: tune at 100 %: it beats tuning at 25 % by "
                                 f"{-100 * at25['margin']:.1f} % [{100 * lo:.1f}, {100 * hi:.1f}] %")
    assert advice[1]["says"].startswith("serving at 100 %: tune at 100 %: it beats tuning at 25 % by 4.0 % [")
    noise = serving_advice(serving_verdicts([25, 100], two_share_cells([1000.0, 1120.0], [1050.0, 980.0])), 25)
    assert noise[0]["tune_at"] == 25 and "within noise: any share does" in noise[0]["says"]


def test_a_matrix_of_tunings_reports_their_count_figure_interval_and_verdicts():
    cells = two_share_cells([1000.0, 1120.0, 1060.0], [1050.0, 980.0, 1010.0])
    cells[1][1] = cells[1][1][:2]  # one tuning at 100 % failed to serve at 100 %
    m = ShareMatrix.build("resnet18", "gpu", [25, 100], rounds_us=cells, trials_per_share=1024)
    assert m.tunings == [[3, 3], [3, 2]]
    assert m.latency_us[0][0] == pytest.approx(1060.0, rel=0.01)  # the median of the tunings' medians
    assert m.diagonal_wins == {"25": NOISE, "100": True} and m.verdicts[0]["verdict"] == NOISE
    assert "tunings (search seeds) resampled" in m.intervals and "n3" in m.table()
    assert ShareMatrix.model_validate_json(m.model_dump_json()) == m
    assert "tuning here wins by" in m.table() and "within noise (tuning here vs at 100 %" in m.table()


def seeded_cells(seed_scale, diagonal_factor=1.0, other_factor=1.15):
    """Served at 25 %: tunings of seeds 0..n-1 at 25 % (diagonal) and at 100 %; seed k moves both shares'
    tunings by seed_scale[k] (a search seed matters more than the share), the share by its factor."""
    col25 = [[quiet_rounds(1000.0 * f * diagonal_factor, seed=k) for k, f in enumerate(seed_scale)],
             [quiet_rounds(1000.0 * f * other_factor, seed=10 + k) for k, f in enumerate(seed_scale)]]
    col100 = [[quiet_rounds(500.0 * f, seed=20 + k) for k, f in enumerate(seed_scale)],
              [quiet_rounds(480.0 * f, seed=30 + k) for k, f in enumerate(seed_scale)]]
    return [[col25[0], col100[0]], [col25[1], col100[1]]]


def test_tunings_paired_by_seed_tell_a_share_effect_that_the_seeds_spread_would_hide():
    from sharetune.experiments.share_stats import serving_verdict

    cells = seeded_cells([1.0, 1.45, 1.3, 1.1])  # tuning at 100 % is 15 % slower with every seed
    seeds = [[[0, 1, 2, 3]] * 2] * 2
    alone = serving_verdict([25, 100], cells, 0)  # the cells resampled independently: the seeds' spread wins
    assert alone["verdict"] == NOISE and alone["method"] == "independent"
    paired = serving_verdict([25, 100], cells, 0, seeds)
    assert paired["verdict"] == "wins" and paired["method"] == "paired"
    assert paired["margin"] == pytest.approx(1 - 1 / 1.15, abs=0.01)
    lo, hi = paired["margin_ci95"]
    assert 0 < lo < paired["margin"] < hi and set(paired["against"][0]["per_seed"]) == {"0", "1", "2", "3"}
    assert "(paired by seed)" in paired["says"]
    # seeds that disagree about the share: no claim, however many tunings
    mixed = seeded_cells([1.0, 1.45, 1.3])
    mixed[1][0][1] = quiet_rounds(1000.0 * 1.45 * 0.9, seed=11)  # seed 1: tuning at 100 % the faster
    assert serving_verdict([25, 100], mixed, 0, [[[0, 1, 2]] * 2] * 2)["verdict"] == NOISE


def test_a_pair_needs_two_common_seeds_and_few_seeds_give_wide_intervals():
    from sharetune.experiments.share_stats import margin_between, paired_margin, t975

    cells = seeded_cells([1.0, 1.2, 1.1])
    assert paired_margin(cells[0][0], cells[1][0], [0, 1, 2], [5, 6, 7]) is None  # no seed in common
    assert margin_between(cells[0][0], cells[1][0], [0, 1, 2], [2, 6, 7])["method"] == "independent"
    two = paired_margin(cells[0][0][:2], cells[1][0][:2], [0, 1], [0, 1])
    three = paired_margin(cells[0][0], cells[1][0], [0, 1, 2], [0, 1, 2])
    assert two["margin_ci95"][0] < three["margin_ci95"][0]  # one degree of freedom: t = 12.7
    assert t975(1) == pytest.approx(12.706) and t975(3) == pytest.approx(3.182) and t975(11) == t975(10)
    assert t975(200) == 2.0


def test_advice_never_sends_a_serving_share_to_a_tuning_share_slower_there_beyond_noise():
    from sharetune.experiments.share_stats import serving_advice, serving_verdicts

    # three shares; served at 25 %: tuning at 50 % is within noise of it, tuning at 100 % 15 % slower
    seeds = [0, 1, 2, 3]
    scale = [1.0, 1.45, 1.3, 1.1]
    factor = {0: 1.0, 1: 1.01, 2: 1.15}

    def cell(t, s):
        base = {0: 1000.0, 1: 700.0, 2: 500.0}[s]
        f = factor[t] if s == 0 else 1.0
        return [quiet_rounds(base * f * scale[k] * (1 + 0.02 * ((k + t) % 2)), seed=7 * t + k) for k in seeds]

    cells = [[cell(t, s) for s in range(3)] for t in range(3)]
    verdicts = serving_verdicts([25, 50, 100], cells, [[seeds] * 3] * 3)
    at25 = verdicts[0]
    assert at25["verdict"] == NOISE
    assert {c["tuned_share"]: c["verdict"] for c in at25["against"]} == {50: NOISE, 100: "wins"}
    advice = serving_advice(verdicts, recommended_share=100)
    assert advice[0]["tune_at"] == 25 and advice[0]["avoid"] == [100]
    assert "not at 100 %: tuning at 25 % is" in advice[0]["says"] and "beats tuning at 100 %" in at25["says"]
    m = ShareMatrix.build("m", "gpu", [25, 50, 100], rounds_us=cells, seeds_us=[[seeds] * 3] * 3)
    tuned_full = {c["served_share"]: c["separated"] for c in m.advice["tuned_full"]}
    assert tuned_full[25] is True  # the pair's verdict, paired by seed, not the cells' overlapping intervals
    assert compare(m.ci95_us[2][0], m.ci95_us[0][0]) == NOISE


def test_a_matrix_written_without_seeds_is_paired_again_from_its_runs_seeds():
    cells = seeded_cells([1.0, 1.45, 1.3, 1.1])
    old = ShareMatrix.build("resnet18", "gpu", [25, 100], rounds_us=cells, info={"seeds": [0, 1, 2, 3]})
    assert old.seeds_us is None and old.verdicts[0]["verdict"] == NOISE
    again = ShareMatrix.model_validate_json(old.model_dump_json()).rederived()
    assert again.seeds_us == [[[0, 1, 2, 3]] * 2] * 2 and again.verdicts[0]["verdict"] == "wins"
    assert again.info == old.info and again.latency_us == old.latency_us
    cells[0][0] = cells[0][0][:3]  # a tuning that failed to serve: which seed is gone is not known
    partial = ShareMatrix.build("resnet18", "gpu", [25, 100], rounds_us=cells, info={"seeds": [0, 1, 2, 3]})
    assert partial.rederived().seeds_us is None


def test_each_comparison_beyond_noise_is_explained_by_one_seed_on_both_sides_when_paired():
    from sharetune.experiments.share_matrix import beyond_noise, standing_seeds

    seeds = [0, 1, 2, 3]
    cells = seeded_cells([1.0, 1.45, 1.3, 1.1])
    m = ShareMatrix.build("m", "gpu", [25, 100], rounds_us=cells, seeds_us=[[seeds] * 2] * 2)
    pairs = beyond_noise(m)
    # served at 100 %, tuning there is 4 % faster with every seed (480 against 500): beyond noise as well
    assert [(p["served_share"], p["against_tuned_share"], p["verdict"]) for p in pairs] == [(25, 100, "wins"),
                                                                                             (100, 25, "wins")]
    samples = [[dict(zip(seeds, cell)) for cell in row] for row in cells]
    sides = standing_seeds(pairs[0], samples, m.shares)
    per_seed = pairs[0]["per_seed"]
    nearest = min(per_seed, key=lambda k: abs(per_seed[k] - pairs[0]["margin"]))
    assert sides == {25: int(nearest), 100: int(nearest)}
    # unpaired (an older file's headline verdict): each side its tuning nearest its cell's figure
    headline = {"served_share": 25, "against_tuned_share": 100, "verdict": "wins", "margin": 0.1}
    three = [[{k: rounds for k, rounds in cell.items() if k < 3} for cell in row] for row in samples]
    assert standing_seeds(headline, three, m.shares) == {25: 2, 100: 2}  # seed 2 (x1.3): the cells' middle


def test_a_count_is_given_for_every_model_or_by_model():
    from sharetune.experiments.share_matrix import per_model

    assert per_model("3", "resnet18") == 3 and per_model(2, "tiny") == 2
    assert per_model("resnet18=4,5", "resnet18") == 4 and per_model("resnet18=4,5", "transformer") == 5
    for bad in ("0", "x", "resnet18=", "=4", "resnet18=4,2.5"):
        with pytest.raises(ValueError, match="positive count"):
            per_model(bad, "resnet18")
    with pytest.raises(ValueError, match="no count for transformer"):
        per_model("resnet18=4", "transformer")


def test_launch_facts_by_share_compare_the_same_seeds_same_task():
    from sharetune.experiments.task_timing import launch_summary, launch_words

    facts = {(25, 0, 0): {"blocks": 16, "threads": 128}, (100, 0, 0): {"blocks": 64, "threads": 128},
             (25, 0, 1): {"blocks": 32, "threads": 64}, (100, 0, 1): {"blocks": 32, "threads": 64},
             (25, 1, 0): {"blocks": 8, "threads": 256}, (100, 1, 0): {"blocks": 32, "threads": 64},
             (50, 0, 0): {"blocks": 32, "threads": 128}, (25, 1, 1): {"blocks": 4}}  # (25, 1, 1): no pair at 100
    summary = launch_summary(facts)
    assert summary["shares"] == [25, 50, 100]
    blocks = summary["blocks"]
    assert blocks["smallest_vs_largest"] == {"geo_mean_ratio": pytest.approx((0.25 * 1 * 0.25) ** (1 / 3), abs=1e-3),
                                             "fewer": 2, "same": 1, "more": 0}
    assert blocks["by_share"]["50"] == 32 and blocks["by_share"]["100"] == pytest.approx((64 * 32 * 32) ** (1 / 3), abs=0.1)
    assert summary["threads"]["smallest_vs_largest"]["more"] == 1 and "parallel" not in summary
    words = launch_words(summary)
    assert words.startswith("tuned kernels' blocks (geometric mean): ") and "(2 fewer, 1 the same, 0 more)" in words
    m = ShareMatrix.build("m", "gpu", [25, 100], rounds_us=seeded_cells([1.0, 1.2]), launch=summary)
    assert words in m.table() and m.rederived().launch == summary
    assert launch_words({"shares": [25]}) is None


def test_the_report_says_what_a_matrix_says_and_nothing_for_a_bare_table():
    from sharetune.experiments.report import matrix_said

    m = ShareMatrix.build("resnet18", "gpu", [25, 100], rounds_us=seeded_cells([1.0, 1.45, 1.3, 1.1]),
                          seeds_us=[[[0, 1, 2, 3]] * 2] * 2)
    said = matrix_said(json.loads(m.model_dump_json()))
    assert said == m.said() and any("tuning here wins by" in line and "(paired by seed)" in line for line in said)
    assert said[0].startswith("recommended tuning share: ")
    assert matrix_said({"model": "tiny", "shares": [25, 100], "latency_us": [[1.0, 2.0], [3.0, 4.0]]}) == []


def test_earlier_files_of_one_tuning_a_cell_still_read():
    from pathlib import Path

    body = json.loads((Path(__file__).parents[1] / "bench/results/share_matrix_h200.json").read_text())
    m = ShareMatrix.model_validate(body["matrices"][0])
    assert len(m.rounds_us[0][0]) == 1 and len(m.rounds_us[0][0][0]) == m.info["serve_rounds"]
    again = ShareMatrix.build(m.model, m.device, m.shares, m.latency_us, rounds_us=body["matrices"][0]["rounds_us"])
    assert again.ci95_us == m.ci95_us  # the same intervals from the same rounds
    assert again.tunings == [[1] * 3] * 3 and "not sampled" in again.intervals


def test_the_resume_key_skips_finished_tunings():
    from sharetune.experiments.share_tunings import missing_tunings, tuning_key, tuning_plan

    plan = tuning_plan([25, 50, 100], [0, 1, 2])
    assert plan[:4] == [(25, 0), (50, 0), (100, 0), (25, 1)]  # every share's first seed first
    assert tuning_key("resnet18", 25, 1, 1024) == "resnet18-p25-s1-t1024"
    assert tuning_key("my model/v2", 25, 0, 8) == "my_model_v2-p25-s0-t8"
    finished = {tuning_key("resnet18", p, seed, 1024) for p, seed in plan[:5]} | {tuning_key("resnet18", 100, 2, 512)}
    assert missing_tunings(plan, "resnet18", 1024, finished) == plan[5:]
    assert missing_tunings(plan, "resnet18", 512, finished) == [p for p in plan if p != (100, 2)]
    assert missing_tunings(plan, "regnety-stage", 1024, finished) == plan


def test_a_kept_database_holds_each_workloads_best_record():
    from sharetune.experiments.share_tunings import best_record_lines

    def line(workload, secs, tag):
        return json.dumps([workload, [[[tag], []], secs, {"kind": "cuda"}, []]])

    lines = [line(0, [3e-5, 3e-5], "a"), line(1, [9e-6], "b"), line(0, [2e-5, 2.2e-5], "c"), line(1, [9e-6], "d"),
             line(2, None, "e"), ""]
    assert [json.loads(x)[1][0][0][0] for x in best_record_lines(lines)] == ["c", "b", "e"]


# ---- why, where it differs: each task's schedule (the pure part of task_timing) ----------------------

CUDA_SCRIPT = '''
    for ax0_ax1_fused_0 in T.thread_binding(T.int64(196), thread="blockIdx.x"):
        for ax0_ax1_fused_1 in T.thread_binding(T.int64(128), thread="threadIdx.x"):
            for k in T.serial(64, annotations={"pragma_auto_unroll_max_step": 512, "pragma_unroll_explicit": 1}):
    for b in T.thread_binding(49, thread="blockIdx.x"):
        for ty in T.thread_binding(4, thread="threadIdx.y"):
            for tx in T.thread_binding(T.int64(32), thread="threadIdx.x"):
                for v in T.vectorized(T.int64(4)):
'''


def test_launch_facts_read_threads_blocks_vectors_and_unroll_from_the_scheduled_code():
    from sharetune.experiments.task_timing import launch_facts

    facts = launch_facts(CUDA_SCRIPT)
    assert facts == {"blockIdx.x": 196, "threadIdx.x": 128, "threadIdx.y": 4, "vector": 4, "unroll": 512,
                     "threads": 512, "blocks": 196}
    cpu = launch_facts('for i in T.parallel(T.int64(2), annotations={"pragma_auto_unroll_max_step": 64}):\n'
                       '  for j in T.vectorized(T.int64(5)):\n  for k in T.parallel(16):')
    assert cpu == {"parallel": 16, "vector": 5, "unroll": 64}


def trace(tiles, unroll_choice, sketch_extra=()):
    insts = [["GetSBlock", [], ["matmul", "main"], ["b0"]]]
    decisions = []
    for factors in tiles:
        decisions.append([len(insts), factors])
        insts.append(["SamplePerfectTile", ["l"], [len(factors), 64], ["v"] * len(factors)])
    decisions.append([len(insts), unroll_choice])
    insts.append(["SampleCategorical", [], [[0, 16, 64, 512], [0.25] * 4], ["v"]])
    for kind in sketch_extra:
        decisions.append([len(insts), -1])
        insts.append([kind, ["b0"], [], ["v"]])
    return [insts, decisions]


def test_two_schedules_of_a_task_are_compared_by_their_decisions_and_launch():
    from sharetune.experiments.task_timing import schedule_differences, trace_decisions

    a = trace_decisions(trace([[1, 2, 1, 5], [2048, 1]], 2))
    assert a == {"sketch": ["SamplePerfectTile", "SamplePerfectTile", "SampleCategorical"],
                 "tiles": [[1, 2, 1, 5], [2048, 1]], "choices": [64], "locations": []}
    b = trace_decisions(trace([[1, 2, 1, 5], [1024, 2]], 3))
    ka = {"launch": {"threads": 128, "blocks": 196}, "decisions": a, "schedule": "tuned"}
    kb = {"launch": {"threads": 256, "blocks": 196}, "decisions": b, "schedule": "tuned"}
    assert schedule_differences(ka, kb) == ["threads 128 vs 256", "tile 1 [2048, 1] vs [1024, 2]", "choice 0 64 vs 512"]
    assert schedule_differences(ka, ka) == []
    other = {"launch": {"threads": 128, "blocks": 196},
             "decisions": trace_decisions(trace([[1, 2, 1, 5]], 2, ["SampleComputeLocation"]))}
    assert schedule_differences(ka, other) == ["another sketch (sampling steps differ)"]
    default = {"launch": {"threads": 64, "blocks": 196}, "decisions": None, "schedule": "default"}
    assert schedule_differences(default, kb) == ["threads 64 vs 256", "default schedule vs tuned"]
    assert schedule_differences(ka, None) == ["not built on one side"]


def test_the_task_picture_ranks_tasks_by_their_weighted_gap_at_the_serving_share():
    from sharetune.experiments.task_timing import nearest_tuning, task_picture

    assert nearest_tuning([[10.0, 11.0], [20.0], [14.0, 15.0]], [0, 1, 2]) == 2  # median of 10.5, 20, 14.5
    assert nearest_tuning([[], []], [0, 1]) is None
    tasks = [{"name": "conv", "weight": 4, "default_us": 90.0}, {"name": "dense", "weight": 1, "default_us": 9.0}]
    kernels = {25: {"kernels": {"0": {"launch": {"threads": 64}, "decisions": None, "schedule": "default"},
                                "1": {"launch": {}, "decisions": None, "schedule": "default"}}},
               100: {"kernels": {"0": {"launch": {"threads": 256}, "decisions": None, "schedule": "default"},
                                 "1": {"launch": {}, "decisions": None, "schedule": "default"}}}}
    timed = {25: {25: {"0": 50.0, "1": 8.0}, 100: {"0": 60.0, "1": 5.0}},
             100: {25: {"0": 30.0, "1": 4.0}, 100: {"0": 20.0, "1": 4.0}}}
    rows = task_picture(tasks, [25, 100], kernels, timed)
    assert [r["task"] for r in rows] == ["conv", "dense"]  # 4 x -10 us outweighs 1 x 3 us at 25 %
    conv = rows[0]
    assert conv["us"] == {"25": {"25": 50.0, "100": 30.0}, "100": {"25": 60.0, "100": 20.0}}
    assert conv["weighted_gap_us"] == {"25": -40.0, "100": 40.0} and conv["differs"] == ["threads 64 vs 256"]
    assert rows[1]["weighted_gap_us"]["25"] == 3.0 and rows[1]["schedule"] == {"25": "default", "100": "default"}


def test_the_table_names_the_tasks_that_make_the_gap():
    cells = two_share_cells([1000.0, 1004.0], [1100.0, 1104.0])
    m = ShareMatrix.build("resnet18", "gpu", [25, 100], rounds_us=cells)
    m.why = [{"served_share": 25, "against_tuned_share": 100, "tasks": [
        {"task": "fused_conv2d_add_relu", "weight": 4, "weighted_gap_us": {"25": -60.0},
         "us": {"25": {"25": 50.0, "100": 50.2}, "100": {"25": 65.0, "100": 30.0}},
         "differs": ["threads 128 vs 256", "tile 2 [1, 4] vs [2, 2]"],
         "schedule": {"25": "tuned", "100": "tuned"}},
        {"task": "dense", "weight": 1, "weighted_gap_us": {"25": 1.5}, "differs": [],
         "schedule": {"25": "default", "100": "default"}}]}]
    # each kernel's time at every serving share: the one tuned here ignores the share, the other follows it
    assert ("served at 25 %, tuned here vs at 100 %, heaviest gaps: fused_conv2d_add_relu x4 -60.0 us (at 25/100 %: "
            "50/50.2 us vs 65/30; threads 128 vs 256; tile 2 [1, 4] vs [2, 2]), dense x1 +1.5 us (the same default "
            "kernel)") in m.table()

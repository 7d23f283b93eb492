"""The matrix's pure logic on recorded matrices: normalisation, the robust share, the knee, the share
list's validation. No processes, no TVM."""
import json

import pytest

from shared.errors import ShareError
from sharetune.share_matrix import (ShareMatrix, cores_for_share, good_range, knee, normalise, parse_shares,
                                    robust_choice, shares_from_cores)

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


def test_table_names_the_recommendation_and_the_diagonal():
    text = ShareMatrix.build("resnet18", "gpu", SHARES, RECORDED).table()
    assert "recommended tuning share: 25 %" in text and "knee of serving latency: 50 %" in text
    assert "served at 10 %: tuned-at-same-share wins, 3.8% faster" in text


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
    from sharetune.matrix import Placement

    cpu = Placement("cpu", host_cores=4)
    assert cpu.lanes([25, 50, 100]) == ["measure.cpu.c0", "measure.cpu.c1", "measure.cpu.c2", "measure.cpu.c3",
                                        "measure.cpu.c0-1", "measure.cpu.c2-3", "measure.cpu.c0-3"]
    args, env = cpu.serve_args(50)
    assert args[-2:] == ["--cores", "0,1"] and env["TVM_NUM_THREADS"] == "2"
    gpu = Placement("gpu", gpu_uuid="GPU-3f2a1c9b-0000-0000-0000-000000000000", mps_env={"CUDA_MPS_PIPE_DIRECTORY": "/p"})
    assert gpu.lanes([10, 25, 50, 100]) == (["measure.3f2a1c9b.p10"] * 4 + ["measure.3f2a1c9b.p25"] * 4
                                            + ["measure.3f2a1c9b.p50"] * 2 + ["measure.3f2a1c9b.p100"])
    args, env = gpu.serve_args(25)
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25" and env["CUDA_VISIBLE_DEVICES"].startswith("GPU-3f2a1c9b")
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == "/p" and args == ["--device", "gpu"]

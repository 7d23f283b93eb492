"""The tuned-at x served-at matrix end to end on the CPU with core-count shares: the session stack's
one-core lanes plus a two-core lane started here, real tuning jobs (two isolated tunings a share, seeds 0 and 1),
real serving processes pinned to 1 and 2 cores; then the run resumed from its kept tunings."""
import json
import os
import shutil

import pytest

from shared import lanes
from shared.errors import ShareError
from sharetune.experiments.share_stats import NOISE

pytestmark = pytest.mark.e2e

TWO_CORES = lanes.parse("measure.cpu.c0-1", lanes.Host.this("local")).queue  # cores 0-1, named for this host
RESUMED = {}  # the fixture's second run, resumed from the first one's kept tunings


@pytest.fixture(scope="module")
def cpu_matrix(stack, client, tmp_path_factory):
    if (os.cpu_count() or 1) < 2:
        pytest.skip("needs two cores for lanes of 1 and 2 cores")
    from sharetune.experiments.share_matrix import Placement, Replicates, Serving, run_matrix, shares_from_cores
    from sharetune.experiments.share_tunings import KeptTunings, tuning_key

    stack.start_lane(TWO_CORES)
    try:
        stack.wait_for_lanes([TWO_CORES], 300)
        shares = shares_from_cores("1,2", os.cpu_count())
        work = tmp_path_factory.mktemp("matrix")
        # tiny explicit budget (every task's first round 2 trials or less): the matrix's shape, bookkeeping and
        # intervals are under test here, not tuning quality
        report = run_matrix(client, "tiny", shares, Placement("cpu"), work, trials=4, trials_per_iter=4,
                            replicates=Replicates(tunings=2), serving=Serving(rounds=5), job_timeout_s=600)
        # a stopped run started again, on "another machine": one tuning was never finished (tuned now), one
        # module is gone (compiled again from its kept database), the others are served as they are
        kept = KeptTunings(work / "tunings")
        shutil.rmtree(kept.database(tuning_key("tiny", shares[1], 1, 4)))
        os.remove(kept.get(tuning_key("tiny", shares[0], 1, 4)).module)
        RESUMED["work"] = work
        RESUMED["tiny"] = run_matrix(client, "tiny", shares, Placement("cpu"), tmp_path_factory.mktemp("again"),
                                     trials=4, trials_per_iter=4, replicates=Replicates(2, 0, work / "tunings", True),
                                     serving=Serving(rounds=3), job_timeout_s=600)
    finally:
        stack.stop_process(f"lane-{TWO_CORES}")
    return report


def test_a_resumed_run_tunes_only_the_missing_tunings(cpu_matrix):
    from sharetune.experiments.share_tunings import tuning_key

    again, lost = RESUMED["tiny"], tuning_key("tiny", cpu_matrix.shares[1], 1, 4)
    assert again.complete and again.tunings == [[2, 2], [2, 2]], again.errors
    assert {k for k, j in again.info["jobs"].items() if not j.get("resumed")} == {lost}
    assert {k: j["job_id"] for k, j in again.info["jobs"].items() if k != lost} == \
        {k: j["job_id"] for k, j in cpu_matrix.info["jobs"].items() if k != lost}
    assert again.info["jobs"][lost]["job_id"] != cpu_matrix.info["jobs"][lost]["job_id"]


def test_where_a_verdict_is_beyond_noise_each_task_is_timed_at_each_share_and_its_schedules_compared(cpu_matrix):
    """The per-task picture on CPU lanes, from the kept tunings: a verdict set beyond noise (the tiny model's are
    noise), the kernels of the tunings that stand for both shares built and timed in processes pinned to 1 and
    2 cores."""
    from sharetune.experiments.share_matrix import Placement, why_it_differs
    from sharetune.experiments.share_tunings import KeptTunings, ShareTuning, TuningRun, tuning_key

    work, m = RESUMED["work"], cpu_matrix.model_copy(deep=True)
    a, b = m.shares
    m.verdicts = [{**m.verdicts[0], "verdict": "wins", "against_tuned_share": b, "against": []},
                  {**m.verdicts[1], "verdict": NOISE, "against": []}]
    run = TuningRun(ShareTuning("tiny", None, 4, "", 0.0, None, print), KeptTunings(work / "tunings"))
    run.tuned = {(p, seed): run.kept.get(tuning_key("tiny", p, seed, 4)) for p in m.shares for seed in (0, 1)}
    samples = [[dict(enumerate(cell)) for cell in row] for row in m.rounds_us]  # every cell has seeds 0 and 1
    why = why_it_differs(m, samples, run, Placement("cpu"), (work, work / "inputs.npz"), kernel_rounds=3)
    assert len(why) == 1 and why[0]["served_share"] == a and set(why[0]["seeds"]) == {str(a), str(b)}
    assert not why[0]["errors"] and len(why[0]["tasks"]) == m.info["tasks"]
    for task in why[0]["tasks"]:
        assert all(task["us"][str(p)][str(s)] > 0 for p in (a, b) for s in (a, b))
        gap = task["weight"] * (task["us"][str(a)][str(a)] - task["us"][str(b)][str(a)])
        assert task["weighted_gap_us"][str(a)] == pytest.approx(gap)
        assert set(task["schedule"].values()) <= {"tuned", "default"}
        assert isinstance(task["differs"], list)
    gaps = [abs(t["weighted_gap_us"][str(a)]) for t in why[0]["tasks"]]
    assert gaps == sorted(gaps, reverse=True)  # the task that explains the most first


def test_matrix_is_complete_and_normalised(cpu_matrix):
    m = cpu_matrix
    assert m.device == "cpu" and m.cores == [1, 2] and len(m.shares) == 2
    assert m.complete, m.errors
    assert all(v > 0 for row in m.latency_us for v in row)
    for s in range(2):
        col = [m.normalised[t][s] for t in range(2)]
        assert min(col) == 1.0 and all(v >= 1.0 for v in col)
    assert m.recommended_share in m.shares and m.knee_share in m.shares
    # each share was tuned twice, each tuning an isolated job of its own seed: nothing reused from the store
    # (these tasks were tuned before in the session), its whole budget searched
    assert len(m.info["jobs"]) == 4 and len({job["job_id"] for job in m.info["jobs"].values()}) == 4
    assert all(job["state"] == "done" and job["trials"] == 4 and job["reused_trials"] == 0
               for job in m.info["jobs"].values())
    assert m.tasks_tuned == "all" and m.trials_per_share == 4 and m.info["tasks"] >= 2 and m.info["seeds"] == [0, 1]


def test_every_cell_has_both_tunings_rounds_and_an_interval_over_them(cpu_matrix):
    m = cpu_matrix
    assert m.tunings == [[2, 2], [2, 2]]
    for t in range(2):
        for s in range(2):
            assert [len(rounds) for rounds in m.rounds_us[t][s]] == [5, 5]
            lo, hi = m.ci95_us[t][s]
            assert lo <= m.latency_us[t][s] <= hi
    assert "tunings" in m.intervals and "serving rounds" in m.intervals
    assert set(m.diagonal_wins) == {str(p) for p in m.shares}
    assert all(v in (True, False, "within noise") for v in m.diagonal_wins.values())
    assert [v["served_share"] for v in m.verdicts] == m.shares
    assert all(v["verdict"] in ("wins", "loses", "within noise") and v["tunings"] == 2 for v in m.verdicts)
    assert m.advice["recommended_share"] == m.recommended_share and len(m.advice["serve_full"]) == 1
    assert [a["served_share"] for a in m.advice["serving"]] == m.shares


def test_each_share_was_tuned_by_its_own_lanes(cpu_matrix, client):
    """A job at a share measures only on lanes of that share: its records carry that share."""
    from shared import store

    for job in cpu_matrix.info["jobs"].values():
        share = store.job_spec(client.redis, job["job_id"]).share
        recs = [r for t in store.job_tasks(client.redis, job["job_id"]) for r in store.records(client.redis, t.wkey)]
        # an isolated job's workloads hold its own records only
        assert recs and all(r.share == share and r.job_id == job["job_id"] for r in recs)


def test_outputs_json_and_table(cpu_matrix, tmp_path):
    from sharetune.experiments.share_matrix import ShareMatrix, write_outputs

    write_outputs([cpu_matrix], tmp_path / "m.json")
    again = ShareMatrix.model_validate(json.loads((tmp_path / "m.json").read_text()))
    assert again.latency_us == cpu_matrix.latency_us
    table = cpu_matrix.table()
    assert "1c" in table and "2c" in table and "recommended tuning share" in table


def test_heatmap_png(cpu_matrix, tmp_path):
    import matplotlib  # noqa: F401 - in requirements.txt: the heatmap is part of the product
    from sharetune.experiments.share_matrix import heatmap

    path = heatmap([cpu_matrix], tmp_path / "m.png")
    assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_bad_share_lists_are_refused_before_any_work(client, tmp_path):
    from sharetune.experiments.share_matrix import Placement, run_matrix

    with pytest.raises(ShareError, match="whole number of cores"):
        run_matrix(client, "tiny", [30, 100], Placement("cpu", host_cores=2), tmp_path)
    with pytest.raises(ShareError, match="more than once"):
        run_matrix(client, "tiny", "50,50", Placement("cpu", host_cores=2), tmp_path)
    with pytest.raises(ShareError, match="no live cpu lane serves share"):
        run_matrix(client, "tiny", [25, 50], Placement("cpu", host_cores=4), tmp_path)


def test_cli_refuses_bad_shares_clearly(capsys):
    from sharetune.cli import main

    assert main(["matrix", "tiny", "--shares", "25,abc"]) == 2
    assert "whole percentages" in capsys.readouterr().err
    assert main(["matrix", "tiny", "--cores", "1,99"]) == 2
    assert "outside 1.." in capsys.readouterr().err

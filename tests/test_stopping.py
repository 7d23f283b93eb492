"""Stopping a job's search before its budget: the rules (pure), the store's stop and patience mark on the real
Redis, and real jobs on CPU lanes stopped by patience and by a time limit."""
from __future__ import annotations

import pytest

from shared import names, store
from shared.messages import JobOptions, ShardState
from shared.errors import SpecError
from shared.ranking import model_estimate
from shared.stopping import StopRules


def test_the_model_estimate_takes_each_tasks_faster_of_best_and_default():
    assert model_estimate([(2, 3.0, 5.0), (1, None, 4.0), (3, 1.0, None)]) == 2 * 3.0 + 4.0 + 3 * 1.0
    assert model_estimate([(1, 6.0, 5.0)]) == 5.0  # the default kept where faster, as the compiled model runs it
    assert model_estimate([(1, 2.0, 1.0), (1, None, None)]) is None  # a task with neither: no estimate yet
    assert model_estimate([]) is None


def test_the_rules():
    assert not StopRules().any and StopRules(patience=5).any and StopRules(time_limit_s=1).any
    rules = StopRules(time_limit_s=60, patience=100, min_gain_pct=2.0)
    assert rules.gain == pytest.approx(0.02)
    assert rules.over_time(now=159.9, started_at=100.0) is None
    assert rules.over_time(now=160.0, started_at=100.0).startswith("time limit: 60 s")
    assert rules.out_of_patience(trials=199, mark_s=1e-4, mark_trials=100) is None
    why = rules.out_of_patience(trials=200, mark_s=1e-4, mark_trials=100)
    assert why.startswith("patience") and "100.0 us at trial 100" in why and "100 trials" in why
    assert StopRules(time_limit_s=60).out_of_patience(10**6, 1.0, 0) is None
    assert StopRules(patience=1).over_time(10**9, 0.0) is None


def test_options_out_of_range_are_refused():
    for bad in ({"time_limit_s": 0}, {"patience": 0}, {"min_gain_pct": 0}, {"min_gain_pct": 100}):
        with pytest.raises(SpecError):
            JobOptions.checked(**bad)


@pytest.fixture
def fake_job(redis_conn):
    job_id = "stop-test"
    r = redis_conn
    r.delete(names.job_key(job_id), names.job_shards_key(job_id), names.job_budget_key(job_id),
             names.job_claims_key(job_id))
    store.put_shards(r, job_id, [ShardState(shard=i, task_ids=[f"t{i}"]) for i in range(2)], 100)
    r.hset(names.job_key(job_id), mapping={"state": "tuning"})
    yield job_id
    store.deactivate_job(r, job_id)  # not a real job: keep the stack's clients and reaper off it


def test_a_stopped_search_claims_nothing_and_its_refunds_stay_unspent(redis_conn, fake_job):
    r, job = redis_conn, fake_job
    assert store.claim_trials(r, job, 0, 30) == 30
    assert store.stop_search(r, job, "patience: test")
    assert not store.stop_search(r, job, "time limit: a second reason")  # once: the first reason stands
    assert store.claim_trials(r, job, 1, 8) == 0 and store.budget_left(r, job) == 0
    state = store.job_hash(r, job)
    assert state.stopped == "patience: test" and state.stopped_unspent == 70 and state.stopped_at
    store.settle_claim(r, job, 0, 10)  # 10 of shard 0's 30 were recorded; its client died with 20 in flight
    assert store.refund_claim(r, job, 0) == 20
    assert store.budget_left(r, job) == 0 and store.job_hash(r, job).stopped_unspent == 90


def test_patience_marks_only_an_improvement_by_the_gain(redis_conn, fake_job):
    r, job = redis_conn, fake_job
    assert store.mark_estimate(r, job, 100e-6, 10, 0.05) == (pytest.approx(100e-6), 10)  # the first estimate
    assert store.mark_estimate(r, job, 97e-6, 20, 0.05) == (pytest.approx(100e-6), 10)  # 3 %: not a gain of 5
    assert store.mark_estimate(r, job, 94e-6, 30, 0.05) == (pytest.approx(94e-6), 30)
    assert store.mark_estimate(r, job, 120e-6, 40, 0.05) == (pytest.approx(94e-6), 30)  # never moved back up


def _accounted_exactly(job) -> None:
    acc = job.result().accounting
    assert acc.claimed == acc.recorded == job.result().trials and acc.lost == acc.outstanding == 0


def test_a_job_out_of_patience_finishes_early_with_what_it_measured(client, lane_share):
    """Real clients, lanes and builds: a job whose estimate must fall 90 % within 2 trials stops once every
    task's default is timed and a round or two landed, not at its budget; it finishes as any job does."""
    job = client.submit("tiny", target="llvm", share=lane_share, trials=400, trials_per_iter=8, seed=5,
                        patience=2, min_gain_pct=90, untuned_baseline=False, isolated=True)
    assert job.wait(timeout_s=900)["state"] == "done"
    res = job.result()
    assert res.stopped.startswith("patience") and 0 < res.trials < 400
    st = job.status()
    assert st["stopped"] == res.stopped and st["stopping"]["patience"] == 2 and st["stopping"]["mark_trials"] > 0
    _accounted_exactly(job)
    assert res.tuned_module_path and res.database_dir


def test_a_job_past_its_time_limit_finishes_on_what_it_has(client, lane_share):
    """A limit shorter than the first round: the search stops before it claims anything more, and the job still
    ends done, with its result (a task without a record runs its default schedule)."""
    job = client.submit("tiny", target="llvm", share=lane_share, trials=400, trials_per_iter=8, seed=6,
                        time_limit_s=0.01, untuned_baseline=False, isolated=True)
    assert job.wait(timeout_s=900)["state"] == "done"
    res = job.result()
    assert res.stopped.startswith("time limit") and res.trials < 400
    _accounted_exactly(job)
    assert res.tuned_module_path


def test_the_mark_moves_only_by_the_gain_as_the_stores_does():
    rules = StopRules(patience=10, min_gain_pct=5)
    mark = rules.marked(None, 100e-6, 10)
    assert mark == (100e-6, 10)
    assert rules.marked(mark, 97e-6, 20) == mark  # 3 %: not a gain of 5
    assert rules.marked(mark, 94e-6, 30) == (94e-6, 30)


def test_patience_replayed_over_a_recorded_curve_counts_from_every_tasks_first_round():
    from sharetune.experiments.stopping import every_task_by, stopped_at

    events = [(1.0, "a", 2e-5), (2.0, "a", None), (3.0, "b", 1e-5), (4.0, "a", 1e-5)]
    assert every_task_by(events) == 3
    # flat while the first task's rounds land, 20 % lower once the second's does, then flat
    curve = [(float(n), n, est) for n, est in enumerate((10.0, 10.0, 10.0, 8.0, 8.0, 7.99), start=1)]
    rules = StopRules(patience=2, min_gain_pct=1)
    assert stopped_at(curve, rules) == {"trials": 3, "t_s": 3.0, "estimate_s": 10.0}  # from the start: too early
    assert stopped_at(curve, rules, from_trial=3) == {"trials": 6, "t_s": 6.0, "estimate_s": 7.99}
    assert stopped_at(curve, StopRules(patience=10), from_trial=3) is None  # runs to its budget

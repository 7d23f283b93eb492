"""Sharding one job over several tuner clients: the pure split and gradient logic, the job-wide budget
and leases on a real Redis, the reaper, and a real job whose tuner client is killed mid-shard."""
from __future__ import annotations

import math
import signal
import threading
import time

import pytest

from shared import names, store, timeouts
from shared.messages import JobTask, Record, ShardPhase, ShardRef, ShardState, TaskProgress
from services.tuner.allocation import (Steering, behind, expected_cost, flops_shares, gradient, next_task, partition,
                                       priority)


def _tasks(spec):
    return [JobTask(task_id=f"t{i}", name=f"task{i}", weight=w, wkey=f"t{i}", flops=f) for i, (w, f) in enumerate(spec)]


# ---- pure logic ------------------------------------------------------------------------------------------

def test_partition_covers_every_task_once_and_balances():
    tasks = _tasks([(1, 1e9), (1, 5e8), (2, 2e8), (1, 1e8), (3, 1e7), (1, 1e6), (1, 1e6)])
    shards = partition(tasks, 3)
    assert len(shards) == 3
    ids = [tid for sh in shards for tid in sh.task_ids]
    assert sorted(ids) == sorted(t.task_id for t in tasks)  # every task, exactly once
    loads = [sum(expected_cost(next(t for t in tasks if t.task_id == tid), tasks) for tid in sh.task_ids)
             for sh in shards]
    heaviest = max(expected_cost(t, tasks) for t in tasks)
    assert max(loads) - min(loads) <= heaviest  # LPT: no shard exceeds another by more than one task
    assert [s.task_ids for s in partition(tasks, 3)] == [s.task_ids for s in shards]  # deterministic


def test_partition_never_makes_empty_shards():
    tasks = _tasks([(1, 1e6), (1, 1e6)])
    assert len(partition(tasks, 8)) == 2
    assert [len(s.task_ids) for s in partition(tasks, 1)] == [2]
    assert partition([], 4) == []


def test_gradient_follows_metaschedule():
    assert gradient([], 1) == math.inf  # never tuned: first
    assert gradient([1e9], 1) == -1e9  # no valid result: last
    # n=2 < 1 + window: only the "best / n" part
    assert gradient([2.0, 1.0], 3) == pytest.approx(0.8 * (1.0 / 2) * 3)
    # n=4: g1 = (hist[0] - best) / 3
    g = gradient([4.0, 3.0, 2.0, 1.0], 1)
    assert g == pytest.approx(0.2 * (3.0 / 3) + 0.8 * (1.0 / 4))


def test_a_task_whose_search_trails_its_default_is_weighed_by_how_close_it_came():
    """efficientnet-mbconv's excite GEMV on an H100: default 5.85 us, its search's best 8.80 after a round, floor
    3.98. Its history says 5.85 (the default stands), so its forward term claims 1.87 us of room and it runs beside
    a top task at 3.6e-6; weighed by its reach (1.87 / 4.82) it falls under a quarter of that and waits. A search at or ahead of its default,
    an unknown default or searched best, and a default at the floor leave the gradient as it was."""
    from services.tuner.allocation import default_reach

    us = 1e-6
    reach = default_reach(5.85 * us, 8.80 * us, 3.98 * us)
    assert reach == pytest.approx(1.87 / 4.82)
    assert default_reach(5.85 * us, 5.10 * us, 3.98 * us) == 1.0  # the search is ahead: the default does not bind
    assert default_reach(None, 8.8 * us) == default_reach(5.85 * us, None) == 1.0
    assert default_reach(3.9 * us, 8.8 * us, 3.98 * us) == 1.0  # at the floor: no room either way
    gemv, top = [5.85 * us], gradient([8.50 * us], 1, floor=3.98 * us)  # 3.6e-6: the run's top task
    plain, weighed = gradient(gemv, 1, floor=3.98 * us), gradient(gemv, 1, floor=3.98 * us, reach=reach)
    assert weighed == pytest.approx(plain * reach)
    s = Steering(per_shard=2, min_share=0.25)
    assert s.may_run(plain, [top], live_shards=4) and not s.may_run(weighed, [top], live_shards=4)
    g = gradient([4.0, 3.0, 2.0, 1.0], 1, reach=0.5)  # the backward term is what the task did gain: kept
    assert g == pytest.approx(0.2 * (3.0 / 3) + 0.8 * (1.0 / 4) * 0.5)
    assert priority(gemv, 1, False, floor=3.98 * us, reach=reach) == weighed


def test_the_forward_term_counts_only_what_lies_above_the_launch_floor():
    """efficientnet-mbconv on an H100: its `mean` at 2.80 us after one round, its 1x1 convolution at 8.41 us. With
    no floor (MetaSchedule's rule) the mean's gradient is a third of the convolution's, within Steering's quarter,
    and four clients ran both; counted from a 2.7 us floor it is under 2 % of it and waits."""
    us = 1e-6
    assert gradient([2.0, 1.0], 3, floor=0.0) == gradient([2.0, 1.0], 3)  # no floor: MetaSchedule's
    mean, conv = [2.80 * us], [8.41 * us]
    s = Steering(per_shard=2, min_share=0.25)
    assert s.may_run(gradient(mean, 1), [gradient(conv, 1)], live_shards=4)
    floored = gradient(mean, 1, floor=2.7 * us)
    assert floored == pytest.approx(0.8 * 0.1 * us)
    assert not s.may_run(floored, [gradient(conv, 1, floor=2.7 * us)], live_shards=4)
    assert gradient([2.6 * us], 1, floor=2.7 * us) == 0.0  # under the floor (timer noise): nothing to gain, not < 0
    g = gradient([4.0, 3.0, 2.0, 1.0], 1, floor=0.5)  # the backward term is a difference: the floor leaves it
    assert g == pytest.approx(0.2 * (3.0 / 3) + 0.8 * (0.5 / 4))
    assert priority(mean, 1, False, floor=2.7 * us) == floored and priority(mean, 1, True, floor=2.7 * us) == math.inf


def _allocate(tasks, budget, per_iter, latency, floor):
    """The round order with fake timings: every task once, then the largest priority (as rounds.py)."""
    shares = flops_shares(tasks)
    hist = {t.task_id: [] for t in tasks}
    trials = {t.task_id: 0 for t in tasks}
    first = [t.task_id for t in tasks]
    spent = 0
    while spent < budget:
        tid = first.pop(0) if first else max(
            hist, key=lambda x: priority(hist[x], 1, floor and behind(x, shares, trials)))
        n = min(per_iter, budget - spent)
        trials[tid] += n
        spent += n
        hist[tid].append(min([latency(tid, k) for k in range(1, trials[tid] + 1)]))
    return trials, shares


def test_a_heavy_task_never_ends_with_fewer_trials_than_a_tiny_one():
    # a depthwise conv (30 MFLOPs) whose first batch failed to build, a layer_norm (3 MFLOPs, falling
    # fast), a big conv, and a tiny elementwise task (under 0.1 % of the job)
    tasks = _tasks([(1, 30e6), (1, 3e6), (1, 2e9), (1, 1e6)])
    us = {"t0": 60.0, "t1": 8.0, "t2": 30.0, "t3": 3.0}

    def latency(tid, k):
        if tid == "t0" and k <= 8:
            return 1e9  # no valid candidate in its first batch
        return us[tid] * 1e-6 * (1 + 4 / k)

    plain, shares = _allocate(tasks, 400, 8, latency, floor=False)
    assert shares["t0"] >= 0.01 and shares["t3"] < 0.001
    assert plain["t0"] == 8 and plain["t3"] > 8  # the gradient alone starves it (-1e9 after a failed batch)
    trials, _ = _allocate(tasks, 400, 8, latency, floor=True)
    heavy = [t for t, s in shares.items() if s >= 0.01]
    light = [t for t, s in shares.items() if s < 0.001]
    assert min(trials[t] for t in heavy) >= max(trials[t] for t in light)
    assert sum(trials.values()) == 400


def test_heavy_tasks_ahead_of_the_light_ones_are_ordered_by_the_gradient():
    # two heavy tasks that both lead the light one: the rule no longer applies, the gradient decides
    tasks = _tasks([(1, 2e9), (1, 1e9), (1, 1e5)])
    shares = flops_shares(tasks)
    trials = {"t0": 30, "t1": 30, "t2": 25}
    assert not behind("t0", shares, trials) and not behind("t1", shares, trials)
    assert behind("t1", shares, {**trials, "t1": 20})


def test_steering_lets_the_best_tasks_go_first():
    s = Steering(per_shard=1)
    assert s.may_run(5.0, [1.0, 2.0], live_shards=2)
    assert s.may_run(1.5, [1.0, 2.0], live_shards=2)  # one task ahead, two shards live
    assert not s.may_run(0.5, [1.0, 2.0], live_shards=2)  # both others pay more
    assert s.may_run(math.inf, [math.inf] * 10, live_shards=2)  # a first round always runs


def test_steering_holds_a_light_task_back_while_a_heavy_one_pays_far_more():
    s = Steering(per_shard=2, min_share=0.25)
    # ranks alone would let it run (one task ahead, eight ranks), but the heavy task pays ten times more
    assert not s.may_run(4.0, [40.0, -1e9], live_shards=4)
    assert s.may_run(12.0, [40.0, 3.0], live_shards=4)  # within a quarter of the best: both run at once
    assert s.may_run(40.0, [12.0], live_shards=2)  # the best task's owner never waits
    # tasks without a round (+inf) or without a valid result (-1e9) are no measure of what a round pays
    assert s.may_run(4.0, [math.inf, -1e9], live_shards=4)


def test_a_task_that_stopped_improving_has_its_forward_term_weighed_only_when_asked():
    flat, improving = [12.0, 12.0, 12.0, 12.0], [40.0, 36.0, 33.0, 31.0]
    assert gradient(flat, 1, stalled=0.25) == pytest.approx(0.25 * gradient(flat, 1))
    assert gradient(improving, 1, stalled=0.25) == gradient(improving, 1)
    assert gradient(flat[:3], 1, stalled=0.25) == gradient(flat[:3], 1)  # too few rounds to call it stalled
    assert priority(flat, 1, False, stalled=0.25) == gradient(flat, 1, stalled=0.25)
    # wav2vec2-conv's case: a 12 us norm flat for three rounds beside a 31 us convolution still improving
    steer, wait = Steering(per_shard=2), Steering(per_shard=2, stalled=0.25)
    others = [gradient(improving, 1)]
    assert steer.may_run(priority(flat, 1, False, steer.stalled), others, live_shards=4)
    assert not wait.may_run(priority(flat, 1, False, wait.stalled), others, live_shards=4)


def test_a_heavy_task_flat_after_its_first_round_is_stalled_only_with_one_round_asked():
    # wav2vec2-conv's conv1d1 at 384 trials: its best in its first round, then two rounds without a gain
    conv, improving = [38.6e-6, 38.6e-6, 38.6e-6], [33.2e-6, 30.1e-6, 25.5e-6]
    assert gradient(conv, 1, stalled=0.25) == gradient(conv, 1)  # three flat rounds need four entries
    assert gradient(conv, 1, stalled=0.25, stalled_rounds=1) == pytest.approx(0.25 * gradient(conv, 1))
    assert gradient(conv[:1], 1, stalled=0.25, stalled_rounds=1) == gradient(conv[:1], 1)  # one round: no verdict
    assert gradient(improving, 1, stalled=0.25, stalled_rounds=1) == gradient(improving, 1)
    assert gradient([40.0, 36.0, 36.0], 1, stalled=0.25, stalled_rounds=1) == pytest.approx(
        0.25 * gradient([40.0, 36.0, 36.0], 1))
    # with one round asked, the convolution still improving goes first; with MetaSchedule's window, the flat one
    assert gradient(conv, 1) > gradient(improving, 1)
    assert gradient(conv, 1, stalled=0.25, stalled_rounds=1) < gradient(improving, 1, stalled=0.25, stalled_rounds=1)
    steer = Steering(per_shard=2, stalled=0.25, stalled_rounds=1)
    assert priority(conv, 1, False, steer.stalled, steer.stalled_rounds) == gradient(conv, 1, stalled=0.25,
                                                                                      stalled_rounds=1)
    assert priority(conv, 1, True, steer.stalled, steer.stalled_rounds) == math.inf  # behind still goes first


def test_a_pro_rata_round_is_the_tasks_share_of_the_top_priority_and_never_below_its_floor():
    from services.tuner.allocation import PRORATA_MIN

    off, on = Steering(), Steering(prorata=True)
    assert off.round_size(64, 2.7, 7.0) == 64  # MetaSchedule's: a full round whoever runs
    assert on.round_size(64, 2.7, 7.0) == 25  # efficientnet-mbconv's mean beside conv2d4
    assert on.round_size(64, 0.1, 7.0) == PRORATA_MIN
    assert on.round_size(64, 9.0, 7.0) == 64 and on.round_size(64, 2.7, None) == 64  # the top task; no other
    assert on.round_size(4, 0.1, 7.0) == 4  # never more than a full round
    assert on.round_size(64, 2.7, math.inf) == 64 and on.round_size(64, -1e9, 7.0) == 64


def test_a_task_whose_batch_came_back_goes_before_one_still_measured():
    prio = {"a": 9.0, "b": 3.0, "c": 3.0}
    assert next_task(["a", "b", "c"], prio, in_flight=set()) == "a"
    assert next_task(["a", "b", "c"], prio, in_flight={"a"}) == "b"  # the first of equals, in the shard's order
    assert next_task(["a", "b", "c"], prio, in_flight={"a", "b"}) == "c"
    # every batch still measured: the best task (the client then joins it)
    assert next_task(["a", "b", "c"], prio, in_flight={"a", "b", "c"}) == "a"


# ---- budget, leases and the reaper on the real Redis ------------------------------------------------------

_FAKE_JOBS: list[tuple] = []


@pytest.fixture(autouse=True)
def _fake_jobs_retired():
    """A fake job left active would be seen by the session stack's clients (shards waiting for a turn) and
    its reaper: each test's fakes end with it."""
    yield
    while _FAKE_JOBS:
        r, job_id = _FAKE_JOBS.pop()
        store.deactivate_job(r, job_id)


def _job(r, job_id, shards, budget):
    r.delete(names.job_shards_key(job_id), names.job_budget_key(job_id), names.job_claims_key(job_id),
             names.job_measured_recently_key(job_id))
    store.put_shards(r, job_id, shards, budget)
    r.hset(names.job_key(job_id), mapping={"state": "tuning"})
    _FAKE_JOBS.append((r, job_id))


def test_concurrent_claims_never_overspend(redis_conn):
    job = "claims-test"
    _job(redis_conn, job, [ShardState(shard=i, task_ids=[f"t{i}"]) for i in range(4)], 100)
    got = []

    def client(i):
        while (k := store.claim_trials(redis_conn, job, i, 7)) > 0:
            got.append(k)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert sum(got) == 100 and store.budget_left(redis_conn, job) == 0
    # a dead client's unsettled claim goes back; a settled one does not
    # (a shard whose thread claimed something: under load one thread may find the budget already spent)
    claims = {int(k): int(v) for k, v in redis_conn.hgetall(names.job_claims_key(job)).items()}
    shard, claimed = max(claims.items(), key=lambda kv: kv[1])
    store.settle_claim(redis_conn, job, shard, claimed - 3)
    assert store.refund_claim(redis_conn, job, shard) == 3
    assert store.budget_left(redis_conn, job) == 3
    assert store.refund_claim(redis_conn, job, shard) == 0  # once only
    redis_conn.srem(names.ACTIVE_JOBS_KEY, job)  # not a real job: keep the stack's reaper off it


def test_lease_is_exclusive_and_renewable(redis_conn):
    job = "lease-test"
    redis_conn.delete(names.shard_lease_key(job, 0))
    assert store.take_lease(redis_conn, job, 0, "a", ttl_s=30)
    assert store.take_lease(redis_conn, job, 0, "a", ttl_s=30)  # the holder again: fine
    assert not store.take_lease(redis_conn, job, 0, "b", ttl_s=30)
    assert store.renew_lease(redis_conn, job, 0, "a") and not store.renew_lease(redis_conn, job, 0, "b")
    store.release_lease(redis_conn, job, 0, "b")  # not b's to release
    assert store.lease_owner(redis_conn, job, 0) == "a"
    store.release_lease(redis_conn, job, 0, "a")
    assert store.take_lease(redis_conn, job, 0, "b")


def test_a_blocked_shard_takes_turns_at_once_and_a_busy_one_after_its_quantum(redis_conn):
    from services.tuner.metaschedule.rounds import Stopped
    from services.tuner.shard_runner import Lease

    job = "turns-test"
    waiting = ShardState(shard=1, task_ids=["t1"], queued_at=time.time() - 5)
    _job(redis_conn, job, [ShardState(shard=0, task_ids=["t0"], state=ShardPhase.RUNNING), waiting], 100)
    lease = Lease(redis_conn, job, 0, "me", threading.Event(), quantum_s=3600)
    try:
        lease.check(True)  # within its quantum a shard keeps its client
        with pytest.raises(Stopped, match="taking turns with shard 1"):
            lease.check(True, blocked=True)  # it can measure nothing until shard 1 has had its first rounds
        lease.check(False, blocked=True)  # its own first rounds come first
        store.update_shard(redis_conn, job, 1, lambda sh: setattr(sh, "state", ShardPhase.RUNNING))
        lease.check(True, blocked=True)  # no shard waits for a client: it waits on
    finally:
        lease.stop()


def test_jobs_share_the_clients_a_new_job_at_once_and_more_jobs_than_clients_by_turns():
    from services.tuner.allocation import MIN_HOLD_S, turn_to_take

    after = MIN_HOLD_S + 1
    waiting = [("b", 0, 5.0), ("b", 1, 5.0), ("c", 2, 9.0)]
    # a job holding all four clients gives one to the longest-waiting job that has none, soon
    assert turn_to_take("a", {"a": 4}, waiting, after, 30, passed=False, blocked=False) == ("c", 2)
    assert turn_to_take("a", {"a": 4}, waiting, MIN_HOLD_S - 1, 30, passed=True, blocked=True) is None
    # the job with the fewest clients comes first
    assert turn_to_take("a", {"a": 3, "c": 1}, waiting, after, 30, passed=False, blocked=False) == ("b", 0)
    # an even split stays put; one client more than another job's: taken turns with after the quantum
    assert turn_to_take("a", {"a": 2, "b": 1, "c": 1}, waiting, after, 30, passed=True, blocked=False) is None
    assert turn_to_take("a", {"a": 2, "b": 1, "c": 1}, waiting, 31, 30, passed=True, blocked=False) == ("c", 2)
    assert turn_to_take("a", {"a": 1, "b": 1, "c": 1}, waiting, 99, 30, passed=True, blocked=False) is None
    assert turn_to_take("a", {"a": 1}, [("e", 0, 1.0)], 31, 30, passed=False, blocked=False) == ("e", 0)
    # its own job's waiting shards: only once each task of its shard had a round
    own = [("a", 1, 50.0)]
    assert turn_to_take("a", {"a": 1}, own, 31, 30, passed=False, blocked=False) is None
    assert turn_to_take("a", {"a": 1}, own, 1, 30, passed=True, blocked=True) == ("a", 1)
    assert turn_to_take("a", {"a": 1}, [], 99, 30, passed=True, blocked=True) is None
    # blocked by first rounds still owed: at once only to a shard that owes them, else after the quantum
    assert turn_to_take("a", {"a": 1}, own, 1, 30, passed=True, blocked=True, owing={1}) == ("a", 1)
    assert turn_to_take("a", {"a": 1}, own, 1, 30, passed=True, blocked=True, owing=set()) is None
    assert turn_to_take("a", {"a": 1}, own, 31, 30, passed=True, blocked=True, owing=set()) == ("a", 1)


def test_a_job_over_an_equal_share_of_the_candidates_in_flight_sends_its_rounds_behind():
    from services.tuner.allocation import round_priority

    assert round_priority(192, []) == 0  # alone: nothing to be fair to
    assert round_priority(0, [0, 0]) == 0
    assert round_priority(64, [64, 64, 64]) == 0  # an equal share
    assert round_priority(0, [192]) == 0  # behind: first
    assert round_priority(80, [64, 64, 48]) == 0  # 1.25x an equal share: within the slack
    assert round_priority(192, [64]) == 3  # 1.5x
    assert round_priority(128, [64, 64, 0]) == 6  # 2x: a job searching with nothing in flight still counts
    assert round_priority(192, [64, 64, 0]) == 9
    # the order among jobs follows their shares: the more over, the later
    shares = {"a": 200, "b": 120, "c": 40, "d": 0}
    pri = {j: round_priority(n, [m for k, m in shares.items() if k != j]) for j, n in shares.items()}
    assert pri["d"] == pri["c"] == 0 < pri["b"] < pri["a"]


def test_the_first_rounds_of_the_tasks_holding_half_the_untuned_latency_go_ahead():
    from services.tuner.allocation import head_tasks, message_priority

    # a depthwise conv holding 39 % of the untuned latency, then the next costliest to pass half
    costs = {"pw": 12e-6, "dw": 31e-6, "se": 4e-6, "pw2": 14e-6, "add": 3e-6, "mean": None, "bn": 15e-6}
    assert head_tasks(costs) == {"dw", "bn"}  # 31 + 15 of 79 us
    assert head_tasks({"a": 5e-6, "b": 1e-6}) == {"a"}
    assert head_tasks({"a": None}) == set() and head_tasks({}) == set()
    # within a job's fair step, a head first round first; a job sent behind stays behind whatever its rounds
    assert [message_priority(0, True), message_priority(0, False)] == [0, 1]
    assert message_priority(3, True) < message_priority(3, False) < message_priority(6, True)
    assert message_priority(9, True) == message_priority(9, False) == 9


def test_in_flight_counts_the_claims_not_yet_recorded_of_running_jobs_only(idle_redis):
    r = idle_redis
    for job in ("fly-a", "fly-b", "fly-c"):
        _job(r, job, [ShardState(shard=0, task_ids=["t0"]), ShardState(shard=1, task_ids=["t1"])], 500)
    assert store.claim_trials(r, "fly-a", 0, 64) == store.claim_trials(r, "fly-a", 1, 64) == 64
    store.settle_claim(r, "fly-a", 1, 64)  # shard 1's round is recorded
    assert store.claim_trials(r, "fly-c", 0, 32) == 32
    r.hset(names.job_key("fly-c"), "state", "done")  # ended, not yet retired by the reaper
    got = store.in_flight_by_job(r)
    assert (got["fly-a"], got["fly-b"]) == (64, 0)
    assert "fly-c" not in got


def test_the_fair_count_is_a_jobs_recent_measurements(idle_redis):
    """The fair share's default count: the trials a job has had recorded, in the round's own transaction; its claims
    in flight do not count until they are measured; a round counts half after a half-life, so a job's share follows
    its recent rate."""
    from shared.timeouts import MEASURED_HALF_LIFE_S

    r = idle_redis
    for job in ("served-a", "served-b", "served-c"):
        _job(r, job, [ShardState(shard=0, task_ids=["t0"]), ShardState(shard=1, task_ids=["t1"])], 500)
    assert store.claim_trials(r, "served-a", 0, 64) == store.claim_trials(r, "served-a", 1, 64) == 64
    recs = [Record(candidate_key=f"served-a-{i}", wkey="served-a-w", trace="", run_secs=[1e-5], target="llvm",
                   args_info=[], share=50, job_id="served-a") for i in range(64)]
    store.record_round(r, "served-a", 1, recs, TaskProgress(task_id="t1", name="t1", trials=64), 64)
    assert store.claim_trials(r, "served-b", 0, 32) == 32  # in flight, nothing measured yet
    r.hset(names.job_key("served-c"), "state", "done")
    measured = store.measured_by_job(r)
    assert measured["served-a"] == pytest.approx(64, rel=1e-3) and measured["served-b"] == 0.0
    assert "served-c" not in measured
    flying = store.fair_loads(r, "in_flight")
    assert (flying["served-a"], flying["served-b"]) == (64.0, 32.0)
    key = names.job_measured_recently_key("served-a")
    r.hset(key, "t", float(r.hget(key, "t")) - MEASURED_HALF_LIFE_S)  # as if its round were a half-life old
    assert store.fair_loads(r, "measured")["served-a"] == pytest.approx(32, rel=1e-2)
    store.count_measured(r, "served-a", 16)  # the old round decayed, the new one whole
    assert store.measured_by_job(r)["served-a"] == pytest.approx(48, rel=1e-2)


def test_the_broker_serves_a_round_sent_behind_after_one_sent_first(stack):
    """The Redis transport honours the priorities allocation.message_priority gives: a message sent at 9 waits
    behind one sent after it at 0, and a head task's first round (0) goes ahead of the job's other rounds (1)."""
    import uuid

    from services.celery_app import make_celery

    app = make_celery("priority-test", stack.redis_url)
    queue = f"priority-test-{uuid.uuid4().hex[:8]}"
    app.send_task("sharetune.no_such_task", args=[{"n": "behind"}], queue=queue, priority=9)
    app.send_task("sharetune.no_such_task", args=[{"n": "middle"}], queue=queue, priority=3)
    app.send_task("sharetune.no_such_task", args=[{"n": "second"}], queue=queue, priority=1)  # a job's other rounds
    app.send_task("sharetune.no_such_task", args=[{"n": "first"}], queue=queue)
    got = []
    with app.connection_for_read() as conn:
        sq = conn.SimpleQueue(queue)
        try:
            for _ in range(4):
                msg = sq.get(timeout=10)
                got.append(msg.payload[0][0]["n"])
                msg.ack()
        finally:
            sq.close()
    assert got == ["first", "second", "middle", "behind"]


def test_the_shards_owing_first_rounds_are_those_with_a_task_without_one():
    from services.tuner.allocation import owing_first_rounds

    shards = [ShardState(shard=0, task_ids=["t0", "t1"]), ShardState(shard=1, task_ids=["t2"]),
              ShardState(shard=2, task_ids=[])]
    assert owing_first_rounds(shards, {"t0", "t1"}) == {1}
    assert owing_first_rounds(shards, {"t0"}) == {0, 1}
    assert owing_first_rounds(shards, {"t0", "t1", "t2"}) == set()


def test_the_board_counts_running_and_waiting_shards():
    from services.tuner.allocation import board_of

    now = time.time()
    board = {"a": [ShardState(shard=0, task_ids=["t0"], state=ShardPhase.RUNNING),
                   ShardState(shard=1, task_ids=["t1"], queued_at=now - 5),
                   ShardState(shard=2, task_ids=["t2"], queued_at=now - 1),
                   ShardState(shard=3, task_ids=["t3"], state="done")],
             "b": [ShardState(shard=0, task_ids=["t4"], queued_at=now - 3)]}
    running, waiting = board_of(board, now, 2.0)
    assert running == {"a": 1, "b": 0}
    assert sorted((j, s) for j, s, _ in waiting) == [("a", 1), ("b", 0)]


def test_with_fair_clients_a_job_far_ahead_in_flight_gives_a_client_to_one_behind_after_its_quantum():
    from services.tuner.allocation import turn_to_take

    each = {"a": 1, "b": 1, "c": 1}
    waiting = [("b", 1, 9.0), ("c", 1, 5.0), ("a", 1, 3.0)]
    ahead = {"a": 120, "b": 20, "c": 60}  # equal share 66.7: a is over it by more than the slack, b under it
    assert turn_to_take("a", each, waiting, 29, 30, passed=True, blocked=False, loads=ahead) is None  # quantum
    assert turn_to_take("a", each, waiting, 31, 30, passed=True, blocked=False) == ("a", 1)  # off: its own job
    assert turn_to_take("a", each, waiting, 31, 30, passed=True, blocked=False, loads=ahead) == ("b", 1)
    even = {"a": 70, "b": 60, "c": 70}
    assert turn_to_take("a", each, waiting, 31, 30, passed=True, blocked=False, loads=even) == ("a", 1)
    # a job behind that already holds more clients gets none of this one's
    assert turn_to_take("a", {"a": 1, "b": 2, "c": 1}, waiting, 31, 30, passed=True, blocked=False,
                        loads=ahead) == ("a", 1)
    assert turn_to_take("b", each, waiting, 31, 30, passed=True, blocked=False, loads=ahead) == ("b", 1)


def test_a_lease_with_fair_clients_reads_the_jobs_in_flight_from_the_store(redis_conn):
    from services.tuner.metaschedule.loop_parts import TurnTaken
    from services.tuner.shard_runner import Lease

    ahead, behind = "fair-ahead", "fair-behind"
    _job(redis_conn, ahead, [ShardState(shard=0, task_ids=["t0"], state=ShardPhase.RUNNING),
                             ShardState(shard=1, task_ids=["t1"], queued_at=time.time() - 5)], 100)
    _job(redis_conn, behind, [ShardState(shard=0, task_ids=["t2"], state=ShardPhase.RUNNING),
                              ShardState(shard=1, task_ids=["t3"], queued_at=time.time() - 5)], 100)
    redis_conn.hset(names.job_claims_key(ahead), "0", 10000)  # far over any real job's in the session's store
    redis_conn.hset(names.job_claims_key(behind), "0", 0)
    now = redis_conn.time()[0]
    redis_conn.hset(names.job_measured_recently_key(ahead), mapping={"v": 10000, "t": now})
    redis_conn.hset(names.job_measured_recently_key(behind), mapping={"v": 0, "t": now})
    for fair, turn_to in ((None, (ahead, 1)), ("in_flight", (behind, 1)), ("measured", (behind, 1))):
        lease = Lease(redis_conn, ahead, 0, "me", threading.Event(), quantum_s=1, fair_clients=fair)
        lease.started -= 10
        try:
            with pytest.raises(TurnTaken) as turn:
                lease.check(True)
            assert (turn.value.job_id, turn.value.shard) == turn_to
        finally:
            lease.stop()


def test_a_job_holding_every_client_hands_a_shard_to_a_job_that_has_none(redis_conn):
    from services.tuner.allocation import MIN_HOLD_S
    from services.tuner.metaschedule.loop_parts import TurnTaken
    from services.tuner.shard_runner import Lease

    mine, theirs = "turns-mine", "turns-theirs"
    _job(redis_conn, mine, [ShardState(shard=i, task_ids=[f"t{i}"], state=ShardPhase.RUNNING) for i in range(3)], 100)
    _job(redis_conn, theirs, [ShardState(shard=0, task_ids=["t9"], queued_at=time.time() - 5)], 100)
    lease = Lease(redis_conn, mine, 0, "me", threading.Event(), quantum_s=3600)
    try:
        lease.check(False)  # just taken: it searches a while first
        lease.started -= MIN_HOLD_S + 1
        with pytest.raises(TurnTaken) as turn:
            lease.check(False)  # even before each task of its own shard had a round
        assert (turn.value.job_id, turn.value.shard) == (theirs, 0)
    finally:
        lease.stop()


def test_a_client_that_lost_its_turn_takes_the_neediest_jobs_waiting_shard(redis_conn):
    from services.tuner.shard_runner import HELD, ShardRunner
    from shared.settings import TunerSettings

    crowded, starved = "lost-turn-crowded", "lost-turn-starved"
    _job(redis_conn, crowded, [ShardState(shard=0, task_ids=["t0"], state=ShardPhase.RUNNING),
                               ShardState(shard=1, task_ids=["t1"], queued_at=time.time() - 7200)], 100)
    # waiting longer than any real job's shard of the session's stack may (the board is every active job's)
    _job(redis_conn, starved, [ShardState(shard=0, task_ids=["t2"], queued_at=time.time() - 3600)], 100)
    runner = ShardRunner(redis_conn, "me", TunerSettings(), send=None, send_shard=None, send_finish=None)
    taken = []

    def search(ref):  # the contested shard went to another client; the next one is searched to its end
        taken.append((ref.job_id, ref.shard))
        if len(taken) == 1:
            return {"job_id": ref.job_id, "shard": ref.shard, "turn": ShardRef(job_id=crowded, shard=0)}
        if len(taken) == 2:
            return {"job_id": ref.job_id, "shard": ref.shard, "skipped": HELD}
        return {"job_id": ref.job_id, "shard": ref.shard, "trials": 8}

    runner._search = search
    assert runner.run(ShardRef(job_id="lost-turn-own", shard=0)) == {"job_id": starved, "shard": 0, "trials": 8}
    # the crowded job's shard 1 waited longer, but the job without a client comes first
    assert taken == [("lost-turn-own", 0), (crowded, 0), (starved, 0)]


@pytest.fixture
def idle_redis(stack):
    """A database of the stack's Redis that no service uses, so the test's reap is the only reaper on its jobs (the
    stack's own reaper, on database 0, acts on them between the test's calls: once it claimed the finish first)."""
    from urllib.parse import urlsplit, urlunsplit

    return store.connect(urlunsplit(urlsplit(stack.redis_url)._replace(path="/15")))


def test_reaper_sends_back_dead_and_stranded_shards_once(idle_redis):
    from services.tuner.reaper import reap

    job = "reaper-test"
    now = time.time()
    shards = [
        ShardState(shard=0, task_ids=["a"], state=ShardPhase.RUNNING, owner="dead.1"),  # no lease: its client died
        ShardState(shard=1, task_ids=["b"], state=ShardPhase.RUNNING, owner="live.2"),  # leased: left alone
        ShardState(shard=2, task_ids=["c"], state="pending", queued_at=now - 10 * timeouts.STRANDED_AFTER_S),
        ShardState(shard=3, task_ids=["d"], state="pending", queued_at=now),  # just queued: left alone
    ]
    _job(idle_redis, job, shards, 50)
    for i in range(4):
        idle_redis.delete(names.shard_requeue_key(job, i), names.shard_lease_key(job, i))
    store.claim_trials(idle_redis, job, 0, 8)  # shard 0 claimed a batch and died before recording it
    store.take_lease(idle_redis, job, 1, "live.2", ttl_s=60)
    idle_redis.delete(names.TUNE_QUEUE)
    sent, finished = [], []
    reap(idle_redis, sent.append, finished.append, now=now)
    others = [s for s in sent if s.job_id == job]
    assert sorted(s.shard for s in others) == [0, 2]
    after = store.shards(idle_redis, job)
    assert after[0].state == "pending" and after[0].refunded == 8
    assert store.budget_left(idle_redis, job) == 50
    sent.clear()
    reap(idle_redis, sent.append, finished.append, now=now)
    assert not [s for s in sent if s.job_id == job]  # the guard: one reaper acts, once
    idle_redis.srem(names.ACTIVE_JOBS_KEY, job)


def test_reaper_resends_the_finish_of_a_job_whose_shards_are_done(idle_redis):
    from services.tuner.reaper import reap

    job = "finish-test"
    _job(idle_redis, job, [ShardState(shard=0, task_ids=["a"], state="done")], 10)
    idle_redis.delete(names.job_finish_key(job))
    finished = []
    reap(idle_redis, lambda ref: None, finished.append)
    assert finished.count(job) == 1
    reap(idle_redis, lambda ref: None, finished.append)
    assert finished.count(job) == 1
    idle_redis.srem(names.ACTIVE_JOBS_KEY, job)


def test_a_finish_whose_client_died_mid_step_is_sent_again_once_its_hold_lapses(idle_redis):
    from services.tuner.reaper import reap

    job = "finish-hold-test"
    _job(idle_redis, job, [ShardState(shard=0, task_ids=["a"], state="done")], 10)
    idle_redis.delete(names.job_finish_key(job))
    assert store.claim_finish(idle_redis, job, "sender.1")  # sent: it may wait in the queue for minutes
    finished = []
    reap(idle_redis, lambda ref: None, finished.append)
    assert finished == []
    store.hold_finish(idle_redis, job, "client.2", ttl_s=1)  # a client runs it, then is killed: no renewal
    reap(idle_redis, lambda ref: None, finished.append)
    assert finished == []  # held: a live client is not second-guessed
    time.sleep(1.2)
    reap(idle_redis, lambda ref: None, finished.append)
    assert finished == [job]
    reap(idle_redis, lambda ref: None, finished.append)
    assert finished == [job]  # once
    idle_redis.srem(names.ACTIVE_JOBS_KEY, job)


def test_a_finish_sent_but_never_started_is_sent_again_once_nothing_queues_it(idle_redis):
    """A worker that took the finishing step's message and was killed before it started leaves the message
    unacknowledged for Redis's visibility timeout (an hour) and the send's guard for FINISH_QUEUED_S: with the
    tune queue empty past STRANDED_AFTER_S, the reaper sends the step again, once; a held step is left alone."""
    from services.tuner.reaper import reap

    job, key = "finish-stranded-test", names.job_finish_key("finish-stranded-test")
    _job(idle_redis, job, [ShardState(shard=0, task_ids=["a"], state="done")], 10)
    assert store.queue_length(idle_redis, names.TUNE_QUEUE) == 0
    assert store.claim_finish(idle_redis, job, "sender.1")
    finished = []
    reap(idle_redis, lambda ref: None, finished.append)
    assert finished == []  # sent moments ago: it may still be on its way
    idle_redis.expire(key, timeouts.FINISH_QUEUED_S - timeouts.STRANDED_AFTER_S - 5)  # sent past STRANDED_AFTER_S
    reap(idle_redis, lambda ref: None, finished.append)
    reap(idle_redis, lambda ref: None, finished.append)
    assert finished == [job]  # again, once: the guard is the reaper's now, and young
    store.hold_finish(idle_redis, job, "client.2", ttl_s=timeouts.FINISH_LEASE_TTL_S)  # a client runs it
    reap(idle_redis, lambda ref: None, finished.append)
    assert finished == [job]
    idle_redis.srem(names.ACTIVE_JOBS_KEY, job)


def test_shard_messages_are_validated():
    assert ShardRef.parse({"job_id": "j", "shard": 1}).shard == 1
    from shared.errors import MessageError

    with pytest.raises(MessageError):
        ShardRef.parse({"job_id": "j", "shard": -1})


# ---- a real job over two tuner clients, one killed mid-shard ---------------------------------------------

def _job_records(r, job_id):
    return sum(1 for t in store.job_tasks(r, job_id) for rec in store.records(r, t.wkey) if rec.job_id == job_id)


def test_two_clients_share_one_budget_and_a_killed_client_is_replaced(stack, client, redis_conn, lane_share,
                                                                       figures_out):
    stack.start_tuner("tuner-extra")
    stack.wait_for_tuners(2, 300)
    trials, per_iter = 32, 8
    job = client.submit("small_cnn", target="llvm", share=lane_share, trials=trials, trials_per_iter=per_iter,
                        seed=1, clients=2)
    extra_pid = stack.pid_of("tuner-extra")
    victim = None
    deadline = time.time() + 600
    while time.time() < deadline and victim is None:  # the extra client has recorded a round of its shard
        shards = store.shards(redis_conn, job.job_id)
        prog = store.job_progress(redis_conn, job.job_id)
        for sh in shards.values():
            if sh.state == "running" and sh.owner and sh.owner.endswith(f".{extra_pid}") \
                    and any(prog[t].trials for t in sh.task_ids if t in prog):
                victim = sh.shard
        assert job.state()["state"] not in ("done", "failed"), job.status()
        time.sleep(0.2)
    assert victim is not None, job.status()
    t_kill = time.time()
    stack.stop_process("tuner-extra", signal.SIGKILL)
    stack.start_tuner("tuner-replacement")
    resumed_at = None
    while resumed_at is None and time.time() < t_kill + 900:  # a live client holds the shard again
        sh = store.shards(redis_conn, job.job_id)[victim]
        if sh.attempts >= 2 or sh.state == "done":
            resumed_at = time.time()
        time.sleep(0.2)
    final = job.wait(timeout_s=900)
    try:
        assert final["state"] == "done", final
        shards = store.shards(redis_conn, job.job_id)
        assert all(sh.state == "done" for sh in shards.values())
        # resumed by another client (and, on a slow host, maybe once more: a client alone with both shards
        # takes turns between them)
        assert shards[victim].attempts >= 2
        # at most what was in flight is spent again: a batch per task of the shard (a task's batch stays in
        # flight while the client searches its other tasks)
        assert shards[victim].refunded <= per_iter * len(shards[victim].task_ids)
        ids = [t for sh in shards.values() for t in sh.task_ids]
        assert len(ids) == len(set(ids))  # no task in two shards
        status = job.status()
        assert status["trials"] == trials  # the job-wide budget, exactly
        assert _job_records(redis_conn, job.job_id) == trials  # one record per trial spent, none lost
        assert store.budget_left(redis_conn, job.job_id) == 0
        assert job.result().time_split_s["resumed_shards"] >= 1
        from sharetune.testing import faults as faultlib

        faultlib.record_row(figures_out, {"scenario": "kill -9 the tuner client mid-job and start another",
                                          "jobs_completed": 1,
                                          "candidates_lost": trials - _job_records(redis_conn, job.job_id),
                                          "trials_respent": shards[victim].refunded,
                                          "recovery_s": round(resumed_at - t_kill, 1) if resumed_at else None})
    finally:
        stack.stop_process("tuner-replacement")

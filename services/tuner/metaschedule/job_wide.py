"""What a shard's loop (rounds.py) shares with the job's other clients: the trial budget (JobBudget) and the
order of rounds (RoundPicker), both kept in the store so every client sees the same."""
from __future__ import annotations

import time
from typing import Callable

from shared import store
from shared.messages import ShardPhase
from services.tuner.metaschedule.loop_parts import Shard, ShardRun
from services.tuner.metaschedule.task_search import TaskSearch
from shared.ranking import default_secs, model_estimate
from shared.stopping import StopRules
from services.tuner.allocation import (Steering, behind, default_reach, first_round_sizes, first_rounds_reserve,
                                       flops_shares, head_tasks, next_task, priority)

# how long a client's second rounds wait for other clients' first rounds before they stop leaving them budget
# (a shard nobody runs must not hold the job back for good)
RESERVE_WAIT_S = 300.0
# how often a client whose every task is being measured looks for a batch that came back
LANDING_POLL_S = 0.05
# how often a client looks at the job's stopping rules (a few store reads each time)
STOP_CHECK_S = 1.0


class FirstRounds:
    """Each task's cost to the untuned model (weight x its default schedule's seconds, as the store has them) and
    first-round size, job-wide (allocation.first_round_sizes), fixed once the store holds every task's default
    timing (other clients time their own shards' defaults). A first round drawn before that is sized from the
    defaults timed so far: a client whose shard's defaults came first started its light tasks' first rounds at the
    even share (on an H100 efficientnet-mbconv's `mean`, 2.85 us, drew 34 where its rule gives 8).
    With `floor_wkey` (the store key of the lanes' launch floor, defaults.launch_floor) a task's cost counts only its
    default's time above the floor, and the sizes wait for the floor as for a default: a 5.6 us task on lanes whose
    floor is 3.6 has 2 us to gain, not 5.6 (TunerSettings.floor_first_rounds)."""

    def __init__(self, shard: Shard, floor_wkey: str | None = None):
        self.redis, self.job_id, self.floor_wkey = shard.redis, shard.job_id, floor_wkey
        self.uniform = shard.first_round or shard.trials_per_iter
        self._tasks: list | None = None  # the job's tasks: fixed once planned
        self._sizes: dict[str, int] | None = None
        self._head: set[str] | None = None
        self._fixed: dict[str, float | None] | None = None  # the costs once every default is in the store
        self.default_s: dict[str, float | None] = {}  # task_id -> its default schedule's seconds, as timed so far

    def _costs(self) -> tuple[dict[str, float | None], bool]:
        """(task_id -> cost, None where its default is untimed or failed; whether every default is in the store)."""
        if self._fixed is not None:  # the round picker asks every pass of its wait: the store is read until then
            return self._fixed, True
        if self._tasks is None:
            self._tasks = store.job_tasks(self.redis, self.job_id)
        keys = [t.wkey for t in self._tasks] + ([self.floor_wkey] if self.floor_wkey else [])
        timings = store.default_timings(self.redis, keys)
        floor = (default_secs(timings[self.floor_wkey]) or 0.0) if self.floor_wkey else 0.0
        costs = {}
        for t in self._tasks:
            d = self.default_s[t.task_id] = default_secs(timings[t.wkey])
            costs[t.task_id] = max(d - floor, 0.0) * t.weight if d else None
        complete = bool(self._tasks) and all(timings[k] is not None for k in keys)
        if complete:
            self._fixed = costs
        return costs, complete

    def costs(self) -> dict[str, float | None]:
        return self._costs()[0]

    def defaults(self) -> dict[str, float | None]:
        """task_id -> its default schedule's seconds as the store has them (None: untimed or failed); unlike a
        cost, never counted from the floor."""
        self._costs()
        return self.default_s

    def sizes(self) -> dict[str, int] | None:
        """task_id -> its first round's size; None while a default is still untimed."""
        if self._sizes is None:
            costs, complete = self._costs()
            if complete:
                self._sizes = first_round_sizes(costs, self.uniform)
        return self._sizes

    def size(self, task_id: str) -> int:
        sizes = self.sizes()
        if sizes is None:  # judged against the defaults timed so far; a task of its own untimed default: even
            known = {t: c for t, c in self.costs().items() if c is not None}
            sizes = first_round_sizes(known, self.uniform) if task_id in known else {}
        return sizes.get(task_id, self.uniform)

    def head(self) -> set[str]:
        """The tasks whose first rounds go ahead of other rounds (allocation.head_tasks), from the defaults timed
        so far; fixed once every default is in the store."""
        if self._head is None:
            costs, complete = self._costs()
            if not complete:
                return head_tasks(costs)
            self._head = head_tasks(costs)
        return self._head


class SearchStop:
    """The job's stopping rules (stopping.StopRules), looked at before a round claims trials, at most every
    STOP_CHECK_S: the first client to find one met stops the search for all (store.stop_search), and the job then
    ends as one whose budget is spent."""

    def __init__(self, shard: Shard, rules: StopRules):
        self.redis, self.job_id, self.rules = shard.redis, shard.job_id, rules
        self._tasks = None
        self._checked = 0.0

    def check(self) -> None:
        now = time.time()
        if now - self._checked < STOP_CHECK_S:
            return
        self._checked = now
        state = store.job_hash(self.redis, self.job_id)
        if state.stopped:
            return
        reason = self.rules.over_time(now, state.tuning_at or state.spec.submitted_at)
        if reason is None and self.rules.patience is not None:
            estimate_s, trials, every_task = self.estimate()
            if estimate_s is not None and every_task:  # patience counts from every task's first round
                mark_s, mark_trials = store.mark_estimate(self.redis, self.job_id, estimate_s, trials, self.rules.gain)
                reason = self.rules.out_of_patience(trials, mark_s, mark_trials)
        if reason is not None:
            store.stop_search(self.redis, self.job_id, reason)

    def estimate(self) -> tuple[float | None, int, bool]:
        """(the model's estimated latency in seconds from the store, None while a task has neither a record nor a
        timed default; the job's recorded trials; whether every task has had a round recorded)."""
        if self._tasks is None:
            self._tasks = store.job_tasks(self.redis, self.job_id)
        progress = store.job_progress(self.redis, self.job_id)
        defaults = store.default_timings(self.redis, [t.wkey for t in self._tasks])
        parts, trials, every_task = [], 0, True
        for t in self._tasks:
            p = progress.get(t.task_id)
            trials += p.trials if p else 0
            every_task = every_task and bool(p and (p.trials or p.exhausted))
            best = p.best_us * 1e-6 if p and p.best_us is not None else None
            parts.append((t.weight, best, default_secs(defaults[t.wkey])))
        return model_estimate(parts), trials, every_task


class JobBudget:
    """The job's trials, claimed atomically before each batch is sent, so N clients together spend exactly what
    the job was given; a later round leaves what the job's remaining first rounds need. With stopping rules
    (SearchStop), what is left is 0 once one is met."""

    def __init__(self, shard: Shard, first_rounds: FirstRounds | None = None, stop: SearchStop | None = None):
        self.redis, self.job_id, self.shard = shard.redis, shard.job_id, shard.shard
        self.first_rounds = first_rounds or FirstRounds(shard)
        self.stop = stop
        self._reserve_since: float | None = None

    def left(self) -> int:
        if self.stop is not None:
            self.stop.check()
        return store.budget_left(self.redis, self.job_id)

    def claim(self, n: int, first_round_of: str | None = None) -> int:
        """Up to n trials for this shard's next batch (`first_round_of`: the task whose first round it is); 0 once
        the job's budget is spent."""
        return store.claim_trials(self.redis, self.job_id, self.shard, n, first_round_of)

    def reserve(self, tasks: list[TaskSearch]) -> int:
        """Trials to leave for first rounds no client has claimed yet (`tasks`: this shard's; a task whose first
        round found nothing new counts as having had it; one whose first round is being measured has its trials
        claimed already); 0 once this client has waited RESERVE_WAIT_S for them."""
        if self._reserve_since is None:
            self._reserve_since = time.time()
        if time.time() - self._reserve_since > RESERVE_WAIT_S:
            return 0
        had = (set(store.history(self.redis, self.job_id)) | store.first_rounds_claimed(self.redis, self.job_id)
               | {t.task_id for t in tasks if t.started or t.done or t.dry})
        reserve = first_rounds_reserve([t.task_id for t in store.job_tasks(self.redis, self.job_id)], had,
                                       self.first_rounds.sizes() or self.first_rounds.uniform)
        if reserve == 0:
            self._reserve_since = time.time()  # the wait clock starts again at the next shortfall
        return reserve


class RoundPicker:
    """After every task's first round: the task with the largest priority (allocation.priority, job-wide), once
    other live shards' tasks do not have clearly more (Steering; at most its max_wait_s)."""

    def __init__(self, shard: Shard, steering: Steering, check: Callable[..., None], stats: ShardRun,
                 first_rounds: FirstRounds | None = None):
        self.redis, self.job_id, self.shard = shard.redis, shard.job_id, shard.shard
        self.steering, self.check, self.stats = steering, check, stats
        self.first_rounds = first_rounds

    def pick(self, tasks: list[TaskSearch], touch: Callable[[], None],
             in_flight: Callable[[TaskSearch], bool] = lambda t: False) -> TaskSearch | None:
        """The next task of `tasks` to search (None when all are done); `touch()` first joins the batches that
        came back, so the gradients are current; `in_flight(t)` whether t's batch is still being measured
        (allocation.next_task; until Steering's max_wait_s, a client whose every task is measured waits for one
        to land)."""
        t0 = time.time()
        while True:
            touch()
            alive = [t for t in tasks if not t.done]
            if not alive:
                return None
            ready = [t for t in alive if not in_flight(t)]
            waited = time.time() - t0
            if not ready and waited <= self.steering.max_wait_s:
                self.check(True)
                time.sleep(LANDING_POLL_S)
                continue
            job_tasks, prio = self.priorities()
            grads = {t.task_id: prio(t.task_id) for t in alive}
            best_id = next_task([t.task_id for t in alive], grads, {t.task_id for t in alive if in_flight(t)})
            best = next(t for t in alive if t.task_id == best_id)
            others, live = self._others(job_tasks, prio)
            if waited > self.steering.max_wait_s or self.steering.may_run(grads[best.task_id], others, live):
                self.stats.waited_s += time.time() - t0
                self.stats.pick = (grads[best.task_id], self.steering.top(others), time.time() - t0)
                return best
            self.check(True)
            time.sleep(0.1)

    def priorities(self) -> tuple[dict, Callable[[str], float]]:
        """The job's tasks by id, and each one's priority from the store's history and progress."""
        hist = store.history(self.redis, self.job_id)
        job_tasks = {t.task_id: t for t in store.job_tasks(self.redis, self.job_id)}
        shares = flops_shares(list(job_tasks.values()))
        trials = {tid: p.trials for tid, p in store.job_progress(self.redis, self.job_id).items()}
        # a task whose first round is being measured has had its round: until it lands, its default schedule's
        # time stands in for its best (not the +inf of a task yet to have one, which would hold every other
        # client's next round until the job's last first round lands); its time, not its cost, which with
        # floor-sized first rounds counts from the floor (0 for a task at it)
        defaults = self.first_rounds.defaults() if self.first_rounds is not None else {}
        landing = {tid for tid in store.first_rounds_claimed(self.redis, self.job_id) - set(hist)
                   if tid in job_tasks and defaults.get(tid)}
        for tid in landing:
            hist[tid] = [defaults[tid]]

        reach = self._reach(defaults)

        def prio(tid: str) -> float:
            return priority(hist.get(tid, []), job_tasks[tid].weight,
                            tid not in landing and behind(tid, shares, trials), self.steering.stalled,
                            self.steering.stalled_rounds, self.steering.floor_s, reach.get(tid, 1.0))

        return job_tasks, prio

    def _reach(self, defaults: dict[str, float | None]) -> dict[str, float]:
        """Each task's default_reach, with Steering.reach on (else none): its searched best against its default."""
        if not self.steering.reach:
            return {}
        return {tid: default_reach(defaults.get(tid), s, self.steering.floor_s)
                for tid, s in store.searched(self.redis, self.job_id).items()}

    def _others(self, tasks: dict, prio: Callable[[str], float]) -> tuple[list[float], int]:
        """Priorities of the other live shards' unfinished tasks, and how many shards are live."""
        shards = store.shards(self.redis, self.job_id)
        out, live = [], 1
        for sh in shards.values():
            if sh.shard == self.shard or sh.state != ShardPhase.RUNNING:
                continue
            live += 1
            out += [prio(tid) for tid in sh.task_ids if tid in tasks]
        return out, live

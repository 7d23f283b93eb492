"""One tuner client's search loop over its shard of a job: MetaSchedule's own search strategy per task
(evolutionary search, through TuneContext), driven round by round the way its task scheduler does it
(every task once, then the largest gradient first; a task's batch stays in flight while others are
searched), with three things the stock scheduler cannot do across processes:

- the trial budget is the job's, claimed atomically from Redis before each round, so N clients together
  spend exactly what the job was given;
- the gradient is job-wide: each round's best latency goes to the store, and a client lets other
  shards' tasks go first while they pay more (services/tuner/allocation.py decides);
- candidates the store already holds (measured before a client died, or by an earlier job of the same
  workload) are answered from the store, not measured again.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

from tvm.s_tir.meta_schedule.builder import BuilderInput
from tvm.s_tir.meta_schedule.runner import RunnerInput, RunnerResult

from shared import store
from shared.ranking import screen_bar
from services.tuner.metaschedule.job_wide import RESERVE_WAIT_S, FirstRounds, JobBudget, RoundPicker, SearchStop
from shared.stopping import StopRules
from services.tuner.metaschedule.loop_parts import PHASES, SearchParts, Shard, ShardRun, Stopped
from services.tuner.metaschedule.task_search import EMPTY_ROUNDS, SEARCH_ROOM, SearchState, TaskSearch
from services.tuner.allocation import Steering, first_round_order

# what other modules import from here; the parts live in loop_parts, task_search and job_wide
__all__ = ["EMPTY_ROUNDS", "PHASES", "RESERVE_WAIT_S", "SEARCH_ROOM", "InFlight", "JobBudget", "RoundPicker",
           "SearchParts", "SearchState", "Shard", "ShardLoop", "ShardRun", "Stopped", "TaskSearch"]


@dataclass
class InFlight:
    """A task's batch while it is measured: the candidates sent, their builder results, one future each (a
    failed build's answers at once), and the trials claimed for them."""

    candidates: list
    built: list
    futures: list
    claimed: int

    def landed(self) -> bool:
        return all(f.done() for f in self.futures)


class ShardLoop:
    """Composes each task's search (TaskSearch), the job's budget (JobBudget) and the round order
    (RoundPicker); sends each round's candidates to be built and measured, and joins the results."""

    def __init__(self, shard: Shard, parts: SearchParts, steering: Steering | None = None,
                 check: Callable[..., None] | None = None, cold_start: bool = True, screen: bool = False,
                 rounds_ahead: int = 0, stop_rules: StopRules | None = None):
        self.redis, self.job_id, self.shard = shard.redis, shard.job_id, shard.shard
        self.builder, self.runner = parts.builder, parts.runner
        self.cost_model, self.records = parts.cost_model, parts.records
        self.defaults, self.floor, self.cold_start = parts.defaults, parts.floor, cold_start
        self.screen = screen  # screened timing: each round's candidates carry the bar of their task's best
        # raises Stopped when the client must hand the shard back; its argument says whether every task
        # of the shard has had a round (a client may then yield to a shard no client has taken). Unless blocked,
        # only once this client has sent a round since it took the shard: on a loaded host a resumed shard's
        # search outlasted the quantum, and two clients handed two shards back and forth for ten minutes
        yields = check or (lambda passed, blocked=False: None)
        self.check = lambda passed, blocked=False: yields(passed and (blocked or self.run_stats.rounds > 0), blocked)
        self.run_stats = ShardRun()
        self.t0 = time.perf_counter()  # the round log's clock (run() starts it again)
        self.tasks = [TaskSearch(t, shard, parts, self.run_stats) for t in shard.tasks]
        self.first_rounds = FirstRounds(shard, parts.first_round_floor)
        self.budget = JobBudget(shard, self.first_rounds, SearchStop(shard, stop_rules) if stop_rules and stop_rules.any else None)
        self.picker = RoundPicker(shard, steering or Steering(), self.check, self.run_stats, self.first_rounds)
        self.flights: dict[str, list[InFlight]] = {}  # task id -> its batches being measured, oldest first
        # while every task of the shard is being measured, a task may have this many more rounds searched and sent
        # before its batch lands (from what the search knew when it was sent): the host and the lanes are not left
        # waiting for the slowest batch (TunerSettings.rounds_ahead)
        self.rounds_ahead = rounds_ahead

    def run(self) -> ShardRun:
        self.t0 = time.perf_counter()
        self._begin()
        try:
            # first every task once (MetaSchedule's round-robin start), the costliest to the untuned model first
            by_id = {t.task_id: t for t in self.tasks}
            for tid in first_round_order(self.first_rounds.costs(), list(by_id)):
                t = by_id[tid]
                self.check(False)
                if not self._round(t):
                    return self.run_stats
            while True:
                self.check(True)
                ahead = self._ahead()
                t = ahead or self.picker.pick(self.tasks, self._touch, lambda t: t.task_id in self.flights)
                if t is None:
                    break
                if not self._round(t, ahead=ahead is not None):
                    break
        finally:
            for t in self.tasks:
                while t.task_id in self.flights:
                    self._join(t)
                t.ctx.post_tuning()
        return self.run_stats

    def _begin(self) -> None:
        """Each task's search, from the job's history (a resumed shard) and its default schedule's time."""
        hist = store.history(self.redis, self.job_id)
        t0 = time.perf_counter()
        default = self.defaults([t.job_task for t in self.tasks]) if self.defaults else {}
        if self.floor is not None:
            self.run_stats.floor_s = self.floor()
            self.picker.steering.floor_s = self.run_stats.floor_s or 0.0
        self.run_stats.clock("defaults", t0)
        known = self.first_rounds.sizes() or {}  # every default timed already: each search drawn at its size
        for t in self.tasks:
            t.first_round = known.get(t.task_id, t.first_round)
            t.begin(hist.get(t.task_id) or [], default.get(t.task_id), self.cold_start)

    def _touch(self) -> None:
        """Join the batches that have all come back, each task's in the order sent (so gradients are current)."""
        for t in self.tasks:
            while t.task_id in self.flights and self.flights[t.task_id][0].landed():
                self._join(t)

    def _ahead(self) -> TaskSearch | None:
        """With rounds ahead allowed and every unfinished task of the shard being measured: the one (with a round
        back already) to search again before its batch lands (the fewest rounds in flight, then the task the job's gradient favours);
        None otherwise (the picker decides, and waits for a batch as before)."""
        if not self.rounds_ahead:
            return None
        self._touch()
        alive = [t for t in self.tasks if not t.done]
        if not alive or any(t.task_id not in self.flights for t in alive):
            return None
        # only a task with a round back: before that, its round ahead is a blind draw, not evolution (on one H100
        # the early rounds ahead drew 1.3-2.8x the random candidates and made the job slower)
        room = [t for t in alive if t.landed and len(self.flights[t.task_id]) <= self.rounds_ahead]
        if not room:
            return None
        _, prio = self.picker.priorities()
        return min(room, key=lambda t: (len(self.flights[t.task_id]), -prio(t.task_id)))

    # -- one round of one task -------------------------------------------------------------------------
    def _round(self, t: TaskSearch, ahead: bool = False) -> bool:
        """Search, claim, send one batch of task t (`ahead`: while its earlier batches are still measured, else
        after they are joined). False when the job's budget is spent."""
        while not ahead and t.task_id in self.flights:
            self._join(t)
        if t.done:
            return True
        if not t.started:
            t.first_round = self.first_rounds.size(t.task_id)
        room = t.room()
        if room <= 0:
            t.finish()
            return True
        if t.started and not ahead and self.run_stats.pick is not None:
            mine, top, _ = self.run_stats.pick
            room = min(room, self.picker.steering.round_size(t.per_iter, mine, top))
        left = self.budget.left()
        if left <= 0:
            return False
        if t.started:  # a later round: leave what the job's remaining first rounds need
            left -= self.budget.reserve(self.tasks)
            if left <= 0:
                self.check(True, blocked=True)  # a shard waiting for a client gets this one now
                time.sleep(0.2)  # other clients' first rounds are due; the loop picks again
                self.run_stats.waited_s += 0.2
                return True
        t.prepare(min(room, left))
        fresh = t.propose(room)
        if not fresh:
            self._log_round(t, 0, not t.started)  # a search that found nothing new still cost its CPU
            return True
        claimed = self.budget.claim(min(len(fresh), left), None if t.started else t.task_id)
        if claimed == 0:
            t.absorb(fresh, [RunnerResult(None, "not measured: the job's budget is spent")] * len(fresh))
            return False
        first = not t.started
        self._send(t, fresh[:claimed], claimed)
        self.run_stats.rounds += 1
        self._log_round(t, claimed, first)
        return True

    def _log_round(self, t: TaskSearch, claimed: int, first: bool) -> None:
        """The round just sent (or searched and found nothing to send: 0 claimed), with what the picker saw when it let
        the task run and what its search did (ShardRun.round_log)."""
        prio, top, waited = (None, None, 0.0) if first else (self.run_stats.pick or (None, None, 0.0))
        self.run_stats.pick = None
        self.run_stats.round_log.append([round(time.perf_counter() - self.t0, 2), t.job_task.name, claimed,
                                         int(first), _rounded(prio), _rounded(top), round(waited, 2),
                                         *t.last_search])

    def _send(self, t: TaskSearch, fresh: list, claimed: int) -> None:
        """Build the batch and send what built to the runner (the lanes); the task's round is then in flight."""
        target = t.ctx.target
        built = self.builder.build([BuilderInput(c.sch.mod, target) for c in fresh])
        inputs, slots = [], []
        for i, (c, b) in enumerate(zip(fresh, built)):
            if b.error_msg is None:
                inputs.append(RunnerInput(b.artifact_path, target.kind.name, c.args_info))
                slots.append(i)
        if self.screen:
            self.runner.full_below_s = screen_bar(t.best_s)
            self.runner.bar_key = f"{self.job_id}:{t.task_id}"
        self.runner.head = not t.started and t.task_id in self.first_rounds.head()
        self.runner.reference_key = t.job_task.wkey  # the lanes check fully timed outputs (LaneRunner.check_outputs)
        futures = self.runner.run(inputs) if inputs else []
        by_slot = dict(zip(slots, futures))
        flight = InFlight(fresh, built, [by_slot.get(i) or _Failed(b.error_msg) for i, b in enumerate(built)], claimed)
        if self.flights.get(t.task_id):
            self.run_stats.ahead_rounds += 1
        self.flights.setdefault(t.task_id, []).append(flight)
        t.launched(len(fresh), claimed)
        if self.rounds_ahead:
            t.pending_add(fresh)

    def _join(self, t: TaskSearch) -> None:
        """Task t's oldest batch has come back (or is waited for): the search, the cost model and the store get it."""
        flight = self.flights[t.task_id].pop(0)
        if not self.flights[t.task_id]:
            del self.flights[t.task_id]
        cands, built = flight.candidates, flight.built
        if self.rounds_ahead:
            t.pending_drop(cands)
        results = [f.result() for f in flight.futures]
        t.absorb(cands, results)
        ok = [(c, b, r) for c, b, r in zip(cands, built, results) if b.error_msg is None]
        t0 = time.perf_counter()
        if ok:
            timing_of = getattr(self.runner, "timing_of", lambda handle: None)
            self.cost_model.update_rows(t.ctx, [c for c, _, _ in ok], [r for _, _, r in ok],
                                        [timing_of(b.artifact_path) == "brief" for _, b, _ in ok])
        t0 = self.run_stats.clock("features", t0)
        self.records.record_round(t.ctx, cands, built, results, flight.claimed)
        self.run_stats.clock("record", t0)
        t.landed += 1
        t.publish_best()
        self.run_stats.trials += len(cands)
        self.run_stats.per_task[t.job_task.name] = self.run_stats.per_task.get(t.job_task.name, 0) + len(cands)


class _Failed:
    """A future for a candidate that failed to build: it never reached a lane."""

    def __init__(self, msg):
        self.msg = msg

    def done(self) -> bool:
        return True

    def result(self) -> RunnerResult:
        return RunnerResult(None, self.msg)


def _rounded(x: float | None) -> float | None:
    """A priority for the round log: 4 significant digits; +-inf (a task yet to have a round, one left behind) as
    a large finite number, JSON having no infinity."""
    if x is None:
        return None
    if math.isinf(x):
        return 1e18 if x > 0 else -1e18
    return float(f"{x:.4g}")

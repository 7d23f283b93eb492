"""One tuner client's search loop over its shard of a job: MetaSchedule's own search strategy per task
(evolutionary search, through TuneContext), driven round by round the way its task scheduler does it
(every task once, then the largest gradient first; a task's batch stays in flight while others are
searched), with three things the stock scheduler cannot do across processes:

- the trial budget is the job's, claimed atomically from Redis before each round, so N clients together
  spend exactly what the job was given;
- the gradient is job-wide: each round's best latency goes to the store, and a client lets other
  shards' tasks go first while they pay more (services/tuner/sharding.py decides);
- candidates the store already holds (measured before a client died, or by an earlier job of the same
  workload) are answered from the store, not measured again.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Callable

from tvm.s_tir.meta_schedule.builder import BuilderInput
from tvm.s_tir.meta_schedule.runner import RunnerInput, RunnerResult

from shared import store
from shared.messages import JobTask, ShardPhase
from shared.ranking import rank_secs, screen_bar
from services.tuner.metaschedule.records import StoreRecords, candidate_key
from services.tuner.sharding import Steering, behind, first_rounds_reserve, flops_shares, priority

log = logging.getLogger("sharetune.tuner.rounds")

# a task is done when this many rounds in a row found nothing new (stock's sampler gives up after 5
# fruitless draws in a row); the rounds alternate evolution and sampling, so both have been tried
EMPTY_ROUNDS = 5
# MetaSchedule's search strategies stop at max_trials counting every candidate they proposed, the ones the
# store already held too: a task of a re-submitted workload would stop before measuring anything new. The
# strategy gets this much room; the task's own limit (fresh trials) is kept here.
SEARCH_ROOM = 1 << 20
# how long a client's second rounds wait for other clients' first rounds before they stop leaving them budget
# (a shard nobody runs must not hold the job back for good)
RESERVE_WAIT_S = 300.0
# seconds of wall time in each phase, and "sample_cpu": the CPU (every thread of this process) the search's
# sampling used, the cost of a valid candidate that bench/time_to_quality.py reports
PHASES = ("defaults", "sample", "features", "record", "sample_cpu")


class Stopped(Exception):
    """The client was asked to stop (shutdown) or lost its lease: the shard goes back to the queue."""


@dataclass
class _Task:
    job_task: JobTask
    ctx: object
    best_s: float = math.inf
    dry: int = 0
    done: bool = False
    inflight: tuple | None = None  # (candidates, builder results, futures, claimed)
    reused: int = 0
    cold: bool = False
    started: bool = False  # had its first round (job-wide: a resumed shard's tasks may have)
    fixed: bool = False  # its design space has no sampled decisions: a handful of schedules, all known at once
    spent: bool = False  # every schedule of a fixed space has been proposed
    proposes: int = 0  # candidates its search proposes a round (what the round may measure)
    full_draws: bool = False  # a small draw found nothing new (the store held it): every round draws a full one


@dataclass
class ShardRun:
    """What a shard's loop did, for the job's result and the benchmarks."""

    rounds: int = 0
    trials: int = 0  # measured and recorded (claimed from the job's budget)
    reused: int = 0  # proposed again but already in the store: not measured, not charged
    waited_s: float = 0.0  # let other shards' tasks go first, or their first rounds' budget be left to them
    # where the rest of the client's time went, in seconds: defaults (timing each task's default schedule),
    # sample (MetaSchedule's search: sampling, evolution, the cost model's predictions), features (the
    # measured rows' features for the updater), record (results into the store and the search)
    phase_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    warm_switches: int = 0  # tasks that moved from sampling to evolutionary search
    seeds: int = 0  # warm seeds sent to be measured (first rounds' re-fitted records of nearby workloads)
    per_task: dict[str, int] = field(default_factory=dict)


@dataclass
class Shard:
    """Which shard of which job the loop searches, and the job's round sizes."""

    redis: object
    job_id: str
    shard: int
    tasks: list[JobTask]
    trials_per_iter: int
    max_trials_per_task: int
    first_round: int | None = None  # sharding.first_round_size (default: a full round)


@dataclass
class SearchParts:
    """What the loop drives: `make_context(task, cold)` builds a task's TuneContext; the builder and runner
    (deferred builds, lanes), TVM's database of the shard's workloads, the central cost model, the store's
    records; `defaults(tasks)`: task_id -> seconds of its default schedule, timed before the first rounds;
    `seeds` (seeds.SeedSource): a first round starts with nearby workloads' best records."""

    make_context: Callable
    builder: object
    runner: object
    database: object
    cost_model: object
    records: StoreRecords
    defaults: Callable[[list[JobTask]], dict] | None = None
    seeds: object = None


class ShardLoop:
    """Cold: the cost model has no snapshot yet, so it predicts at random, and evolving candidates against
    random scores (70 % of stock's search time on the H200 conv tasks) buys nothing over sampling the design
    space: a cold task samples (MetaSchedule's replay-trace strategy) and moves to evolutionary search once
    the central model is trained and knows the task (_may_evolve)."""

    def __init__(self, shard: Shard, parts: SearchParts, steering: Steering | None = None,
                 check: Callable[..., None] | None = None, cold_start: bool = True, screen: bool = False):
        self.redis, self.job_id, self.shard = shard.redis, shard.job_id, shard.shard
        self.make_context, self.cold_start = parts.make_context, cold_start
        self.tasks = [_Task(t, None) for t in shard.tasks]
        self.builder, self.runner, self.database = parts.builder, parts.runner, parts.database
        self.cost_model, self.records = parts.cost_model, parts.records
        self.per_iter, self.max_per_task = shard.trials_per_iter, shard.max_trials_per_task
        self.first_round = shard.first_round or shard.trials_per_iter
        self.defaults = parts.defaults
        self.screen = screen  # screened timing: each round's candidates carry the bar of their task's best
        self.seeds = parts.seeds
        self.steering = steering or Steering()
        # raises Stopped when the client must hand the shard back; its argument says whether every task
        # of the shard has had a round (a client may then yield to a shard no client has taken)
        self.check = check or (lambda passed, blocked=False: None)
        self.run_stats = ShardRun()
        self._reserve_since: float | None = None
        self.mine = {t.job_task.task_id for t in self.tasks}

    # -- the loop -------------------------------------------------------------------------------------
    def run(self) -> ShardRun:
        hist = store.history(self.redis, self.job_id)
        # a task runs its default schedule until a candidate beats it: that is its latency to the gradient
        t0 = time.perf_counter()
        default = self.defaults([t.job_task for t in self.tasks]) if self.defaults else {}
        self._spent("defaults", t0)
        for t in self.tasks:
            past = hist.get(t.job_task.task_id) or []
            t.started = bool(past)
            self._start_context(t, self.cold_start and not self._may_evolve(t), self._proposes(t))
            t.best_s = min(past) if past else self._best_in_store(t)
            if default.get(t.job_task.task_id):
                t.best_s = min(t.best_s, default[t.job_task.task_id])
        try:
            # first every task once (MetaSchedule's round-robin start; sharding.first_round_size), heaviest first
            for t in self.tasks:
                self.check(False)
                if not self._round(t):
                    return self.run_stats
            while True:
                self.check(True)
                t = self._pick()
                if t is None:
                    break
                if not self._round(t):
                    break
        finally:
            for t in self.tasks:
                if t.inflight is not None:
                    self._join(t)
                t.ctx.post_tuning()
        return self.run_stats

    def _start_context(self, t: _Task, cold: bool, proposes: int | None = None) -> None:
        """A fresh search for task t (cold: sampling; else evolution), proposing `proposes` candidates a round
        (default: as many as before)."""
        resized = proposes is not None and t.ctx is not None and cold == t.cold
        if t.ctx is not None:
            t.ctx.post_tuning()
        t.ctx, t.cold = self.make_context(t.job_task, cold), cold
        t.proposes = proposes or t.proposes or self.per_iter
        spaces = t.ctx.generate_design_space()
        t.fixed = all(len(sp.trace.decisions) == 0 for sp in spaces)
        t.ctx.pre_tuning(SEARCH_ROOM, t.proposes, spaces, self.database, self.cost_model)
        if resized:
            return
        if not cold:
            self.run_stats.warm_switches += 1
        log.info("job %s shard %s: task %s %s", self.job_id, self.shard, t.job_task.name,
                 "samples the design space (no trained cost model yet)" if cold else "runs evolutionary search")

    def _may_evolve(self, t: _Task) -> bool:
        """Evolutionary search once the central model is trained, and, where the store's knowledge of nearby
        workloads is used (seeds), once it knows this task: its first round measured, or its workload or a near
        one in the store (seeds.SeedSource.knows); until then the task samples."""
        if not self.cost_model.trained():
            return False
        return t.started or self.seeds is None or self.seeds.knows(t.job_task)

    def _best_in_store(self, t: _Task) -> float:
        good = [r for r in store.records(self.redis, t.job_task.wkey) if r.error is None and r.run_secs]
        return min((rank_secs(r.run_secs) for r in good), default=math.inf)

    def _alive(self) -> list[_Task]:
        return [t for t in self.tasks if not t.done]

    def _pick(self) -> _Task | None:
        """The task with the largest priority (sharding.priority); waits while other shards' tasks
        have clearly more."""
        t0 = time.time()
        while True:
            self._touch()
            alive = self._alive()
            if not alive:
                return None
            hist = store.history(self.redis, self.job_id)
            job_tasks = {t.task_id: t for t in store.job_tasks(self.redis, self.job_id)}
            shares = flops_shares(list(job_tasks.values()))
            trials = {tid: p.trials for tid, p in store.job_progress(self.redis, self.job_id).items()}

            def prio(tid: str) -> float:
                return priority(hist.get(tid, []), job_tasks[tid].weight, behind(tid, shares, trials, self.per_iter))

            grads = {t.job_task.task_id: prio(t.job_task.task_id) for t in alive}
            best = max(alive, key=lambda t: (grads[t.job_task.task_id], -self.tasks.index(t)))
            others, live = self._others(job_tasks, prio)
            if time.time() - t0 > self.steering.max_wait_s or self.steering.may_run(
                    grads[best.job_task.task_id], others, live):
                self.run_stats.waited_s += time.time() - t0
                return best
            self.check(True)
            time.sleep(0.1)

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

    def _touch(self) -> None:
        """Join the tasks whose batches have all come back (so their gradients are current)."""
        for t in self.tasks:
            if t.inflight is not None and all(f.done() for f in t.inflight[2]):
                self._join(t)

    # -- one round of one task -------------------------------------------------------------------------
    def _round(self, t: _Task) -> bool:
        """Search, claim, send one batch of task t. False when the job's budget is spent."""
        if t.inflight is not None:
            self._join(t)
        if t.done:
            return True
        room = self._room(t)
        if room <= 0:
            return self._finish_task(t)
        left = store.budget_left(self.redis, self.job_id)
        if left <= 0:
            return False
        if t.started:  # a later round: leave what the job's remaining first rounds need
            left -= self._reserve()
            if left <= 0:
                self.check(True, blocked=True)  # a shard waiting for a client gets this one now
                time.sleep(0.2)  # other clients' first rounds are due; the loop picks again
                self.run_stats.waited_s += 0.2
                return True
        proposes = self._proposes(t, min(room, left))
        if t.cold and not t.dry and self._may_evolve(t):
            # the central model is trained and knows this task: evolve against it (unless evolution just came up empty)
            self._start_context(t, cold=False, proposes=proposes)
        elif not t.fixed and t.proposes != proposes:
            self._start_context(t, t.cold, proposes)
        cands, fresh = self._search(t, room)
        if not t.started:
            fresh = self._with_seeds(t, fresh, room)
        if not fresh:
            return True
        claimed = store.claim_trials(self.redis, self.job_id, self.shard, min(len(fresh), left))
        if claimed == 0:
            t.ctx.notify_runner_results(fresh, [RunnerResult(None, "not measured: the job's budget is spent")] * len(fresh))
            return False
        fresh = fresh[:claimed]
        target = t.ctx.target
        built = self.builder.build([BuilderInput(c.sch.mod, target) for c in fresh])
        inputs, slots = [], []
        for i, (c, b) in enumerate(zip(fresh, built)):
            if b.error_msg is None:
                inputs.append(RunnerInput(b.artifact_path, target.kind.name, c.args_info))
                slots.append(i)
        if self.screen:
            self.runner.full_below_s = screen_bar(t.best_s)
        futures = self.runner.run(inputs) if inputs else []
        by_slot = dict(zip(slots, futures))
        t.inflight = (fresh, built, [by_slot.get(i) or _Failed(b.error_msg) for i, b in enumerate(built)], claimed)
        t.started = True
        if t.spent and claimed == len(fresh):
            self._finish_task(t, exhausted=True)
        self.run_stats.rounds += 1
        return True

    def _with_seeds(self, t: _Task, fresh: list, room: int) -> list:
        """A first round's candidates with the warm seeds first (seeds.seed_cap of the round at most): the
        nearest stored workloads' best traces re-fitted to this task, none the store already holds. They are
        measured, recorded and counted like the search's own; the search strategy is told their results as
        it is of every round's (its trial counters have SEARCH_ROOM to spare)."""
        from services.tuner.metaschedule.seeds import seed_cap

        cap = seed_cap(room) if self.seeds is not None else 0
        if cap == 0:
            return fresh
        wkey = t.job_task.wkey
        have = {candidate_key(wkey, c) for c in fresh}
        picked = []
        t0 = time.perf_counter()
        for cand, source in self.seeds.candidates(t.ctx, t.job_task):
            key = candidate_key(wkey, cand)
            if key not in have:
                have.add(key)
                picked.append((cand, key, source))
            if len(picked) >= cap:
                break
        self._spent("sample", t0)
        known = self.records.known(wkey, [k for _, k, _ in picked])
        picked = [(c, k, src) for c, k, src in picked if k not in known]
        for _, key, source in picked:
            self.records.seeded[key] = source
        self.run_stats.seeds += len(picked)
        return ([c for c, _, _ in picked] + fresh)[:room]

    def _reserve(self) -> int:
        """Trials to leave for first rounds no client has made yet (a task whose first round found nothing
        new counts as having had it); 0 once this client has waited RESERVE_WAIT_S for them."""
        if self._reserve_since is None:
            self._reserve_since = time.time()
        if time.time() - self._reserve_since > RESERVE_WAIT_S:
            return 0
        had = set(store.history(self.redis, self.job_id)) | {t.job_task.task_id for t in self.tasks
                                                              if t.started or t.done or t.dry}
        reserve = first_rounds_reserve([t.task_id for t in store.job_tasks(self.redis, self.job_id)], had,
                                       self.first_round)
        if reserve == 0:
            self._reserve_since = time.time()  # the wait clock starts again at the next shortfall
        return reserve

    def _room(self, t: _Task) -> int:
        """How many candidates task t's next round may measure: its first round the job's even share
        (sharding.first_round_size), then up to its own limit."""
        prog = self.records.progress.get(t.job_task.task_id)
        room = self.max_per_task - (prog.trials if prog is not None else 0)
        return room if t.started or room <= 0 else min(room, self.first_round)

    def _proposes(self, t: _Task, room: int | None = None) -> int:
        """How many candidates task t's search proposes for a round that may measure `room`: no more than that,
        since the rest would be dropped unmeasured (a first round measures the job's even share, 37 of 64 for
        ResNet-18 at 1024 trials, and sampling one valid CUDA conv schedule costs ~0.3 s of CPU)."""
        if t.full_draws:
            return self.per_iter
        return max(1, min(self.per_iter, self._room(t) if room is None else room))

    def _search(self, t: _Task, room: int) -> tuple[list, list]:
        """One search of task t: (its candidates, those not in the store yet, at most `room`). What the
        store already holds goes straight back to the search; nothing is measured again. A round that
        finds nothing new is not proof that the space is spent: on CUDA most samples fail the GPU checks,
        and evolution gives up when it cannot sample 50 valid unmeasured schedules, while sampling alone
        still finds new ones. So such a round makes the task try the other strategy next, and only
        EMPTY_ROUNDS of them in a row, both strategies tried, end it."""
        small = t.proposes < self.per_iter and not t.full_draws  # a draw of only what the round may measure
        t0, cpu0 = time.perf_counter(), time.process_time()
        got = t.ctx.generate_measure_candidates()
        self._spent("sample", t0)
        self.run_stats.phase_s["sample_cpu"] += time.process_time() - cpu0
        cands = list(got) if got is not None else []
        keys = [candidate_key(t.job_task.wkey, c) for c in cands]
        known = self.records.known(t.job_task.wkey, keys)
        fresh, seen = [], set()
        for c, k in zip(cands, keys):
            if k not in known and k not in seen:
                fresh.append(c)
                seen.add(k)
        reused = [(c, known[k]) for c, k in zip(cands, keys) if k in known]
        if reused:
            # the store knows this workload (an earlier job, a resumed shard): draw full rounds from now on, so a
            # round still finds what it may measure among the schedules the store already holds
            t.full_draws = t.full_draws or small
            t.ctx.notify_runner_results([c for c, _ in reused], [_from_record(r) for _, r in reused])
            self.run_stats.reused += len(reused)
            t.reused += len(reused)
            for _, r in reused:
                if r.error is None and r.run_secs:
                    t.best_s = min(t.best_s, rank_secs(r.run_secs))
        if fresh:
            t.dry = 0
            # a space without sampled decisions yields every schedule it has in one round
            t.spent = t.fixed and len(fresh) <= room
            return cands, fresh[:room]
        if self.redis is not None:  # a round all the same: other clients stop reserving its first round
            store.push_history(self.redis, self.job_id, t.job_task.task_id, t.best_s if t.best_s < math.inf else 1e9)
        if t.fixed:  # nothing new in a space whose every schedule one round proposes: spent
            self._finish_task(t, exhausted=True)
            return cands, []
        if small:  # a draw smaller than a round, all of it known: not yet proof of a dry space
            t.full_draws = True
            return cands, []
        t.dry += 1
        if t.dry >= EMPTY_ROUNDS:
            self._finish_task(t, exhausted=True)
        else:
            self._start_context(t, cold=not t.cold)
        return cands, []

    def _join(self, t: _Task) -> None:
        cands, built, futures, claimed = t.inflight
        t.inflight = None
        results = [f.result() for f in futures]
        t.ctx.notify_runner_results(cands, results)
        ok = [(c, b, r) for c, b, r in zip(cands, built, results) if b.error_msg is None]
        t0 = time.perf_counter()
        if ok:
            timing_of = getattr(self.runner, "timing_of", lambda handle: None)
            self.cost_model.update_rows(t.ctx, [c for c, _, _ in ok], [r for _, _, r in ok],
                                        [timing_of(b.artifact_path) == "brief" for _, b, _ in ok])
        t0 = self._spent("features", t0)
        self.records.record_round(t.ctx, cands, built, results, claimed)
        self._spent("record", t0)
        for r in results:
            if r.error_msg is None and r.run_secs:
                t.best_s = min(t.best_s, rank_secs(r.run_secs))
        store.push_history(self.redis, self.job_id, t.job_task.task_id, t.best_s if t.best_s < math.inf else 1e9)
        self.run_stats.trials += len(cands)
        self.run_stats.per_task[t.job_task.name] = self.run_stats.per_task.get(t.job_task.name, 0) + len(cands)

    def _spent(self, phase: str, since: float) -> float:
        now = time.perf_counter()
        self.run_stats.phase_s[phase] += now - since
        return now

    def _finish_task(self, t: _Task, exhausted: bool = False) -> bool:
        t.done = True
        if exhausted:  # said in its progress: fewer trials than others is then no starvation
            prog = self.records.progress.get(t.job_task.task_id)
            if prog is not None and self.redis is not None:
                prog.exhausted = True
                store.put_progress(self.redis, self.job_id, prog)
        return True


class _Failed:
    """A future for a candidate that failed to build: it never reached a lane."""

    def __init__(self, msg):
        self.msg = msg

    def done(self) -> bool:
        return True

    def result(self) -> RunnerResult:
        return RunnerResult(None, self.msg)


def _from_record(rec) -> RunnerResult:
    if rec.error is not None or not rec.run_secs:
        return RunnerResult(None, rec.error or "no run time")
    return RunnerResult([rank_secs(rec.run_secs)], None)

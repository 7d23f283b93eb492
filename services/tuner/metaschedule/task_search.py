"""One task's search inside a shard's loop (rounds.py): MetaSchedule's search strategy for the task (its
TuneContext), the best it has found, and where it stands (SearchState). The loop decides when the task gets a
round, sends what `propose` returns to be measured, and hands the results back through `absorb`.

A task's states:

    NEW ──begin──> SAMPLING  (cost model cold, or it does not know the task yet)
        └─begin──> EVOLVING  (cost model trained and knows the task, or cold_start off)
    SAMPLING ──prepare (model trained and knows it)──> EVOLVING
    SAMPLING <──a dry round (nothing new)──> EVOLVING   (each strategy finds what the other cannot)
    SAMPLING / EVOLVING ──> EXHAUSTED  (a fixed or countable space sent whole, or EMPTY_ROUNDS rounds dry)
    SAMPLING / EVOLVING ──> AT_LIMIT   (the task measured max_trials_per_task)
"""
from __future__ import annotations

import logging
import math
import time
from enum import StrEnum

from tvm.s_tir.meta_schedule.runner import RunnerResult

from shared import store
from shared.messages import JobTask
from shared.ranking import rank_secs
from services.tuner.metaschedule.loop_parts import SearchParts, Shard, ShardRun
from services.tuner.metaschedule.records import candidate_key

log = logging.getLogger("sharetune.tuner.rounds")

# a task is done when this many rounds in a row found nothing new (stock's sampler gives up after 5
# fruitless draws in a row); the rounds alternate evolution and sampling, so both have been tried
EMPTY_ROUNDS = 5
# MetaSchedule's search strategies stop at max_trials counting every candidate they proposed, the ones the
# store already held too: a task of a re-submitted workload would stop before measuring anything new. The
# strategy gets this much room; the task's own limit (fresh trials) is kept here.
SEARCH_ROOM = 1 << 20


class SearchState(StrEnum):
    NEW = "new"  # no search yet (the loop has not begun it)
    # samples the design space (replay-trace; on CUDA tile draws within the GPU's limits, sampling.ValidReplay):
    # the cost model would guide nothing yet
    SAMPLING = "sampling"
    EVOLVING = "evolving"  # MetaSchedule's evolutionary search against the cost model
    EXHAUSTED = "exhausted"  # done: its design space is spent
    AT_LIMIT = "at_limit"  # done: it has measured its max_trials_per_task


DONE = (SearchState.EXHAUSTED, SearchState.AT_LIMIT)


class TaskSearch:
    """Cold: the cost model has no snapshot yet, so it predicts at random, and evolving candidates against
    random scores (70 % of stock's search time on the H200 conv tasks) buys nothing over sampling the design
    space: a cold task samples (context.tune_context's cold strategy) and moves to evolutionary search once
    the central model is trained and knows the task (may_evolve)."""

    def __init__(self, job_task: JobTask, shard: Shard, parts: SearchParts, stats: ShardRun):
        self.job_task, self.shard, self.parts, self.stats = job_task, shard, parts, stats
        self.per_iter = shard.trials_per_iter
        self.first_round = shard.first_round or shard.trials_per_iter
        self.ctx = None
        self.state = SearchState.NEW
        self.best_s = math.inf
        self.searched_s = math.inf  # the best of its own measured candidates (best_s counts its default too)
        self.dry = 0  # rounds in a row that found nothing new
        self.reused = 0  # proposed candidates the store already held
        self.started = False  # had its first round (job-wide: a resumed shard's tasks may have)
        self.landed = 0  # its rounds whose results came back (a resumed shard's: the job's history of it)
        self.fixed = False  # its design space has no sampled decisions: a handful of schedules, all known at once
        self.schedules: int | None = None  # how many its space holds, where countable (countable_schedules)
        self.proposes = 0  # candidates its search proposes a round (what the round may measure)
        self.full_draws = False  # a small draw found nothing new (the store held it): every round draws a full one
        self.last_search: list = ["drawn", 0.0, 0]  # the last round's search: kind, CPU s, candidates proposed
        self._whole_space = False  # the last round's fresh candidates are every schedule of a fixed space
        self.pending: set[str] = set()  # keys of its candidates sent and not yet joined (rounds ahead)
        self.seed_looks: list[int] = []  # the seeds each round that looked for them found

    @property
    def drawn(self) -> int:  # candidates the last round's search proposed
        return self.last_search[2]

    @property
    def task_id(self) -> str:
        return self.job_task.task_id

    @property
    def done(self) -> bool:
        return self.state in DONE

    @property
    def cold(self) -> bool:
        return self.state == SearchState.SAMPLING

    @property
    def spent(self) -> bool:
        """Every schedule of its fixed space has been proposed (the task ends once they are all sent)."""
        return self._whole_space

    # -- the search's setup -----------------------------------------------------------------------------
    def begin(self, past: list[float], default_s: float | None, cold_start: bool) -> None:
        """The search before the loop's first round: `past`, the job's round bests of this task (a resumed
        shard's task has had its first round); `default_s`, its default schedule's seconds: a task runs that
        until a candidate beats it, so it is the task's latency to the gradient."""
        self.started, self.landed = bool(past), len(past)
        self.restart(cold_start and not self.may_evolve(), self.draw_size())
        self.best_s = min(past) if past else self._best_in_store()
        if default_s:
            self.best_s = min(self.best_s, default_s)

    def restart(self, cold: bool, proposes: int | None = None) -> None:
        """A fresh search (cold: sampling; else evolution), proposing `proposes` candidates a round (default: as
        many as before)."""
        state = SearchState.SAMPLING if cold else SearchState.EVOLVING
        resized = proposes is not None and self.state == state
        if self.ctx is not None:
            self.ctx.post_tuning()
        self.ctx, self.state = self.parts.make_context(self.job_task, cold), state
        self.proposes = proposes or self.proposes or self.per_iter
        spaces = self.ctx.generate_design_space()
        self.fixed = all(len(sp.trace.decisions) == 0 for sp in spaces)
        self.schedules = countable_schedules(spaces)
        self.ctx.pre_tuning(SEARCH_ROOM, self.proposes, spaces, self.parts.database, self.parts.cost_model)
        if resized:
            return
        if not cold:
            self.stats.warm_switches += 1
        log.info("job %s shard %s: task %s %s", self.shard.job_id, self.shard.shard, self.job_task.name,
                 "samples the design space (no trained cost model yet)" if cold else "runs evolutionary search")

    def may_evolve(self) -> bool:
        """Evolutionary search once the central model is trained, and, where the store's knowledge of nearby
        workloads is used (seeds), once it knows this task: its first round measured, or its workload or a near
        one in the store (seeds.SeedSource.knows); until then the task samples."""
        if not self.parts.cost_model.trained():
            return False
        return self.started or self.parts.seeds is None or self.parts.seeds.knows(self.job_task)

    def _best_in_store(self) -> float:
        good = [r for r in store.records(self.shard.redis, self.job_task.wkey) if r.error is None and r.run_secs]
        return min((rank_secs(r.run_secs) for r in good), default=math.inf)

    # -- a round's size ------------------------------------------------------------------------------------
    def room(self) -> int:
        """How many candidates the next round may measure: the first round the job's even share
        (allocation.first_round_size), then up to the task's own limit."""
        prog = self.parts.records.progress.get(self.task_id)
        room = self.shard.max_trials_per_task - (prog.trials if prog is not None else 0) - len(self.pending)
        return room if self.started or room <= 0 else min(room, self.first_round)

    def draw_size(self, room: int | None = None) -> int:
        """How many candidates the search proposes for a round that may measure `room`: no more than that,
        since the rest would be dropped unmeasured (a first round measures the job's even share, 37 of 64 for
        ResNet-18 at 1024 trials, and sampling one valid CUDA conv schedule costs ~0.3 s of CPU)."""
        if self.full_draws:
            return self.per_iter
        return max(1, min(self.per_iter, self.room() if room is None else room))

    def prepare(self, measurable: int) -> None:
        """Before a round that may measure `measurable`: evolve once the central model is trained and knows the
        task (unless evolution just came up empty), and draw what the round may measure."""
        proposes = self.draw_size(measurable)
        if self.cold and not self.dry and self.may_evolve():
            self.restart(cold=False, proposes=proposes)
        elif not self.fixed and self.proposes != proposes:
            self.restart(self.cold, proposes)

    # -- one round -----------------------------------------------------------------------------------------
    def propose(self, room: int) -> list:
        """Search one round: the candidates to measure, at most `room`, none the store already holds (those go
        straight back to the search: nothing is measured again); warm seeds first where due."""
        return self._with_seeds(self._search(room), room)

    def _search(self, room: int) -> list:
        """A round that finds nothing new is not proof that the space is spent: on CUDA most samples fail the
        GPU checks, and evolution gives up when it cannot sample 50 valid unmeasured schedules, while sampling
        alone still finds new ones. So such a round makes the task try the other strategy next, and only
        EMPTY_ROUNDS of them in a row, both strategies tried, end it."""
        small = self.proposes < self.per_iter and not self.full_draws  # a draw of only what the round may measure
        t0, cpu0 = time.perf_counter(), time.process_time()
        got = self.ctx.generate_measure_candidates()
        self.stats.clock("sample", t0)
        cpu = time.process_time() - cpu0
        self.stats.phase_s["sample_cpu"] += cpu
        cands = list(got) if got is not None else []
        if self.cold:
            self.stats.phase_s["drawn"] += len(cands)
        else:
            self.stats.phase_s["evolve_cpu"] += cpu
            self.stats.phase_s["evolved"] += len(cands)
        self.last_search = ["drawn" if self.cold else "evolved", round(cpu, 2), len(cands)]
        fresh, reused, held = split_known(self.parts.records, self.job_task.wkey, cands, self.pending)
        if reused:
            # the store knows this workload (an earlier job, a resumed shard): draw full rounds from now on, so a
            # round still finds what it may measure among the schedules the store already holds
            self.full_draws = self.full_draws or small
            self.absorb([c for c, _ in reused], [_from_record(r) for _, r in reused])
            self.stats.reused += len(reused)
            self.reused += len(reused)
        if fresh:
            self.dry = 0
            # a space without sampled decisions yields every schedule it has in one round
            self._whole_space = self.fixed and len(fresh) <= room
            return fresh[:room]
        if not held:  # a round ahead whose finds are all still being measured has not found the space dry
            self._found_nothing(small)
        return []

    def pending_add(self, candidates: list) -> None:
        """Candidates sent to be measured: a round searched before they land proposes none of them again."""
        self.pending.update(candidate_key(self.job_task.wkey, c) for c in candidates)

    def pending_drop(self, candidates: list) -> None:
        self.pending.difference_update(candidate_key(self.job_task.wkey, c) for c in candidates)

    def _found_nothing(self, small: bool) -> None:
        self.publish_best()  # a round all the same: other clients stop reserving its first round
        if self.fixed or self._every_schedule_out():  # nothing new in a space it has proposed whole: spent
            self.finish(exhausted=True)
        elif small:  # a draw smaller than a round, all of it known: not yet proof of a dry space
            self.full_draws = True
        else:
            self.dry += 1
            if self.dry >= EMPTY_ROUNDS:
                self.finish(exhausted=True)
            else:
                self.restart(cold=not self.cold)

    def _with_seeds(self, fresh: list, room: int) -> list:
        """The round's candidates with warm seeds first where they are due (seeds.SeedSource.due)."""
        seeds = self.parts.seeds
        if seeds is None or not seeds.due(self.started, self.landed, self.seed_looks):
            return fresh
        t0 = time.perf_counter()
        out, picked = seeds.seeded_round(self.ctx, self.job_task, self.parts.records, fresh, room)
        self.stats.clock("sample", t0)
        self.seed_looks.append(picked)
        self.stats.seeds += picked
        self.stats.late_seeds += picked if self.started else 0
        return out

    def launched(self, sent: int, claimed: int) -> None:
        """The round's batch went out (`sent` candidates, `claimed` trials): the task has had its first round,
        and a fixed or countable space whose every schedule went out is spent."""
        self.started = True
        if (self._whole_space or self._every_schedule_out(sent)) and claimed == sent:
            self.finish(exhausted=True)

    def _every_schedule_out(self, sending: int = 0) -> bool:
        if self.schedules is None:
            return False
        prog = self.parts.records.progress.get(self.task_id)
        return (prog.trials if prog is not None else 0) + len(self.pending) + sending >= self.schedules

    def absorb(self, candidates: list, results: list[RunnerResult]) -> None:
        """Results for candidates the search proposed (measured, or answered from the store): the search
        strategy learns them, and a valid one may be the task's new best."""
        self.ctx.notify_runner_results(candidates, results)
        for r in results:
            if r.error_msg is None and r.run_secs:
                self.searched_s = min(self.searched_s, rank_secs(r.run_secs))
        self.best_s = min(self.best_s, self.searched_s)

    def publish_best(self) -> None:
        """The task's best so far into the job's history (the job-wide gradient; 1e9 while it has none)."""
        if self.shard.redis is not None:
            store.push_history(self.shard.redis, self.shard.job_id, self.task_id,
                               self.best_s if self.best_s < math.inf else 1e9)
            if self.searched_s < math.inf:
                store.put_searched(self.shard.redis, self.shard.job_id, self.task_id, self.searched_s)

    def finish(self, exhausted: bool = False) -> None:
        """Done: its design space is spent (exhausted, said in its progress: fewer trials than others is then no
        starvation), or it has measured its limit."""
        self.state = SearchState.EXHAUSTED if exhausted else SearchState.AT_LIMIT
        if exhausted:
            prog = self.parts.records.progress.get(self.task_id)
            if prog is not None and self.shard.redis is not None:
                prog.exhausted = True
                store.put_progress(self.shard.redis, self.shard.job_id, prog)
        if not self.started:  # ended without a round: no client may keep leaving budget for its first one
            self.publish_best()


def _from_record(rec) -> RunnerResult:
    if rec.error is not None or not rec.run_secs:
        return RunnerResult(None, rec.error or "no run time")
    return RunnerResult([rank_secs(rec.run_secs)], None)


def split_known(records, wkey: str, cands: list, pending: set) -> tuple[list, list, int]:
    """(the candidates the store does not hold and none of the task's batches in flight (`pending`) has, each
    once; (candidate, its record) of those the store holds; how many are in flight)."""
    keys = [candidate_key(wkey, c) for c in cands]
    known = records.known(wkey, keys)
    fresh, seen = [], set()
    for c, k in zip(cands, keys):
        if k not in known and k not in seen and k not in pending:
            fresh.append(c)
            seen.add(k)
    held = sum(1 for k in keys if k in pending and k not in known)
    return fresh, [(c, known[k]) for c, k in zip(cands, keys) if k in known], held


def countable_schedules(spaces: list) -> int | None:
    """How many schedules the design spaces hold where only categorical choices are sampled (a norm's thread
    count: a handful), else None. A random draw of such a space repeats itself long before a round is full, so
    the task is spent once that many are measured, not after EMPTY_ROUNDS dry rounds (on an H100 a batch norm
    of 6 schedules ran evolutionary rounds that proposed nothing, ~7 s of a client's CPU each)."""
    total = 0
    for space in spaces:
        count = 1
        for inst in space.trace.decisions:
            if inst.kind.name != "SampleCategorical":
                return None
            count *= len(inst.attrs[0])
        total += count
    return total

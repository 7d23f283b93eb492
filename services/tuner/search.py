"""The tuner client's core: run MetaSchedule's own search (evolutionary strategy, gradient task
scheduler) over one shard of a job's tasks, with the lanes as builder/runner, the store as database, and the
central updater's snapshots as cost model; then compile the tuned and untuned model."""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from shared import lanes, store
from shared.messages import (JobResult, JobSpec, JobState, JobTask, TaskBest, TimingConfig, TrialAccounting,
                             lane_kind, lane_utilisation, target_kind)
from shared.ranking import default_secs, rank_secs
from shared.settings import TunerSettings


@dataclass
class ShardJob:
    """One shard of a job as its search reads it from the store: the job's spec and TVM target, the shard's
    tasks with their workload modules, and the size of a task's first round."""

    job_id: str
    shard: int
    spec: JobSpec
    target: object
    tasks: list[JobTask]
    mods: dict
    first_round: int

    @property
    def kind(self) -> str:
        return target_kind(self.spec.target)


def tune_shard(send, redis, job_id: str, shard: int, settings: TunerSettings, check=None):
    """Search one shard's tasks until the job's budget is spent or its tasks are done. `check` raises
    rounds.Stopped when the client must hand the shard back (shutdown, lost lease). `send(task, payload,
    queue)` publishes a message (services.tuner.tasks, the Celery boundary, gives it). `settings`: the tuner's
    work dir, batch grace, search threads and population (TunerSettings.population), cold start, timing floor,
    valid sampling and warm seeds."""
    from services.tuner.metaschedule.lane_runner import CandidateStash, TimeSplit
    from services.tuner.allocation import Steering
    from services.tuner.metaschedule.rounds import Shard, ShardLoop
    from shared.stopping import StopRules

    job = load_shard(redis, job_id, shard, settings.work_dir)
    pop = settings.population(job.spec.trials_per_iter)
    split, stash = TimeSplit(), CandidateStash()
    runner = lane_runner(send, redis, job.spec, job.target, settings, stash, split)
    if settings.fair_rounds:
        runner.priority = lambda: round_priority_of(redis, job_id, settings.fair_measure)
    parts = search_parts(send, redis, job, settings, runner, stash, split, pop)
    t0 = time.time()
    spec = job.spec
    first_round = first_round_of(redis, job, settings, parts.cost_model)
    loop = ShardLoop(Shard(redis, job_id, shard, job.tasks, spec.trials_per_iter, spec.max_trials_per_task or spec.trials,
                           first_round),
                     parts, steering=Steering(stalled=settings.stalled_task_weight,
                                              stalled_rounds=settings.stalled_task_rounds,
                                              prorata=settings.prorata_rounds, reach=settings.default_reach),
                     check=check, cold_start=settings.cold_start, screen=spec.timing == "screen",
                     rounds_ahead=settings.rounds_ahead if spec.rounds_ahead is None else spec.rounds_ahead,
                     stop_rules=StopRules(spec.time_limit_s, spec.patience, spec.min_gain_pct))
    run = loop.run()
    store.put_split(redis, job_id, shard, shard_times(split, run, time.time() - t0, pop, parts.seeds,
                                                      getattr(parts.cost_model, "ranked_rounds", 0), first_round))
    return run


def first_round_of(redis, job: ShardJob, settings: TunerSettings, cost_model) -> int:
    """The size of the job's first rounds: the even one (allocation.first_round_size), or its ranked share
    (allocation.ranked_first_round) where the central model ranks them: a CUDA job with valid sampling and a
    pool, the model trained for the job's family when its first client starts (decided once for the job,
    store.decide_ranked_first_rounds, so every client sizes its first rounds alike)."""
    from services.tuner.allocation import ranked_first_round

    share = settings.ranked_first_round_share
    if share >= 1 or settings.first_round_pool <= 1 or not settings.valid_sampling or job.kind != "cuda":
        return job.first_round
    if not store.decide_ranked_first_rounds(redis, job.job_id, bool(cost_model.trained())):
        return job.first_round
    return ranked_first_round(job.first_round, share)


def round_priority_of(redis, job_id: str, measure: str = "measured") -> int:
    """The broker priority of the job's next round among the running jobs (allocation.round_priority), their
    shares counted as `measure` says (TunerSettings.fair_measure)."""
    from services.tuner.allocation import round_priority

    loads = store.fair_loads(redis, measure)
    mine = loads.pop(job_id, 0)
    return round_priority(mine, list(loads.values()))


def load_shard(redis, job_id: str, shard: int, work_dir: Path) -> ShardJob:
    """The shard's job, target and tasks, its job directory made, its target's tensor intrinsics loaded before
    its workloads are."""
    from services.tuner.metaschedule.ir_codec import load_ir, target_from_json
    from services.tuner.metaschedule.intrinsics import load_tensor_intrinsics
    from services.tuner.allocation import first_round_size

    spec = store.job_spec(redis, job_id)
    target = target_from_json(store.job_hash(redis, job_id).target_json)
    load_tensor_intrinsics(target_kind(spec.target))
    plan = store.shards(redis, job_id)[shard]
    by_id = {t.task_id: t for t in store.job_tasks(redis, job_id)}
    first_round = first_round_size(spec.trials, len(by_id), spec.trials_per_iter)
    tasks = [by_id[tid] for tid in plan.task_ids]
    (Path(work_dir) / "jobs" / job_id).mkdir(parents=True, exist_ok=True)
    mods = {t.task_id: load_ir(store.workload(redis, t.wkey).mod) for t in tasks}
    return ShardJob(job_id, shard, spec, target, tasks, mods, first_round)


def search_parts(send, redis, job: ShardJob, settings: TunerSettings, runner, stash, split, population: int):
    """What the shard's loop drives (rounds.SearchParts): each task's TuneContext, the deferred builder and the
    lanes' runner, TVM's database seeded from the store, the central cost model, the store's records, the tasks'
    default timings and (with warm seeds) nearby workloads' best records."""
    from services.tuner.metaschedule.context import tune_context
    from services.tuner.metaschedule.cost_model import SnapshotCostModel
    from services.tuner.metaschedule.defaults import FLOOR_WKEY, launch_floor, measure_defaults
    from services.tuner.metaschedule.lane_runner import DeferredBuilder
    from services.tuner.metaschedule.records import ShardTasks, StoreRecords, seed_database
    from services.tuner.metaschedule.rounds import SearchParts
    from services.tuner.metaschedule.seeds import SeedSource, workload_shape

    spec, target, tasks, mods = job.spec, job.target, job.tasks, job.mods
    wkeys = {t.name: t.wkey for t in tasks}
    database, _ = seed_database(redis, [t.wkey for t in tasks])

    def make_context(task, cold: bool):
        return tune_context(mods[task.task_id], target, task.name, cold, population,
                            rand_state=(spec.seed + job.shard) if spec.seed is not None else -1,
                            num_threads=settings.search_threads, valid_sampling=settings.valid_sampling,
                            first_round_pool=settings.first_round_pool, ranking_model=cost_model,
                            pad_awkward=settings.pad_awkward, column_reductions=settings.column_reductions,
                            evolution_screen=settings.evolution_screen,
                            verify_in_build=settings.verify_in_build, split_k=settings.split_k)

    family = _target_family(target, spec.share)
    if spec.isolated:  # a central model of its own, trained on this job's rows only
        family += f"-{job.job_id}"
    if spec.cost_model == "per_client":
        family += f"-{job.job_id}-s{job.shard}"
    cost_model = SnapshotCostModel(send, redis, family, wkeys, spec.seed)
    shapes = {t.name: workload_shape(mods[t.task_id], t.wkey, t.name, str(target), spec.share) for t in tasks}
    shard_tasks = ShardTasks(wkeys, {t.name: t.task_id for t in tasks},
                             {n: (job.kind, sh) for n, sh in shapes.items() if sh is not None})
    records = StoreRecords(redis, job.job_id, spec.share, shard_tasks, runner, database, job.shard)
    within = {t.wkey for t in store.job_tasks(redis, job.job_id)} if spec.isolated else None
    seeds = (SeedSource(redis, job.kind, str(target), spec.share, shapes={t.task_id: shapes[t.name] for t in tasks},
                        within=within, late=settings.late_seeds) if settings.warm_seeds else None)
    return SearchParts(make_context, DeferredBuilder(stash, split), runner, database, cost_model, records,
                       defaults=lambda ts: measure_defaults(redis, runner, ts, mods, target, floor=settings.latency_floor),
                       seeds=seeds,
                       floor=(lambda: launch_floor(redis, runner, target)) if settings.latency_floor else None,
                       first_round_floor=FLOOR_WKEY + str(target)
                       if settings.latency_floor and settings.floor_first_rounds else None)


def lane_runner(send, redis, spec: JobSpec, target, settings: TunerSettings, stash=None, split=None):
    """The job's runner on the lanes of its kind and share, timing as its target kind and the tuner's floor say."""
    from services.tuner.metaschedule.lane_runner import BatchRules, CandidateStash, JobLanes, LaneRunner, TimeSplit

    runner = LaneRunner(send, redis, JobLanes(spec.job_id, lane_kind(spec.target), spec.share, str(target)),
                        stash or CandidateStash(), split or TimeSplit(),
                        BatchRules(timing_for(target_kind(spec.target), settings.timing_floor_ms,
                                              settings.timing_settle_ms, settings.timing_settle_above_best),
                                   settings.batch_grace_s, settings.live_lane_policy()))
    runner.check_outputs = settings.check_outputs
    return runner


def shard_times(split, run, tune_s: float, population: int, seeds, ranked_rounds: int = 0,
                first_round: int | None = None) -> dict:
    """Where the shard's time went (the lanes' split, the search, its phases, the waits) and what its loop did
    (`ranked_rounds`: cold rounds the central model chose from a larger pool, sampling.ValidReplay;
    `first_round`: the size its first rounds had before light tasks', first_round_of)."""
    times = split.as_dict()
    times["search"] = round(max(0.0, tune_s - split.wait - split.serialize - run.waited_s), 3)
    times["steer_wait"] = round(run.waited_s, 3)
    times.update({k: round(v, 3) for k, v in run.phase_s.items()})
    times["tune_total"] = round(tune_s, 3)
    times.update(rounds=run.rounds, ahead_rounds=run.ahead_rounds, trials=run.trials, reused=run.reused,
                 warm_switches=run.warm_switches,
                 population=population, seeds_measured=run.seeds, seeds_late=run.late_seeds,
                 seeds_applied=seeds.applied if seeds else 0,
                 seeds_skipped=seeds.skipped if seeds else 0, seeds_padded=seeds.padded if seeds else 0,
                 ranked_rounds=ranked_rounds, first_round=first_round, launch_floor_s=run.floor_s,
                 round_log=run.round_log)
    return times


def finish_job(send, redis, job_id: str, settings: TunerSettings) -> JobResult:
    """Once every shard is done (or the job was cancelled and its clients stopped): re-time each task's
    top k (lanes idle now; not for a cancelled job), compile the tuned and the untuned model, and store
    the result. Idempotent: a finish that died is simply run again. A cancelled job stays cancelled
    (set_state never overwrites it)."""
    from services.tuner.metaschedule.ir_codec import target_from_json

    spec = store.job_spec(redis, job_id)
    state = store.job_hash(redis, job_id)
    target = target_from_json(state.target_json)
    tasks = store.job_tasks(redis, job_id)
    job_dir = Path(settings.work_dir) / "jobs" / job_id
    job_dir.mkdir(parents=True, exist_ok=True)
    retime = {}
    if state.state != JobState.CANCELLED:  # finished on what was measured; lanes answer its batches unrun
        retime = retime_bests(lane_runner(send, redis, spec, target, settings), redis, job_id, spec, tasks)
    store.set_state(redis, job_id, JobState.COMPILING)
    t_compile = time.time()
    compiled = compile_job(redis, job_id, spec, target, tasks, job_dir)
    compile_s = time.time() - t_compile
    bests = task_bests(redis, tasks, store.job_progress(redis, job_id))
    accounting = store.trial_accounting(redis, job_id)
    timings, spread = timing_counts(redis, job_id, tasks)
    result = JobResult(
        job_id=job_id,
        tasks=bests,
        trials=sum(b.trials for b in bests),
        tuned_module_path=os.path.abspath(compiled.tuned),
        untuned_module_path=os.path.abspath(compiled.untuned) if compiled.untuned else None,
        database_dir=os.path.abspath(compiled.database_dir),
        target=str(target),
        wall_s=round(time.time() - spec.submitted_at, 3),
        time_split_s=job_times(redis, job_id, t_compile, compile_s),
        retime=retime,
        lanes=lane_utilisation(store.lane_batches(redis, job_id)),
        timings=timings,
        timing_spread=spread,
        accounting=TrialAccounting(**accounting) if accounting else None,
        stopped=store.job_hash(redis, job_id).stopped,
    )
    store.set_result(redis, result)
    store.set_state(redis, job_id, JobState.DONE)
    store.deactivate_job(redis, job_id)
    return result


def retime_bests(runner, redis, job_id: str, spec: JobSpec, tasks: list[JobTask]) -> dict:
    """No task's best is a screening figure: a brief best gets the full timing before anything exports it;
    then each task's top k is timed again when the job asks (retime_top_k). What was timed, and how long."""
    from services.tuner.metaschedule.records import full_timing_of_bests, retime_top_k

    wkeys = [t.wkey for t in tasks]
    retime = {"full_timing_of_bests": full_timing_of_bests(redis, runner, wkeys)}
    if spec.retime_top_k:
        store.set_state(redis, job_id, JobState.RETIMING)
        t_retime = time.time()
        retime.update(retime_top_k(redis, runner, job_id, wkeys, spec.retime_top_k))
        retime["seconds"] = round(time.time() - t_retime, 3)
    return retime


class CompiledJob(NamedTuple):
    tuned: str
    untuned: str | None
    database_dir: str


def compile_job(redis, job_id: str, spec: JobSpec, target, tasks: list[JobTask], job_dir: Path) -> CompiledJob:
    """The job's records exported as TVM's database, the model compiled with it (and without, when the job
    asks for its untuned baseline)."""
    from services.tuner.metaschedule.ir_codec import load_ir
    from services.tuner.metaschedule.compile import compile_tuned, compile_untuned
    from services.tuner.metaschedule.records import export_json_database

    db_dir = export_json_database(redis, [t.wkey for t in tasks], str(job_dir / "database")).dir
    model = load_ir(store.job_model(redis, job_id).decode())
    tuned = compile_tuned(model, target, db_dir, str(job_dir / "tuned.so"))
    untuned = compile_untuned(model, target, str(job_dir / "untuned.so")) if spec.untuned_baseline else None
    return CompiledJob(tuned, untuned, db_dir)


def timing_counts(redis, job_id: str, tasks: list[JobTask]) -> tuple[dict[str, int], dict[str, float]]:
    """The job's valid records by the timing they got (full, brief), and the spread of the full timings'
    repeats as the search measured them (a record re-timed later keeps those in shared_run_secs)."""
    from shared.ranking import SHORT_KERNEL_S, rank_secs, repeat_spread, spread_summary

    timings = {"full": 0, "brief": 0}
    spreads, short = [], []
    for t in tasks:
        for rec in store.records(redis, t.wkey):
            if rec.job_id == job_id and store.valid_record(rec):
                timings[rec.timing] += 1
                measured = rec.shared_run_secs or rec.run_secs
                spread = repeat_spread(measured) if rec.timing == "full" else None
                if spread is not None:
                    spreads.append(spread)
                    if rank_secs(measured) < SHORT_KERNEL_S:
                        short.append(spread)
    return timings, {**spread_summary(spreads), **{f"short_{k}": v for k, v in spread_summary(short).items()}}


def task_bests(redis, tasks: list[JobTask], progress: dict) -> list[TaskBest]:
    """Each task's best record in the store (fully timed), its default schedule's time, and whether the tuned
    model keeps its records."""
    from services.tuner.metaschedule.defaults import keeps_records

    bests = []
    for t in tasks:
        best = _best_record(redis, t.wkey)
        best_s = rank_secs(best.run_secs) if best else None
        default_s = default_secs(store.default_timing(redis, t.wkey))
        bests.append(TaskBest(
            task_id=t.task_id, name=t.name, weight=t.weight,
            trials=progress[t.task_id].trials if t.task_id in progress else 0,
            best_us=1e6 * best_s if best else None,
            best_candidate=best.candidate_key if best else None, best_lane=best.lane if best else None,
            default_us=1e6 * default_s if default_s else None, applied=keeps_records(best_s, default_s),
        ))
    return bests


def job_times(redis, job_id: str, t_compile: float, compile_s: float) -> dict:
    """Where the job's time went: its shards' splits summed, first shard's start to last shard's end, the
    compile, and what its clients did."""
    from services.tuner.metaschedule.rounds import PHASES

    shards = store.shards(redis, job_id)
    splits = store.splits(redis, job_id)
    times = {k: round(sum(sp.get(k, 0.0) for sp in splits), 3)
             for k in ("serialize", "wait", "queue", "build", "run", "search", "steer_wait", *PHASES)}
    started = min((sh.started_at for sh in shards.values() if sh.started_at), default=t_compile)
    ended = max((sh.finished_at for sh in shards.values() if sh.finished_at), default=t_compile)
    times["tune_total"] = round(ended - started, 3)
    times["compile"] = round(compile_s, 3)
    for k in ("rounds", "ahead_rounds", "reused", "warm_switches", "ranked_rounds"):
        times[k] = sum(sp.get(k, 0) for sp in splits)
    times["clients"] = len(shards)
    times["population"] = max((sp.get("population", 0) for sp in splits), default=0)
    first_round = max((sp.get("first_round") or 0 for sp in splits), default=0)
    if first_round:  # a split of a shard that never searched has none
        times["first_round"] = first_round
    times["resumed_shards"] = sum(1 for sh in shards.values() if sh.attempts > 1)
    return times


def timing_for(kind: str, floor_ms: int | None = None, settle_ms: int | None = None,
               settle_above_best: bool = True) -> TimingConfig:
    """The timing of a target kind's candidates: the defaults (MetaSchedule's LocalRunner: 3 runs, 100 ms
    floor) with what its lane kind changes (a shared GPU: 3 repeats, settled at 10 ms where they agree or
    cannot beat the task's best, shared.lanes.gpu), and the tuner's floor and settling where it sets them
    (TunerSettings.timing_floor_ms, timing_settle_ms, timing_settle_above_best)."""
    fields = lanes.for_target(kind).timing()
    if floor_ms is not None:
        fields["min_repeat_ms"] = floor_ms
    if settle_ms is not None:
        fields["settle_ms"] = settle_ms
    return TimingConfig(**fields, settle_above_best=settle_above_best)


def _best_record(redis, wkey: str):
    """The workload's fastest valid record with the full timing in the store (from this job or an earlier one)."""
    from services.tuner.metaschedule.records import ranked

    return next(iter(ranked(store.records(redis, wkey), full_only=True)), None)


def _target_family(target, share: int) -> str:
    """Cost-model rows are shared by every job on the same kind of hardware at the same share."""
    attrs = json.loads(str(target))
    return f"{attrs.get('kind')}-{attrs.get('mcpu') or attrs.get('arch') or 'generic'}-p{share}"

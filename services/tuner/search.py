"""The tuner client's core: run MetaSchedule's own search (evolutionary strategy, gradient task
scheduler) over one shard of a job's tasks, with the lanes as builder/runner, the store as database, and the
central updater's snapshots as cost model; then compile the tuned and untuned model."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

from shared import lanes, store, timeouts
from shared.messages import (JobResult, JobState, TaskBest, TimingConfig, TrialAccounting, lane_kind, lane_utilisation,
                             target_kind)
from shared.ranking import default_secs, rank_secs


def tune_shard(send, redis, job_id: str, shard: int, work_dir: Path, grace_s: float = timeouts.BATCH_GRACE_S,
               check=None, search_threads: int = 0, cold_start: bool = True, population=None,
               timing_floor_ms: int | None = None, valid_sampling: bool = True, warm_seeds: bool = True):
    """Search one shard's tasks until the job's budget is spent or its tasks are done. `check` raises
    rounds.Stopped when the client must hand the shard back (shutdown, lost lease). `send(task, payload,
    queue)` publishes a message (services.tuner.tasks, the Celery boundary, gives it). `population(trials_per_iter)`
    gives the evolutionary search's population (TunerSettings.population; default: MetaSchedule's 512)."""
    from services.tuner.metaschedule.codec import load_ir, target_from_json
    from services.tuner.metaschedule.intrinsics import load_tensor_intrinsics

    spec = store.job_spec(redis, job_id)
    target = target_from_json(store.job_hash(redis, job_id).target_json)
    kind = target_kind(spec.target)
    load_tensor_intrinsics(kind)
    pop = population(spec.trials_per_iter) if population else 512
    from services.tuner.metaschedule.context import tune_context
    from services.tuner.metaschedule.cost_model import SnapshotCostModel
    from services.tuner.metaschedule.lanes import CandidateStash, DeferredBuilder, LaneRunner, TimeSplit
    from services.tuner.metaschedule.records import StoreRecords, seed_database
    from services.tuner.metaschedule.rounds import SearchParts, Shard, ShardLoop
    from services.tuner.sharding import first_round_size

    plan = store.shards(redis, job_id)[shard]
    by_id = {t.task_id: t for t in store.job_tasks(redis, job_id)}
    first_round = first_round_size(spec.trials, len(by_id), spec.trials_per_iter)
    tasks = [by_id[tid] for tid in plan.task_ids]
    job_dir = Path(work_dir) / "jobs" / job_id
    job_dir.mkdir(parents=True, exist_ok=True)
    wkeys = {t.name: t.wkey for t in tasks}
    database, _ = seed_database(redis, [t.wkey for t in tasks])
    mods = {t.task_id: load_ir(store.workload(redis, t.wkey).mod) for t in tasks}

    def make_context(task, cold: bool):
        return tune_context(mods[task.task_id], target, task.name, cold, pop,
                            rand_state=(spec.seed + shard) if spec.seed is not None else -1,
                            num_threads=search_threads, valid_sampling=valid_sampling)

    split = TimeSplit()
    stash = CandidateStash()
    runner = LaneRunner(send, redis, job_id, lane_kind(spec.target), spec.share, str(target), stash, split,
                        timing_for(kind, timing_floor_ms), grace_s)
    family = _target_family(target, spec.share)
    if spec.cost_model == "per_client":
        family += f"-{job_id}-s{shard}"
    cost_model = SnapshotCostModel(send, redis, family, wkeys, spec.seed)
    from services.tuner.metaschedule.seeds import SeedSource, workload_shape

    shapes = {t.name: workload_shape(mods[t.task_id], t.wkey, t.name, str(target), spec.share) for t in tasks}
    records = StoreRecords(redis, job_id, spec.share, wkeys, {t.name: t.task_id for t in tasks}, runner,
                           database, shard, shapes={n: (kind, sh) for n, sh in shapes.items() if sh is not None})
    seeds = (SeedSource(redis, kind, str(target), spec.share, shapes={t.task_id: shapes[t.name] for t in tasks})
             if warm_seeds else None)
    t0 = time.time()
    from services.tuner.metaschedule.defaults import measure_defaults

    loop = ShardLoop(Shard(redis, job_id, shard, tasks, spec.trials_per_iter, spec.max_trials_per_task or spec.trials,
                           first_round),
                     SearchParts(make_context, DeferredBuilder(stash, split), runner, database, cost_model, records,
                                 defaults=lambda ts: measure_defaults(redis, runner, ts, mods, target), seeds=seeds),
                     check=check, cold_start=cold_start, screen=spec.timing == "screen")
    run = loop.run()
    tune_s = time.time() - t0
    times = split.as_dict()
    times["search"] = round(max(0.0, tune_s - split.wait - split.serialize - run.waited_s), 3)
    times["steer_wait"] = round(run.waited_s, 3)
    times.update({k: round(v, 3) for k, v in run.phase_s.items()})
    times["tune_total"] = round(tune_s, 3)
    times.update(rounds=run.rounds, trials=run.trials, reused=run.reused, warm_switches=run.warm_switches,
                 population=pop, seeds_measured=run.seeds, seeds_applied=seeds.applied if seeds else 0,
                 seeds_skipped=seeds.skipped if seeds else 0)
    store.put_split(redis, job_id, shard, times)
    return run


def finish_job(send, redis, job_id: str, work_dir: Path, grace_s: float = timeouts.BATCH_GRACE_S,
               timing_floor_ms: int | None = None) -> JobResult:
    """Once every shard is done (or the job was cancelled and its clients stopped): re-time each task's
    top k (lanes idle now; not for a cancelled job), compile the tuned and the untuned model, and store
    the result. Idempotent: a finish that died is simply run again. A cancelled job stays cancelled
    (set_state never overwrites it)."""
    from services.tuner.metaschedule.codec import load_ir, target_from_json

    spec = store.job_spec(redis, job_id)
    state = store.job_hash(redis, job_id)
    target = target_from_json(state.target_json)
    kind = target_kind(spec.target)
    tasks = store.job_tasks(redis, job_id)
    job_dir = Path(work_dir) / "jobs" / job_id
    job_dir.mkdir(parents=True, exist_ok=True)
    from services.tuner.metaschedule.lanes import CandidateStash, LaneRunner, TimeSplit
    from services.tuner.metaschedule.records import export_json_database, full_timing_of_bests, retime_top_k
    from services.tuner.metaschedule.rounds import PHASES

    retime = {}
    cancelled = state.state == JobState.CANCELLED  # finished on what was measured; it stays cancelled
    wkeys = [t.wkey for t in tasks]
    if not cancelled:  # lanes answer a cancelled job's batches without running them
        runner = LaneRunner(send, redis, job_id, lane_kind(spec.target), spec.share, str(target), CandidateStash(),
                            TimeSplit(), timing_for(kind, timing_floor_ms), grace_s)
        # no task's best is a screening figure: a brief best gets the full timing before anything exports it
        retime["full_timing_of_bests"] = full_timing_of_bests(redis, runner, wkeys)
        if spec.retime_top_k:
            store.set_state(redis, job_id, JobState.RETIMING)
            t_retime = time.time()
            retime.update(retime_top_k(redis, runner, job_id, wkeys, spec.retime_top_k))
            retime["seconds"] = round(time.time() - t_retime, 3)
    store.set_state(redis, job_id, JobState.COMPILING)
    t_compile = time.time()
    from services.tuner.metaschedule.compile import compile_tuned, compile_untuned

    db_dir = export_json_database(redis, [t.wkey for t in tasks], str(job_dir / "database")).dir
    model = load_ir(store.job_model(redis, job_id).decode())
    tuned = compile_tuned(model, target, db_dir, str(job_dir / "tuned.so"))
    untuned = compile_untuned(model, target, str(job_dir / "untuned.so")) if spec.untuned_baseline else None
    compile_s = time.time() - t_compile
    progress = store.job_progress(redis, job_id)
    from services.tuner.metaschedule.defaults import keeps_records

    timings = {"full": 0, "brief": 0}
    for t in tasks:
        for rec in store.records(redis, t.wkey):
            if rec.job_id == job_id and store.valid_record(rec):
                timings[rec.timing] += 1

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
    shards = store.shards(redis, job_id)
    splits = store.splits(redis, job_id)
    times = {k: round(sum(sp.get(k, 0.0) for sp in splits), 3)
             for k in ("serialize", "wait", "queue", "build", "run", "search", "steer_wait", *PHASES)}
    started = min((sh.started_at for sh in shards.values() if sh.started_at), default=t_compile)
    ended = max((sh.finished_at for sh in shards.values() if sh.finished_at), default=t_compile)
    times["tune_total"] = round(ended - started, 3)  # first shard's start to last shard's end
    times["compile"] = round(compile_s, 3)
    for k in ("rounds", "reused", "warm_switches"):
        times[k] = sum(sp.get(k, 0) for sp in splits)
    times["clients"] = len(shards)
    times["population"] = max((sp.get("population", 0) for sp in splits), default=0)
    times["resumed_shards"] = sum(1 for sh in shards.values() if sh.attempts > 1)
    accounting = store.trial_accounting(redis, job_id)
    result = JobResult(
        job_id=job_id,
        tasks=bests,
        trials=sum(b.trials for b in bests),
        tuned_module_path=os.path.abspath(tuned),
        untuned_module_path=os.path.abspath(untuned) if untuned else None,
        database_dir=os.path.abspath(db_dir),
        target=str(target),
        wall_s=round(time.time() - spec.submitted_at, 3),
        time_split_s=times,
        retime=retime,
        lanes=lane_utilisation(store.lane_batches(redis, job_id)),
        timings=timings,
        accounting=TrialAccounting(**accounting) if accounting else None,
    )
    store.set_result(redis, result)
    store.set_state(redis, job_id, JobState.DONE)
    store.deactivate_job(redis, job_id)
    return result


def timing_for(kind: str, floor_ms: int | None = None) -> TimingConfig:
    """The timing of a target kind's candidates: the defaults (MetaSchedule's LocalRunner: 3 runs, 100 ms
    floor) with what its lane kind changes (a shared GPU: 3 repeats, shared.lanes.gpu), and the tuner's
    floor where it sets one (TunerSettings.timing_floor_ms)."""
    fields = lanes.for_target(kind).timing()
    if floor_ms is not None:
        fields["min_repeat_ms"] = floor_ms
    return TimingConfig(**fields)


def _best_record(redis, wkey: str):
    """The workload's fastest valid record with the full timing in the store (from this job or an earlier one)."""
    from services.tuner.metaschedule.records import ranked

    return next(iter(ranked(store.records(redis, wkey), full_only=True)), None)


def _target_family(target, share: int) -> str:
    """Cost-model rows are shared by every job on the same kind of hardware at the same share."""
    attrs = json.loads(str(target))
    return f"{attrs.get('kind')}-{attrs.get('mcpu') or attrs.get('arch') or 'generic'}-p{share}"

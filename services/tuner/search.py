"""The tuner client's core: run MetaSchedule's own search (evolutionary strategy, gradient task
scheduler) over a job's tasks, with the lanes as builder/runner, the store as database, and the
central updater's snapshots as cost model; then compile the tuned and untuned model."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

from shared import store
from shared.codec import load_ir
from shared.messages import JobResult, TaskBest, TimingConfig, lane_kind, target_kind


def tune(app, redis, job_id: str, work_dir: Path, grace_s: float = 120.0) -> JobResult:
    import tvm

    from services.tuner.metaschedule.intrinsics import load_tensor_intrinsics

    t_start = time.time()
    spec = store.job_spec(redis, job_id)
    state = store.job_state(redis, job_id)
    target = tvm.target.Target(json.loads(state["target_json"]))
    kind = target_kind(spec.target)
    load_tensor_intrinsics(kind)
    from tvm.s_tir import meta_schedule as ms

    from services.tuner.metaschedule.cost_model import SnapshotCostModel
    from services.tuner.metaschedule.lanes import CandidateStash, DeferredBuilder, LaneRunner, TimeSplit
    from services.tuner.metaschedule.records import StoreRecords, export_json_database, retime_top_k, seed_database

    store.set_state(redis, job_id, "tuning")
    tasks = store.job_tasks(redis, job_id)
    job_dir = Path(work_dir) / "jobs" / job_id
    job_dir.mkdir(parents=True, exist_ok=True)
    wkeys = {t.name: t.wkey for t in tasks}
    database, _ = seed_database(redis, [t.wkey for t in tasks])
    contexts = [
        ms.TuneContext(
            mod=load_ir(store.workload(redis, t.wkey).mod),
            target=target,
            space_generator="post-order-apply",
            search_strategy="evolutionary",
            task_name=t.name,
            rand_state=spec.seed if spec.seed is not None else -1,
            num_threads="physical",  # the search runs on the tuner's host cores, as in stock tune_relax
        ).clone()
        for t in tasks
    ]
    split = TimeSplit()
    stash = CandidateStash()
    runner = LaneRunner(app, redis, job_id, lane_kind(spec.target), spec.share, str(target), stash, split,
                        timing_for(kind), grace_s)
    cost_model = SnapshotCostModel(app, redis, _target_family(target, spec.share), wkeys, spec.seed)
    callbacks = [
        StoreRecords(redis, job_id, spec.share, wkeys, {t.name: t.task_id for t in tasks}, runner, database),
        ms.measure_callback.UpdateCostModel(),
    ]
    t_tune = time.time()
    ms.tune_tasks(
        tasks=contexts,
        task_weights=[float(t.weight) for t in tasks],
        work_dir=str(job_dir / "ms"),
        max_trials_global=spec.trials,
        max_trials_per_task=spec.max_trials_per_task,
        num_trials_per_iter=spec.trials_per_iter,
        builder=DeferredBuilder(stash, split),
        runner=runner,
        database=database,
        cost_model=cost_model,
        measure_callbacks=callbacks,
        task_scheduler="gradient",
    )
    tune_s = time.time() - t_tune
    retime = {}
    if spec.retime_top_k:
        store.set_state(redis, job_id, "retiming")
        t_retime = time.time()
        retime = retime_top_k(redis, runner, job_id, [t.wkey for t in tasks], spec.retime_top_k)
        retime["seconds"] = round(time.time() - t_retime, 3)
    store.set_state(redis, job_id, "compiling")
    t_compile = time.time()
    from services.tuner.metaschedule.compile import compile_tuned, compile_untuned

    db_dir, _ = export_json_database(redis, [t.wkey for t in tasks], str(job_dir / "database"))
    model = load_ir(store.job_model(redis, job_id).decode())
    tuned = compile_tuned(model, target, db_dir, str(job_dir / "tuned.so"))
    untuned = compile_untuned(model, target, str(job_dir / "untuned.so"))
    compile_s = time.time() - t_compile
    progress = store.job_progress(redis, job_id)
    bests = []
    for t in tasks:
        best = _best_record(redis, t.wkey)
        bests.append(TaskBest(
            task_id=t.task_id, name=t.name, weight=t.weight,
            trials=progress[t.task_id].trials if t.task_id in progress else 0,
            best_us=1e6 * sum(best.run_secs) / len(best.run_secs) if best else None,
            best_candidate=best.candidate_key if best else None, best_lane=best.lane if best else None,
        ))
    times = split.as_dict()
    times["search"] = round(max(0.0, tune_s - split.wait - split.serialize), 3)
    times["tune_total"] = round(tune_s, 3)
    times["compile"] = round(compile_s, 3)
    result = JobResult(
        job_id=job_id,
        tasks=bests,
        trials=sum(b.trials for b in bests),
        tuned_module_path=os.path.abspath(tuned),
        untuned_module_path=os.path.abspath(untuned),
        database_dir=os.path.abspath(db_dir),
        target=str(target),
        wall_s=round(time.time() - t_start, 3),
        time_split_s=times,
        retime=retime,
    )
    store.set_result(redis, result)
    store.set_state(redis, job_id, "done")
    return result


def timing_for(kind: str) -> TimingConfig:
    """CPU: MetaSchedule's LocalRunner defaults (3 runs, 100 ms floor). GPU: 3 repeats of 3 runs with a
    50 ms floor each, ranked by their median: a shared GPU's timings need the repeats."""
    return TimingConfig(number=3, repeat=3, min_repeat_ms=50) if kind == "cuda" else TimingConfig()


def _best_record(redis, wkey: str):
    """The workload's fastest valid record in the store (from this job or an earlier one)."""
    good = [r for r in store.records(redis, wkey) if r.error is None and r.run_secs]
    return min(good, key=lambda r: sum(r.run_secs) / len(r.run_secs), default=None)


def _target_family(target, share: int) -> str:
    """Cost-model rows are shared by every job on the same kind of hardware at the same share."""
    attrs = json.loads(str(target))
    return f"{attrs.get('kind')}-{attrs.get('mcpu') or attrs.get('arch') or 'generic'}-p{share}"

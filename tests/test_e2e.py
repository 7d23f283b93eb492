"""End to end on the CPU with real parts: Redis, Celery workers in separate processes, TVM builds."""
import json
import os

import numpy as np
import pytest

from shared import store

pytestmark = pytest.mark.e2e


def test_every_task_has_records_and_counts_match(tuned_tiny, redis_conn, lane_share):
    res = tuned_tiny.result()
    tasks = store.job_tasks(redis_conn, tuned_tiny.job_id)
    assert len(tasks) >= 2
    names = {t.name for t in tasks}
    assert any("conv2d" in n for n in names) and any("matmul" in n for n in names)
    total = 0
    progress = store.job_progress(redis_conn, tuned_tiny.job_id)
    for t in tasks:
        recs = [r for r in store.records(redis_conn, t.wkey) if r.job_id == tuned_tiny.job_id]
        # a task whose every schedule an earlier job of the session measured (reshape: one) reuses them
        assert recs or progress[t.task_id].reused_trials, f"no records for task {t.name}"
        assert all(r.share == lane_share for r in recs)
        assert all(r.lane.startswith("measure.cpu.") for r in recs)
        total += len(recs)
    # records equal in count the trials spent, and the job-wide budget is exact
    assert total == res.trials == 24
    assert any(t.best_us for t in res.tasks)
    for best in res.tasks:  # job.result() names each task's best record, which the store holds
        if best.best_candidate:
            wkey = next(t.wkey for t in tasks if t.task_id == best.task_id)
            rec = next(r for r in store.records(redis_conn, wkey) if r.candidate_key == best.best_candidate)
            assert abs(1e6 * sum(rec.run_secs) / len(rec.run_secs) - best.best_us) < 1e-6


def test_status_reports_trials_and_best_latency(tuned_tiny):
    st = tuned_tiny.status()
    assert st["state"] == "done"
    assert sum(t["trials"] for t in st["tasks"]) == tuned_tiny.result().trials
    assert all(t["best_us"] is None or t["best_us"] > 0 for t in st["tasks"])
    # one best: what status says of a finished job is what its result says
    assert {t["task"]: t["best_us"] for t in st["tasks"]} == {b.name: b.best_us for b in tuned_tiny.result().tasks}
    assert all(t["default_us"] and t["default_us"] > 0 for t in st["tasks"])  # each default schedule was timed
    split = tuned_tiny.result().time_split_s  # the search's sampling, in wall time and in CPU
    assert split["sample"] > 0 and split["sample_cpu"] > 0
    # the candidates the search proposed, as evolved or as drawn from the space; evolution's CPU within the search's
    assert split["drawn"] + split["evolved"] > 0 and split["evolve_cpu"] <= split["sample_cpu"]


def test_tuned_module_matches_pytorch(tuned_tiny):
    from sharetune.experiments import model_timing
    from sharetune.zoo import get

    model, example = get("tiny").build()
    cmp = model_timing.compare(tuned_tiny.result().tuned_module_path, model, example)
    assert cmp["max_abs_err"] < 1e-4


def test_exported_database_compiles_with_stock_tvm(tuned_tiny, tmp_path):
    """Stock TVM (JSONDatabase + compile_relax, i.e. MetaScheduleApplyDatabase) builds the model from
    the exported files alone, and the result matches PyTorch."""
    import os

    import tvm
    from tvm import relax
    from tvm.s_tir import meta_schedule as ms

    from sharetune.intake import reference_output, to_relax
    from sharetune.zoo import get

    res = tuned_tiny.result()
    files = sorted(os.listdir(res.database_dir))
    assert files == ["database_repeats.json", "database_tuning_record.json", "database_workload.json"]
    from shared import store

    # every valid record with the full timing the store held for the job's workloads when it exported (this
    # job's, and an earlier job's of the same workload: identical workloads share their records), of the tasks
    # whose best beats their default; screened-out candidates' brief figures stay in the store only
    path = os.path.join(res.database_dir, "database_tuning_record.json")
    applied = {b.task_id for b in res.tasks if b.applied}
    exported = _exported_keys(res.database_dir)
    tasks = store.job_tasks(tuned_tiny.client.redis, tuned_tiny.job_id)
    for t in tasks:
        surely, maybe = _full_at_export(tuned_tiny.client.redis, t.wkey, os.path.getmtime(path))
        assert surely <= exported.get(t.wkey, set()) <= maybe, t.name
    with open(path) as f:
        assert len(f.readlines()) == sum(len(exported.get(t.wkey, ())) for t in tasks if t.task_id in applied) > 0
    db = ms.database.JSONDatabase(work_dir=res.database_dir)
    target = tvm.target.Target(json.loads(res.target))
    model, example = get("tiny").build()
    ex = ms.relax_integration.compile_relax(db, to_relax(model, example).mod, target, params=None)
    vm = relax.VirtualMachine(ex, tvm.cpu())
    out = vm["main"](tvm.runtime.tensor(example[0].numpy()))
    while not hasattr(out, "numpy"):
        out = out[0]
    assert np.max(np.abs(out.numpy() - reference_output(model, example))) < 1e-4


def _errors(job) -> int:
    return sum(t["errors"] for t in job.status()["tasks"])


def test_identical_workloads_are_recognised_across_jobs(tuned_tiny, client, lane_share, redis_conn):
    first = {t.name: t.wkey for t in store.job_tasks(redis_conn, tuned_tiny.job_id)}
    job = client.submit("tiny", target="llvm", share=lane_share, trials=4, trials_per_iter=4, seed=1)
    assert job.wait(timeout_s=600)["state"] == "done"
    second = {t.name: t.wkey for t in store.job_tasks(redis_conn, job.job_id)}
    assert second == first  # same workloads, same keys
    reused = {t["task"]: t["reused_trials"] for t in job.status()["tasks"]}
    assert sum(reused.values()) >= tuned_tiny.result().trials - _errors(tuned_tiny)


def test_top_candidates_are_retimed_and_both_figures_kept(tuned_tiny, redis_conn):
    res = tuned_tiny.result()
    assert res.retime["retimed"] >= 2
    retimed = [r for t in store.job_tasks(redis_conn, tuned_tiny.job_id) for r in store.records(redis_conn, t.wkey)
               if r.retimed_at is not None]
    assert len(retimed) == res.retime["retimed"]
    for r in retimed:
        assert r.shared_run_secs and r.run_secs and r.error is None
    # the task's reported best is one of the re-timed (isolated) figures or better than all of them
    by_task = {t.task_id: t for t in res.tasks}
    for t in store.job_tasks(redis_conn, tuned_tiny.job_id):
        mine = [r for r in retimed if r.wkey == t.wkey]
        if mine:
            best_iso = min(1e6 * sum(r.run_secs) / len(r.run_secs) for r in mine)
            assert by_task[t.task_id].best_us <= best_iso + 1e-9


def test_each_tasks_default_schedule_is_timed_and_guards_the_tuned_model(tuned_tiny, redis_conn):
    """Every task's default schedule is timed once on a lane; the exported database (what the tuned model
    is compiled from) holds a task's records only when their best beats that default."""
    from shared.ranking import rank_secs

    res = tuned_tiny.result()
    wkeys = {t.task_id: t.wkey for t in store.job_tasks(redis_conn, tuned_tiny.job_id)}
    for best in res.tasks:
        timing = store.default_timing(redis_conn, wkeys[best.task_id])
        assert timing is not None and timing.error is None and timing.run_secs, best.name
        assert timing.lane.startswith("measure.cpu.")
        assert best.default_us == pytest.approx(1e6 * rank_secs(timing.run_secs))
        assert best.applied == (best.best_us is not None and best.best_us < best.default_us)
    db = res.database_dir
    with open(f"{db}/database_workload.json") as f:
        n_workloads = sum(1 for line in f if line.strip())
    with open(f"{db}/database_tuning_record.json") as f:
        with_records = {json.loads(line)[0] for line in f if line.strip()}
    assert n_workloads == len(res.tasks)
    assert len(with_records) == sum(1 for b in res.tasks if b.applied)


def test_every_tasks_default_schedule_is_the_reference_its_candidates_outputs_are_checked_against(tuned_tiny,
                                                                                                   redis_conn):
    """The lanes check each fully timed candidate against its task's default-scheduled module on the same inputs:
    every task's reference is stored, and on real CPU lanes no candidate of the tiny model was a wrong result
    (those the check may skip: a layout rewrite makes a weight's layout the candidate's own)."""
    wkeys = [t.wkey for t in store.job_tasks(redis_conn, tuned_tiny.job_id)]
    assert all(store.references(redis_conn, wkeys).values())
    recs = [r for w in wkeys for r in store.records(redis_conn, w)]
    errors = [r.error for r in recs if r.error]
    assert not [e for e in errors if e.startswith("wrong result")], errors
    assert any(r.output_checked for r in recs)  # the check ran, on every fully timed one it could
    assert not [r for r in recs if r.output_checked and (r.error or r.timing != "full")]


def test_a_record_applies_only_when_it_beats_the_default():
    from services.tuner.metaschedule.defaults import keeps_records

    assert keeps_records(1e-4, 2e-4)
    assert not keeps_records(2e-4, 2e-4) and not keeps_records(3e-4, 2e-4)
    assert keeps_records(3e-4, None)  # no default timed: the records apply as MetaSchedule would
    assert not keeps_records(None, 2e-4) and not keeps_records(None, None)


def test_no_reported_or_exported_best_is_a_brief_timing(tuned_tiny, redis_conn):
    """Screened timing (the default): whatever got only the brief timing, each task's reported best and every
    record the tuned model is compiled from had the full one."""
    res = tuned_tiny.result()
    tasks = store.job_tasks(redis_conn, tuned_tiny.job_id)
    wkeys = {t.task_id: t.wkey for t in tasks}
    assert "full_timing_of_bests" in res.retime
    for best in res.tasks:
        if best.best_candidate:
            rec = next(r for r in store.records(redis_conn, wkeys[best.task_id]) if r.candidate_key == best.best_candidate)
            assert rec.timing == "full", best.name
    with open(f"{res.database_dir}/database_tuning_record.json") as f:
        per_workload = {}
        for line in f:
            if line.strip():
                i = json.loads(line)[0]
                per_workload[i] = per_workload.get(i, 0) + 1
    exported_at = os.path.getmtime(f"{res.database_dir}/database_tuning_record.json")
    for i, t in enumerate(tasks):  # the export writes workloads in the job's task order (later jobs add records)
        surely, maybe = _full_at_export(redis_conn, t.wkey, exported_at)
        n = per_workload.get(i, 0)  # a task's full records, or none (its default)
        assert n == 0 or len(surely) <= n <= len(maybe), t.name


def _exported_keys(database_dir: str) -> dict[str, set[str]]:
    """The candidates an export wrote, by workload (its repeats file lists every one, applied or not)."""
    keys: dict[str, set[str]] = {}
    with open(os.path.join(database_dir, "database_repeats.json")) as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                keys.setdefault(row["wkey"], set()).add(row["candidate_key"])
    return keys


def _full_at_export(redis, wkey: str, exported_at: float) -> tuple[set[str], set[str]]:
    """The workload's valid records measured before an export: those fully timed from the start (the export
    had them), and those fully timed now (tuned_tiny is shared by the session: a later job of the same
    workload may have timed one of its brief bests fully after it exported; such a record keeps its brief
    figures in brief_run_secs)."""
    recs = [r for r in store.records(redis, wkey) if store.valid_record(r) and r.measured_at <= exported_at]
    return ({r.candidate_key for r in recs if r.timing == "full" and r.brief_run_secs is None},
            {r.candidate_key for r in recs if r.timing == "full"})


def test_uniform_timing_times_every_candidate_fully(client, lane_share, redis_conn):
    job = client.submit("tiny", target="llvm", share=lane_share, trials=8, trials_per_iter=8, seed=5, timing="uniform")
    assert job.wait(timeout_s=600)["state"] == "done"
    mine = [r for t in store.job_tasks(redis_conn, job.job_id) for r in store.records(redis_conn, t.wkey)
            if r.job_id == job.job_id]
    assert mine and all(r.timing == "full" for r in mine)
    assert store.job_spec(redis_conn, job.job_id).timing == "uniform"


def test_a_job_with_rounds_ahead_spends_its_budget_exactly_and_measures_no_candidate_twice(client, lane_share,
                                                                                           redis_conn):
    """Rounds searched and sent while the task's batch is still measured (real clients, lanes and builds; how
    many there are depends on timing, test_rounds.py steps through one): the job-wide budget stays exact and no
    candidate is measured twice."""
    job = client.submit("tiny", target="llvm", share=lane_share, trials=40, trials_per_iter=8, seed=11,
                        rounds_ahead=1, untuned_baseline=False, isolated=True)  # tuned_tiny's records untouched
    assert job.wait(timeout_s=900)["state"] == "done"
    mine = [r for t in store.job_tasks(redis_conn, job.job_id) for r in store.records(redis_conn, t.wkey)
            if r.job_id == job.job_id]
    assert len(mine) == job.result().trials == 40
    assert len({(r.wkey, r.candidate_key) for r in mine}) == len(mine)
    splits = store.splits(redis_conn, job.job_id)
    assert all("ahead_rounds" in s for s in splits)
    assert all(s["launch_floor_s"] and s["launch_floor_s"] > 0 for s in splits)  # the floor the gradients counted from
    assert store.job_spec(redis_conn, job.job_id).rounds_ahead == 1
    # each shard's round log: every round it sent, the claims adding up to the job's trials, first rounds marked
    log = [r for s in splits for r in s["round_log"]]
    assert sum(r[2] for r in log) == 40 and sum(s["rounds"] for s in splits) == len([r for r in log if r[2]])
    assert {r[1] for r in log if r[3]} == {t.name for t in store.job_tasks(redis_conn, job.job_id)}
    # and what each round's search did: its kind, CPU, candidates proposed (at least what it claimed)
    assert all(r[7] in ("drawn", "evolved") and r[8] >= 0 and r[9] >= r[2] for r in log)


def test_the_result_counts_how_candidates_were_timed(tuned_tiny, redis_conn):
    from sharetune.progress import timing_line

    res = tuned_tiny.result()
    mine = [r for t in store.job_tasks(redis_conn, tuned_tiny.job_id) for r in store.records(redis_conn, t.wkey)
            if r.job_id == tuned_tiny.job_id and store.valid_record(r)]
    assert sum(res.timings.values()) == len(mine) > 0
    # a later job of this module on the same workloads may time one of these records fully (its exported best):
    # a brief timing can become full since the result was written, never the other way
    brief_now = sum(r.timing == "brief" for r in mine)
    assert brief_now <= res.timings["brief"] and res.timings["full"] <= len(mine) - brief_now
    assert timing_line(res).startswith(f"timing: {res.timings['full']} candidates timed fully")


def test_the_transformers_take_task_tunes_without_an_error(client, redis_conn, lane_share):
    """The transformer's `take` of one of its 3 heads has an int64 index argument, which timing used to fill
    with values up to 7, past the axis of 3 (out-of-bounds reads; a segfault where they leave the mapping).
    Integer arguments are now zero (tests/test_timing.py checks the fill); here the task tunes end to end."""
    job = client.submit("transformer", target="llvm", share=lane_share, trials=4, trials_per_iter=4, seed=3,
                        only_tasks=["take"])
    assert job.wait(timeout_s=600)["state"] == "done"
    (task,) = store.job_tasks(redis_conn, job.job_id)
    recs = [r for r in store.records(redis_conn, task.wkey) if r.job_id == job.job_id]
    assert recs or store.job_progress(redis_conn, job.job_id)[task.task_id].reused_trials
    assert all(r.error is None for r in recs), [r.error for r in recs if r.error][:1]


def test_the_planner_and_the_updater_keep_liveness_keys_a_health_probe_finds(tuned_tiny, redis_conn):
    """Every worker role keeps a liveness key of its own (services.healthcheck needs no Celery ping)."""
    import socket

    planners, updaters = store.live_services(redis_conn, "planner"), store.live_services(redis_conn, "updater")
    assert planners and updaters, (planners, updaters)
    host = socket.gethostname()
    assert all(w.startswith(f"{host}.") for w in planners + updaters)
    assert store.host_liveness_key(redis_conn, host) is not None

"""Tuning records between MetaSchedule and the store: a measure callback that writes every measured
candidate to Redis (idempotent keys, lane and share attached), a MemoryDatabase seeded from the store
(so identical workloads reuse what earlier jobs measured), and the export to TVM's JSON database."""
from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import tvm
from tvm.s_tir import meta_schedule as ms

from shared import store
from shared.packed_json import pack_json_text, unpack_json_text
from services.tuner.metaschedule.ir_codec import load_ir
from shared.messages import Record, TaskProgress
from shared.ranking import default_secs, rank_secs


REPEATS_FILE = "database_repeats.json"  # beside TVM's two files: every repeat of every exported record


def record_json(rec: ms.database.TuningRecord) -> str:
    return pack_json_text(tvm.ir.save_json(rec.as_json()))


def tuning_record(packed: str, workload: ms.database.Workload) -> ms.database.TuningRecord:
    return ms.database.TuningRecord.from_json(tvm.ir.load_json(unpack_json_text(packed)), workload)


def tvm_record(rec: Record, workload: ms.database.Workload) -> ms.database.TuningRecord:
    """A stored record as a TVM TuningRecord. TVM's databases rank by the mean of run_secs, so the record
    carries the median of its repeats as its one figure: TVM then ranks as we do."""
    trec = tuning_record(rec.trace, workload)
    return ms.database.TuningRecord(trec.trace, workload, [rank_secs(rec.run_secs)], trec.target, trec.args_info)


valid = store.valid_record


def ranked(recs: list[Record], full_only: bool = False) -> list[Record]:
    """The valid records, best first; `full_only`: those with the full timing (what is exported, applied
    and reported as a task's best: a screening figure never is)."""
    return sorted((r for r in recs if valid(r) and (r.timing == "full" or not full_only)),
                  key=lambda r: rank_secs(r.run_secs))


def seed_database(redis, wkeys: list[str]) -> tuple[ms.database.MemoryDatabase, dict[str, int]]:
    """A MemoryDatabase holding every valid record the store has for these workloads."""
    db = ms.database.MemoryDatabase(module_equality="structural")
    reused = {}
    for wkey in wkeys:
        wl = db.commit_workload(load_ir(store.workload(redis, wkey).mod))
        recs = [r for r in store.records(redis, wkey) if valid(r)]
        for r in recs:
            db.commit_tuning_record(tvm_record(r, wl))
        reused[wkey] = len(recs)
    return db, reused


class Exported(NamedTuple):
    """What export_json_database wrote: the directory, the tuning records in TVM's file, and the
    workloads left without a record because their default schedule is as fast (TVM compiles the default)."""

    dir: str
    records: int
    defaults_kept: int


def export_json_database(redis, wkeys: list[str], out_dir: str) -> Exported:
    """Write database_workload.json + database_tuning_record.json (stock TVM's JSONDatabase) for these
    workloads, and every repeat of every record to database_repeats.json (TVM applies the same best as we
    report: see tvm_record). The records of a workload whose best does not beat its default schedule are
    left out of TVM's file (TVM then compiles the default); their repeats are still written."""
    os.makedirs(out_dir, exist_ok=True)
    for name in ("database_workload.json", "database_tuning_record.json", REPEATS_FILE):
        path = os.path.join(out_dir, name)
        if os.path.exists(path):
            os.remove(path)
    from services.tuner.metaschedule.defaults import keeps_records

    db = ms.database.JSONDatabase(work_dir=out_dir, module_equality="structural")
    n, kept = 0, 0
    with open(os.path.join(out_dir, REPEATS_FILE), "w") as repeats:
        for wkey in wkeys:
            wl = db.commit_workload(load_ir(store.workload(redis, wkey).mod))
            recs = ranked(store.records(redis, wkey), full_only=True)
            # a task whose best does not beat its default schedule keeps the default (defaults.py)
            apply = keeps_records(rank_secs(recs[0].run_secs) if recs else None,
                                  default_secs(store.default_timing(redis, wkey)))
            kept += bool(recs) and not apply
            for r in recs:
                if apply:
                    db.commit_tuning_record(tvm_record(r, wl))
                    n += 1
                repeats.write(json.dumps({"wkey": wkey, "candidate_key": r.candidate_key, "run_secs": r.run_secs,
                                          "shared_run_secs": r.shared_run_secs, "lane": r.lane}) + "\n")
    return Exported(out_dir, n, kept)


def measured_share(measured, job_share: int) -> int:
    """A record's share: the one the lane that measured it reports (MeasureResult.share), else the job's
    (a candidate never measured, or a lane that reported none)."""
    return measured.share if measured is not None and measured.share is not None else job_share


def candidate_key(wkey: str, candidate: ms.MeasureCandidate) -> str:
    """A candidate's identity in the store: its workload and its schedule trace, hashed."""
    return hashlib.sha1(f"{wkey}|{tvm.ir.save_json(candidate.sch.trace.as_json())}".encode()).hexdigest()[:24]


@dataclass(frozen=True)
class ShardTasks:
    """A shard's tasks, by task name: each one's workload key and task id, and where known its (target kind,
    WorkloadShape): a task's workload enters the store's index of similar workloads with its first valid
    record (where later jobs' warm seeds come from)."""

    wkeys: dict[str, str]
    task_ids: dict[str, str]
    shapes: dict = field(default_factory=dict)


class StoreRecords:
    """Replaces MetaSchedule's AddToDatabase: commits valid records to the in-process database the
    search reads, and every record (errors too) to Redis with the job's progress per task and the
    settling of the shard's trial claim, in one transaction: a client that dies mid-round leaves
    either all of the round in the store or none of it."""

    def __init__(self, redis, job_id: str, share: int, tasks: ShardTasks, runner, database: ms.database.Database,
                 shard: int = 0):
        self.redis, self.job_id, self.share, self.shard = redis, job_id, share, shard
        self.shapes = tasks.shapes
        self.seeded: dict[str, str] = {}  # candidate key -> the workload its trace was re-fitted from
        self.wkeys, self.task_ids = tasks.wkeys, tasks.task_ids  # task name -> workload key / task id
        self.runner, self.database = runner, database
        self.workloads: dict[str, ms.database.Workload] = {}
        self.progress = store.job_progress(redis, job_id)

    def known(self, wkey: str, keys: list[str]) -> dict[str, Record]:
        """The records the store already holds for these candidate keys (measured by an earlier job or
        by a client of this job that died): they are reused, never measured again. Valid records, and this job's
        failures (a source over the size limit fails every time: proposed again, it cost a trial and left no
        record of its own); a candidate that failed in an earlier job, or was never measured, is measured again."""
        return store.known_records(self.redis, wkey, keys, self.job_id)

    def record_round(self, ctx, measure_candidates, builder_results, runner_results, claimed: int) -> TaskProgress:
        name = ctx.task_name
        wkey = self.wkeys[name]
        if name not in self.workloads:
            self.workloads[name] = self.database.commit_workload(ctx.mod)
        workload = self.workloads[name]
        target = str(ctx.target)
        prog = self.progress.get(self.task_ids[name]) or TaskProgress(task_id=self.task_ids[name], name=name)
        recs = []
        for cand, built, ran in zip(measure_candidates, builder_results, runner_results):
            run_secs = [float(s) for s in ran.run_secs] if ran.run_secs is not None else None
            error = built.error_msg or ran.error_msg
            if error == store.CANCELLED:
                continue  # never measured: not a record, not a trial; a later job measures it
            rec = ms.database.TuningRecord(cand.sch.trace, workload, run_secs, ctx.target, cand.args_info)
            if error is None and run_secs:
                self.database.commit_tuning_record(rec)
            packed = record_json(rec)  # ranked by the runner's figure (the median of the repeats)
            measured = self.runner.measured.pop(built.artifact_path, None) if built.artifact_path else None
            if error is None and measured is not None and measured.run_secs:
                run_secs = [float(x) for x in measured.run_secs]  # the store keeps every repeat
            key = candidate_key(wkey, cand)
            recs.append(Record(
                candidate_key=key, wkey=wkey, seeded_from=self.seeded.pop(key, None), trace=packed, run_secs=run_secs,
                error=error, target=target, args_info=[], share=measured_share(measured, self.share),
                lane=measured.lane if measured else "", device=measured.device if measured else {},
                job_id=self.job_id, measured_at=time.time(),
                timing=(measured.timing or "full") if measured else "full",
                window_ms=measured.window_ms if measured else None,
                build_cpu_s=measured.build_cpu_s if measured else None,
                output_checked=bool(measured and measured.output_checked),
            ))
            prog.trials += 1
            if error is not None or not run_secs:
                prog.errors += 1
            elif recs[-1].timing == "full":  # a brief figure is a screening, never a task's best (as in results)
                us = 1e6 * rank_secs(run_secs)
                prog.best_us = us if prog.best_us is None else min(prog.best_us, us)
        self.progress[prog.task_id] = prog
        store.record_round(self.redis, self.job_id, self.shard, recs, prog, claimed, self.shapes.get(name))
        return prog


def scheduled_candidate(rec: Record, workload_mod) -> tuple[object, ms.database.TuningRecord]:
    """A stored record's schedule, replayed on its workload, as a candidate to measure again."""
    from services.tuner.metaschedule.lane_runner import module_candidate

    trec = tuning_record(rec.trace, ms.database.Workload(workload_mod))
    sch = tvm.s_tir.Schedule(workload_mod)
    trec.trace.apply_to_schedule(sch, remove_postproc=False)
    return module_candidate(rec.candidate_key, sch.mod), trec


def with_run_secs(rec: Record, trec: ms.database.TuningRecord, run_secs: list[float]) -> None:
    """The record's figures replaced (its trace's copy too), in place."""
    rec.run_secs = run_secs
    rec.trace = record_json(ms.database.TuningRecord(trec.trace, trec.workload, run_secs, trec.target, trec.args_info))


def full_timing_of_bests(redis, runner, wkeys: list[str], rounds: int = 4) -> dict:
    """Screened timing's guarantee: no workload's best is a brief figure. While a workload's best valid
    record got only the brief timing, it is timed fully (its brief figures kept in brief_run_secs; where the
    runner checks outputs, LaneRunner.check_outputs, against the workload's reference) and
    ranked again; a few rounds at most, all workloads at once. Returns how many were timed again."""
    timed, failed = 0, 0
    try:
        for _ in range(rounds):
            n, bad = _time_brief_bests_fully(redis, runner, wkeys)
            timed, failed = timed + n, failed + bad
            if n + bad == 0:
                break
    except RuntimeError as err:  # no lane left: the brief bests stay brief, and nothing exports them
        return {"timed": timed, "failed": failed, "error": str(err)}
    return {"timed": timed, "failed": failed}


def _time_brief_bests_fully(redis, runner, wkeys: list[str]) -> tuple[int, int]:
    """One round: every workload whose best is brief gets it timed fully; (timed, failed)."""
    todo = {}
    for wkey in wkeys:
        best = next(iter(ranked(store.records(redis, wkey))), None)
        if best is not None and best.timing == "brief":
            cand, trec = scheduled_candidate(best, load_ir(store.workload(redis, wkey).mod))
            if getattr(runner, "check_outputs", True):  # a brief timing was never checked: the full one is
                cand = cand.model_copy(update={"reference_key": wkey})
            todo[best.candidate_key] = (best, cand, trec)
    if not todo:
        return 0, 0
    timed, failed = 0, 0
    for key, res in runner.measure_now([cand for _, cand, _ in todo.values()]).items():
        rec, _, trec = todo[key]
        rec.brief_run_secs, rec.timing = rec.run_secs, "full"
        if res.error is not None or not res.run_secs:
            rec.error, rec.run_secs = f"full timing failed after a brief one: {res.error}", None
            failed += 1
        else:
            with_run_secs(rec, trec, res.run_secs)
            rec.window_ms, rec.output_checked = res.window_ms, res.output_checked
            timed += 1
        store.replace_record(redis, rec)
    return timed, failed


def retime_top_k(redis, runner, job_id: str, wkeys: list[str], k: int) -> dict:
    """Before a task's best is final: re-time its k best candidates at the same share with the job's
    other lanes idle (tuning is over), keep the re-timed figures as the record's run_secs (the shared
    ones stay in shared_run_secs), and return the gap between shared and isolated timings."""
    picked: dict[str, tuple[Record, ms.database.TuningRecord]] = {}
    candidates = []
    for wkey in wkeys:
        workload_mod = load_ir(store.workload(redis, wkey).mod)
        best = [r for r in ranked(store.records(redis, wkey)) if r.retimed_at is None][:k]
        for rec in best:
            cand, trec = scheduled_candidate(rec, workload_mod)
            candidates.append(cand)
            picked[rec.candidate_key] = (rec, trec)
    if not candidates:
        return {"retimed": 0}
    results = runner.measure_now(candidates, one_lane=True)
    gaps = []
    for key, res in results.items():
        rec, trec = picked[key]
        if res.error is not None or not res.run_secs:
            continue
        shared = rec.run_secs
        rec.shared_run_secs, rec.retimed_at = shared, time.time()
        if rec.timing == "brief":
            rec.brief_run_secs, rec.timing = shared, "full"
        with_run_secs(rec, trec, res.run_secs)
        rec.window_ms = res.window_ms
        store.replace_record(redis, rec)
        gaps.append(rank_secs(res.run_secs) / rank_secs(shared) - 1.0)
    return {"retimed": len(gaps), "mean_gap": round(sum(gaps) / len(gaps), 4) if gaps else None,
            "max_gap": round(max(gaps, key=abs), 4) if gaps else None}

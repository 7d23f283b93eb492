"""Each task's default schedule: what the model runs for a task that has no tuning record (on a GPU,
DLight's rules as tvm.compile's CUDA pipeline applies them; on a CPU, the lowered loop nest as it is),
timed once per workload on a lane, like any candidate.

Why: MetaSchedule's compile applies a task's best record whether or not it beats that default, and on
the H200 a few sampled CUDA schedules per task are far slower than DLight's (a 64-trial budget over
MobileNetV2's 54 tasks made the model 7.7x slower than untuned). The service applies a task's records
only when their best beats its default (`keeps_records`), so a tuned model is never slower than the
untuned one task by task, and the gradient sees a task's real latency (the default until a candidate
beats it)."""
from __future__ import annotations

import logging

import tvm

from shared import store
from shared.messages import DefaultTiming, JobTask
from shared.ranking import default_secs
from services.tuner.metaschedule.ir_codec import dump_ir

log = logging.getLogger("sharetune.tuner.defaults")
PREFIX = "default:"


def default_module(mod: tvm.IRModule, target: tvm.target.Target) -> tvm.IRModule:
    """The task's module as the untuned model compiles it. DLight schedules the module it is given in
    place, so it gets a copy: the workload must stay as the search and the store know it."""
    if target.kind.name == "cuda":
        from tvm.s_tir import dlight as dl

        from services.tuner.metaschedule.ir_codec import load_ir

        with target:
            return dl.ApplyDefaultSchedule(dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(),
                                           dl.gpu.GeneralReduction(), dl.gpu.Fallback())(load_ir(dump_ir(mod)))
    return mod


def keeps_records(best_secs: float | None, default: float | None) -> bool:
    """Whether a task's records go into the tuned model: its best beats the default schedule (or the
    default could not be timed)."""
    return best_secs is not None and (default is None or best_secs < default)


def measure_defaults(redis, runner, tasks: list[JobTask], mods: dict, target,
                     floor: bool = False) -> dict[str, float | None]:
    """Each task's default-schedule seconds (task_id -> s, None when it cannot be built or run), timed on
    the job's lanes for the workloads the store has no valid timing of yet; each default-scheduled module is
    also stored as its workload's reference (store.put_reference). With `floor`, the lanes' launch floor
    (launch_floor) goes in the same batch where the store has no timing of it: a client's start waits for one
    round trip to the lanes, not two."""
    from services.tuner.metaschedule.lane_runner import module_candidate

    out, candidates, pending = {}, [], {}  # pending: candidate_id -> (its workload key, its task_id; None: floor)
    stored = store.references(redis, [t.wkey for t in tasks])
    for t in tasks:
        known = store.default_timing(redis, t.wkey)
        if known is not None and known.run_secs and stored[t.wkey] is not None:
            out[t.task_id] = default_secs(known)
            continue
        try:
            cand = module_candidate(PREFIX + t.wkey, default_module(mods[t.task_id], target))
        except Exception as err:  # noqa: BLE001 - no default to compare against: records apply as they are
            log.info("task %s: no default schedule (%s)", t.name, err)
            out[t.task_id] = None
            continue
        # the lanes check each fully timed candidate's output against this module's (Candidate.reference_key)
        store.put_reference(redis, t.wkey, cand.mod)
        if known is not None and known.run_secs:
            out[t.task_id] = default_secs(known)
            continue
        candidates.append(cand)
        pending[cand.candidate_id] = (t.wkey, t.task_id)
    if floor and (cand := floor_candidate(redis, target)) is not None:
        candidates.append(cand)
        pending[cand.candidate_id] = (FLOOR_WKEY + str(target), None)
    if candidates:
        for cid, res in runner.measure_now(candidates).items():
            wkey, task_id = pending[cid]
            timing = DefaultTiming(wkey=wkey, run_secs=res.run_secs, error=res.error, lane=res.lane)
            store.put_default(redis, timing)
            if task_id is not None:
                out[task_id] = default_secs(timing)
    return out


FLOOR_WKEY = "launch-floor:"  # + the target: the store keeps the floor as a default timing of its own


def floor_module() -> tvm.IRModule:
    """The least a kernel can do: copy 64 floats (scheduled by default_module, as any task's default)."""
    from tvm import te

    a = te.placeholder((64,), name="a")
    return tvm.IRModule({"main": te.create_prim_func([a, te.compute((64,), lambda i: a[i], name="b")])})


def floor_candidate(redis, target):
    """The launch floor's candidate for `target`, or None where the store has its timing already or it cannot be
    built (kept then as a failed timing, so what waits for the floor, FirstRounds, does not wait for good)."""
    from services.tuner.metaschedule.lane_runner import module_candidate

    wkey = FLOOR_WKEY + str(target)
    known = store.default_timing(redis, wkey)
    if known is not None and known.run_secs:
        return None
    try:
        return module_candidate(PREFIX + wkey, default_module(floor_module(), target))
    except Exception as err:  # noqa: BLE001 - no floor: the gradient takes latencies as they are
        log.info("no launch floor for %s (%s)", target, err)
        store.put_default(redis, DefaultTiming(wkey=wkey, error=f"no launch floor: {err}"))
        return None


def launch_floor(redis, runner, target) -> float | None:
    """What the job's lanes time a trivial kernel at (seconds, timed once per target and kept in the store): the
    least any task can reach, launches and the timer included (on an H100 the panel's lightest tasks time at
    2.7-2.8 us). None where it cannot be built or run."""
    wkey = FLOOR_WKEY + str(target)
    if (cand := floor_candidate(redis, target)) is not None:
        for res in runner.measure_now([cand]).values():
            store.put_default(redis, DefaultTiming(wkey=wkey, run_secs=res.run_secs, error=res.error, lane=res.lane))
    return default_secs(store.default_timing(redis, wkey))

"""The planner's core: turn a submitted job's model into tasks in the store, then hand it to a tuner.
A job names a target kind and a share; the lanes that serve (kind, share) say which exact target
(cores, CPU model; later GPU arch) the tasks are tuned for."""
from __future__ import annotations

import time

from shared import lanes, store
from shared.errors import ModelError
from shared.messages import FINAL_STATES, JobState, JobTask, LaneInfo, ShardState, Workload, lane_kind
from services.tuner.allocation import first_round_size, partition


class Parked(Exception):
    """No live lane serves the job's (kind, share) yet. The planner does not sleep on it (one planner
    would hold every later job behind it): the caller re-sends the plan message `retry_in` s later."""

    def __init__(self, job_id: str, waiting_for: str, retry_in: float):
        super().__init__(f"job {job_id} waits for {waiting_for}")
        self.job_id, self.waiting_for, self.retry_in = job_id, waiting_for, retry_in


def lanes_or_park(redis, job_id: str, kind: str, share: int, policy: lanes.LiveLanePolicy,
                  wait_for_lanes: bool = False) -> list[LaneInfo]:
    """The lanes serving (kind, share); none yet: Parked while the policy lets the job wait (since it was
    first parked), then ShareError naming the live lanes."""
    live = store.live_lanes(redis)
    serving = lanes.serving(live, kind, share)
    if serving:
        store.clear_job_fields(redis, job_id, "waiting_for")
        return serving
    parked_at = store.parked_since(redis, job_id)  # before the clock is read: stamped now the first time
    waited = time.time() - parked_at
    if policy.parks(waited, wait_for_lanes):
        waiting_for = lanes.waiting_for(kind, share)
        store.update_job(redis, job_id, waiting_for=waiting_for)
        raise Parked(job_id, waiting_for, policy.recheck_s)
    raise policy.unserved(kind, share, waited, live)


def budget_advice(trials: int, per_iter: int, tasks: int) -> str | None:
    """A budget that cannot give every task a full search round (trials < tasks x trials per round) is
    shared evenly by the first rounds (allocation.first_round_size): say how thin, and name the budget that
    gives every task a full round."""
    need = tasks * per_iter
    if trials >= need:
        return None
    if trials < tasks:
        reach = f"reach {trials} of the {tasks} tasks with one candidate each"
    else:
        k = first_round_size(trials, tasks, per_iter)
        reach = f"give each of the {tasks} tasks a first round of {k} candidate{'s' if k > 1 else ''}"
    return f"{trials} trials at {per_iter} a round {reach}; {need} trials (--trials {need}) give every task a full round"


def live_tuners(redis) -> int:
    return store.live_tuners(redis)


def plan(redis, job_id: str, policy: lanes.LiveLanePolicy, pad_convolutions: bool = False,
         fold_norms: bool = False) -> list[ShardState]:
    """Extract the job's tasks, store workloads (once per distinct workload), record the job's tasks
    with how many records the store already holds for each, and split them into shards, one per tuner
    client that will search them at the same time. `pad_convolutions`: the job's convolutions with awkward
    output extents are tuned over padded ones (TunerSettings.pad_awkward `all`); `fold_norms`: its transposed layer
    norms over the channel axis (TunerSettings.fold_norm_transposes)."""
    from services.tuner.metaschedule.ir_codec import dump_ir, load_ir, target_from_json
    from services.tuner.metaschedule.extract import extract, workload_key

    spec = store.job_spec(redis, job_id)
    state = store.job_status(redis, job_id)
    if state in FINAL_STATES:
        return []  # e.g. a parked job cancelled while it waited for lanes
    if state != JobState.PLANNING:  # a parked job's re-check keeps its first planning_at
        store.set_state(redis, job_id, JobState.PLANNING)
    kind = lane_kind(spec.target)
    serving = lanes_or_park(redis, job_id, kind, spec.share, policy, spec.wait_for_lanes)
    target = target_from_json(serving[0].target)
    mod = load_ir(store.job_model(redis, job_id).decode())
    tasks: list[JobTask] = []
    reused: dict[str, int] = {}
    extracted = extract(mod, target, pad_convolutions=pad_convolutions, fold_norms=fold_norms)
    if spec.only_tasks:
        extracted = [t for t in extracted if t.name in set(spec.only_tasks)]
        missing = set(spec.only_tasks) - {t.name for t in extracted}
        if missing:
            raise ModelError(f"the model has no task named {', '.join(sorted(missing))}")
    for t in extracted:
        wkey = workload_key(t.mod, target, spec.share, scope=spec.job_id if spec.isolated else None)
        store.put_workload(
            redis, Workload(wkey=wkey, name=t.name, target=str(target), share=spec.share, mod=dump_ir(t.mod))
        )
        reused[wkey] = store.record_count(redis, wkey)
        tasks.append(JobTask(task_id=wkey, name=t.name, weight=t.weight, wkey=wkey, flops=t.flops))
    store.put_tasks(redis, job_id, tasks, reused)
    shards = store.shards(redis, job_id)
    if not shards:  # a redelivered plan message keeps the shards (and budget) it made the first time
        n = spec.clients or max(1, live_tuners(redis))
        store.put_shards(redis, job_id, partition(store.job_tasks(redis, job_id), n), spec.trials)
        shards = store.shards(redis, job_id)
    advice = budget_advice(spec.trials, spec.trials_per_iter, len(tasks))
    store.set_state(redis, job_id, JobState.PLANNED, target_json=str(target), lanes=[l.queue for l in serving],
                    clients=len(shards), **({"advice": advice} if advice else {}))
    return [shards[k] for k in sorted(shards)]

"""The reaper: run by every tuner client's heartbeat, so it lives as long as any client does. It finds
shards whose client died (running, but no lease left) or whose message nobody took, hands their
unrecorded trial claims back to the job's budget and sends them again; and it re-sends the finishing
step of a job whose shards are all done when the client that should have finished it died, and the plan
message of a job whose planner died while planning it (or that no planner holds: no lease, the plan queue
empty, its last send timeouts.STRANDED_PLAN_S ago), with a new token, so the old one is dropped if it ever comes
back. Guards in
Redis make one reaper act, not all of them; taking a shard needs its lease, so a shard is never
searched by two clients at once. The reaper holds a shard's lease itself while it sends the shard again,
and writes the shard with a compare-and-set, so a client and a reaper never overwrite each other."""
from __future__ import annotations

import logging
import time
import uuid
from typing import Callable

from shared import names, store, timeouts
from shared.messages import FINAL_STATES, JobRef, JobState, ShardPhase, ShardRef, ShardState

log = logging.getLogger("sharetune.tuner.reaper")


def reap(redis, send_shard: Callable[[ShardRef], None], send_finish: Callable[[str], None],
         now: float | None = None, send_plan: Callable[[JobRef], None] | None = None) -> list[str]:
    """One pass over the jobs awaiting a plan and the active jobs; returns what it did (for logs and tests)."""
    now = time.time() if now is None else now
    me = f"reaper.{uuid.uuid4().hex[:12]}"  # holds a shard's lease while it sends the shard again
    actions = reap_plans(redis, send_plan, now) if send_plan is not None else []
    for job_id in _jobs(redis, store.active_jobs(redis), lambda s: s not in FINAL_STATES, store.deactivate_job):
        shards = store.shards(redis, job_id)
        queue_empty = store.queue_length(redis, names.TUNE_QUEUE) == 0

        def orphaned(sh: ShardState) -> bool:
            return sh.state == ShardPhase.RUNNING or (
                sh.state == ShardPhase.PENDING and queue_empty and now - sh.queued_at > timeouts.STRANDED_AFTER_S)

        for sh in shards.values():
            # a shard with a lease has a live client; a free one is leased by the reaper for the re-send, so
            # no client can start (or finish) it meanwhile
            if not orphaned(sh) or not store.take_lease(redis, job_id, sh.shard, me):
                continue
            try:
                if not store.claim_requeue(redis, job_id, sh.shard):
                    continue  # another reaper is on it
                dead, refunded = sh.state == ShardPhase.RUNNING, 0

                def requeued(cur: ShardState):
                    nonlocal refunded
                    if not orphaned(cur):  # changed since this pass read it (e.g. its client finished it)
                        return False
                    refunded += store.refund_claim(redis, job_id, cur.shard, cur.task_ids)  # once: then 0
                    cur.state, cur.owner, cur.queued_at = ShardPhase.PENDING, None, now
                    cur.refunded += refunded

                if store.update_shard(redis, job_id, sh.shard, requeued, owner=me) is None:
                    continue
            finally:
                store.release_lease(redis, job_id, sh.shard, me)
            send_shard(ShardRef(job_id=job_id, shard=sh.shard))
            why = f"client {sh.owner} lost its lease" if dead else "its message was never taken"
            actions.append(f"job {job_id} shard {sh.shard} sent again ({why}; {refunded} trials refunded)")
        # a finish nobody claimed, or one sent long ago that waits in no queue and no client started
        if (shards and all(sh.state == ShardPhase.DONE for sh in shards.values())
                and (store.claim_finish(redis, job_id, "reaper")
                     or (queue_empty and store.reclaim_stranded_finish(redis, job_id, "reaper")))):
            send_finish(job_id)
            actions.append(f"job {job_id} finish sent again")
    for a in actions:
        log.warning("reaper: %s", a)
    return actions


def reap_plans(redis, send_plan: Callable[[JobRef], None], now: float) -> list[str]:
    """Send again the plan of each job whose plan no planner holds: its planner died mid-plan (its message
    unacknowledged until Redis's visibility timeout, an hour) or the message was lost."""
    actions = []
    plan_queue_empty = store.queue_length(redis, names.PLAN_QUEUE) == 0
    awaiting_plan = (JobState.QUEUED, JobState.PLANNING)
    for job_id in _jobs(redis, store.planning_jobs(redis), lambda s: s in awaiting_plan, store.planned):
        if not plan_queue_empty:  # a planner is behind, or none is up: what waits in the queue is taken first
            continue
        ref = JobRef(job_id=job_id, plan=uuid.uuid4().hex)
        if store.replace_stranded_plan(redis, job_id, ref.plan, now, timeouts.STRANDED_PLAN_S):
            send_plan(ref)
            actions.append(f"job {job_id} plan sent again (no planner held it)")
    return actions


def _jobs(redis, job_ids, wanted: Callable[[str], bool], forget: Callable[[object, str], None]):
    """The jobs of a reaper's list whose state `wanted` accepts; the others (ended, or deleted under us) are
    taken off the list with `forget`."""
    for job_id in job_ids:
        try:
            state = store.job_status(redis, job_id)
        except Exception:  # noqa: BLE001 - a job deleted under us
            state = None
        if state is not None and wanted(state):
            yield job_id
        else:
            forget(redis, job_id)

"""The reaper: run by every tuner client's heartbeat, so it lives as long as any client does. It finds
shards whose client died (running, but no lease left) or whose message nobody took, hands their
unrecorded trial claims back to the job's budget and sends them again; and it re-sends the finishing
step of a job whose shards are all done when the client that should have finished it died. Guards in
Redis make one reaper act, not all of them; taking a shard needs its lease, so a shard is never
searched by two clients at once."""
from __future__ import annotations

import logging
import time
from typing import Callable

from shared import names, store
from shared.messages import ShardRef

log = logging.getLogger("sharetune.tuner.reaper")


def reap(redis, send_shard: Callable[[ShardRef], None], send_finish: Callable[[str], None],
         now: float | None = None) -> list[str]:
    """One pass over the active jobs; returns what it did (for logs and tests)."""
    now = time.time() if now is None else now
    actions = []
    for raw in redis.smembers(names.ACTIVE_JOBS_KEY):
        job_id = raw.decode() if isinstance(raw, bytes) else raw
        try:
            state = store.job_state(redis, job_id).get("state")
        except Exception:  # noqa: BLE001 - a job deleted under us
            redis.srem(names.ACTIVE_JOBS_KEY, job_id)
            continue
        if state in ("done", "failed", "cancelled"):
            redis.srem(names.ACTIVE_JOBS_KEY, job_id)
            continue
        shards = store.shards(redis, job_id)
        queue_empty = redis.llen(names.TUNE_QUEUE) == 0
        for sh in shards.values():
            if sh.state == "done" or store.lease_owner(redis, job_id, sh.shard) is not None:
                continue
            dead = sh.state == "running"
            stranded = sh.state == "pending" and queue_empty and now - sh.queued_at > names.STRANDED_AFTER_S
            if not (dead or stranded):
                continue
            if not redis.set(names.shard_requeue_key(job_id, sh.shard), "1", nx=True, ex=names.LEASE_TTL_S):
                continue  # another reaper is on it
            refunded = store.refund_claim(redis, job_id, sh.shard)
            why = f"client {sh.owner} lost its lease" if dead else "its message was never taken"
            sh.state, sh.owner, sh.queued_at, sh.refunded = "pending", None, now, sh.refunded + refunded
            store.put_shard(redis, job_id, sh)
            send_shard(ShardRef(job_id=job_id, shard=sh.shard))
            actions.append(f"job {job_id} shard {sh.shard} sent again ({why}; {refunded} trials refunded)")
        if shards and all(sh.state == "done" for sh in shards.values()) \
                and not redis.exists(names.job_finish_key(job_id)):
            if redis.set(names.job_finish_key(job_id), "reaper", nx=True, ex=900):
                send_finish(job_id)
                actions.append(f"job {job_id} finish sent again")
    for a in actions:
        log.warning("reaper: %s", a)
    return actions

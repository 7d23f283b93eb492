"""What one owner holds at a time, renewed and released only by its owner (Lua compare-and-expire/delete):
a shard's lease, a replica's lane claim, a GPU's isolation gate; and the shards, written by compare-and-set."""
from __future__ import annotations

import time
from typing import Callable

import redis

from shared import names, timeouts
from shared.messages import ShardPhase, ShardState
from shared.store._redis import _s, _script


# ---- leases, claims and gates: held by one owner, renewed and released by that owner only -------------------

# Take a key if it is free or already ours (a redelivered message of the same owner); 1 when held now.
_TAKE = _script("""
local cur = redis.call('GET', KEYS[1])
if cur and cur ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
return 1
""")

# Renew only while we hold it; 0 means it is lost (expired, perhaps taken by another owner).
_RENEW = _script("""
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('EXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
""")

# A shard's lease renewed, or taken again when it lapsed while nothing else happened: nobody holds it and the
# shard (KEYS[2] field ARGV[3]) is still running under this owner, so no reaper has sent it again. A renewal
# that came late (a loaded host) then keeps a live client's shard. 1 renewed, 2 taken again, 0 lost.
_RENEW_SHARD = _script("""
local cur = redis.call('GET', KEYS[1])
if cur == ARGV[1] then
  redis.call('EXPIRE', KEYS[1], ARGV[2])
  return 1
end
if cur then return 0 end
local raw = redis.call('HGET', KEYS[2], ARGV[3])
if not raw then return 0 end
local sh = cjson.decode(raw)
if sh['state'] == 'running' and sh['owner'] == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
  return 2
end
return 0
""")

# Delete only our own: one that expired and was taken by another owner stays theirs.
_RELEASE = _script("""
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
""")


def take_lease(r: redis.Redis, job_id: str, shard: int, owner: str, ttl_s: int = timeouts.LEASE_TTL_S) -> bool:
    return bool(_TAKE(keys=[names.shard_lease_key(job_id, shard)], args=[owner, int(ttl_s)], client=r))


def renew_lease(r: redis.Redis, job_id: str, shard: int, owner: str, ttl_s: int = timeouts.LEASE_TTL_S) -> bool:
    """True while `owner` holds the shard: renewed, or taken again after it lapsed unseen (see _RENEW_SHARD)."""
    return renew_lease_as(r, job_id, shard, owner, ttl_s) > 0


def renew_lease_as(r: redis.Redis, job_id: str, shard: int, owner: str, ttl_s: int = timeouts.LEASE_TTL_S) -> int:
    """1 renewed, 2 taken again after it lapsed while the shard stayed this owner's, 0 lost."""
    return int(_RENEW_SHARD(keys=[names.shard_lease_key(job_id, shard), names.job_shards_key(job_id)],
                            args=[owner, int(ttl_s), str(shard)], client=r))


def lease_owner(r: redis.Redis, job_id: str, shard: int) -> str | None:
    return _s(r.get(names.shard_lease_key(job_id, shard)))


def release_lease(r: redis.Redis, job_id: str, shard: int, owner: str) -> bool:
    """True when it was ours and is released; a lease another owner holds now is left alone."""
    return bool(_RELEASE(keys=[names.shard_lease_key(job_id, shard)], args=[owner], client=r))


# A pool slot for a claimant: the one it already holds, else the first free one; 0-based index, -1 when none.
# A container restarted in place has the same claimant id (hostname.pid: same container id, pid 1), so its
# old claim is its own and is taken back at once, not refused until the TTL lapses (which outlasts
# on-failure:3). One script, so two replicas never take one slot.
_CLAIM_SLOT = _script("""
for i, key in ipairs(KEYS) do
  if redis.call('GET', key) == ARGV[1] then
    redis.call('SET', key, ARGV[1], 'EX', ARGV[2])
    return i - 1
  end
end
for i, key in ipairs(KEYS) do
  if redis.call('SET', key, ARGV[1], 'NX', 'EX', ARGV[2]) then return i - 1 end
end
return -1
""")


def claim_slot(r: redis.Redis, scope: str, slots: int, worker: str, ttl_s: int = timeouts.LANE_TTL_S) -> int | None:
    """Claim a slot of a lane pool for `worker`: the one it holds already (a restarted container), else the
    first free one; None when all are held by others. The claim lives while its owner refreshes it (the
    lane's heartbeat)."""
    keys = [names.lane_claim_key(scope, i) for i in range(slots)]
    slot = int(_CLAIM_SLOT(keys=keys, args=[worker, int(ttl_s)], client=r))
    return None if slot < 0 else slot


def refresh_claim(r: redis.Redis, claim_key: str, worker: str, ttl_s: int = timeouts.LANE_TTL_S) -> bool:
    """Keep a lane-pool claim (taken again if it lapsed and is still free); False when another replica
    holds it now, which is then left alone."""
    return bool(_TAKE(keys=[claim_key], args=[worker, int(ttl_s)], client=r))


def release_claim(r: redis.Redis, claim_key: str, worker: str) -> bool:
    return bool(_RELEASE(keys=[claim_key], args=[worker], client=r))


# A GPU's gate (isolation.GpuGate): a hash {holder, until}. Taken only if free or lapsed (its deadline lets a
# dead holder's gate go); the key's TTL follows the deadline.
_GATE_TAKE = _script("""
local now = tonumber(ARGV[2])
local holder = redis.call('HGET', KEYS[1], 'holder')
local until_ = tonumber(redis.call('HGET', KEYS[1], 'until') or '0')
if holder and holder ~= ARGV[1] and until_ > now then return 0 end
redis.call('HSET', KEYS[1], 'holder', ARGV[1], 'until', ARGV[3])
redis.call('EXPIRE', KEYS[1], math.ceil(tonumber(ARGV[3]) - now) + 1)
return 1
""")

_GATE_RELEASE = _script("""
if redis.call('HGET', KEYS[1], 'holder') == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
""")


def take_gpu_gate(r: redis.Redis, gpu8: str, worker: str, now: float, until: float) -> bool:
    return bool(_GATE_TAKE(keys=[names.gpu_gate_key(gpu8)], args=[worker, repr(now), repr(until)], client=r))


def release_gpu_gate(r: redis.Redis, gpu8: str, worker: str) -> bool:
    """True when the gate was ours and is released; a gate that lapsed and was taken by another stays."""
    return bool(_GATE_RELEASE(keys=[names.gpu_gate_key(gpu8)], args=[worker], client=r))


def enter_gpu_running(r: redis.Redis, gpu8: str, worker: str, until: float) -> tuple[str | None, float]:
    """Announce a candidate running on the GPU, then read its gate, in this order and one round trip;
    returns the gate's (holder, deadline)."""
    with r.pipeline(transaction=False) as p:
        p.hset(names.gpu_running_key(gpu8), worker, repr(until))
        p.hmget(names.gpu_gate_key(gpu8), "holder", "until")
        _, (holder, deadline) = p.execute()
    return _s(holder), float(deadline or 0)


def set_gpu_running(r: redis.Redis, gpu8: str, worker: str, until: float) -> None:
    r.hset(names.gpu_running_key(gpu8), worker, repr(until))


def leave_gpu_running(r: redis.Redis, gpu8: str, worker: str) -> None:
    r.hdel(names.gpu_running_key(gpu8), worker)


def clear_gpu_isolation(r: redis.Redis, gpu8: str) -> None:
    """Every lane of the GPU was ended (a recovery): no gate holder or running candidate of theirs stands,
    so a suspect of the restarted lanes never waits out a dead lane's deadline."""
    r.delete(names.gpu_gate_key(gpu8), names.gpu_running_key(gpu8))


def count_suspect_run(r: redis.Redis, gpu8: str, chash: str) -> None:
    r.hincrby(names.suspect_runs_key(gpu8), chash, 1)


def suspect_runs(r: redis.Redis, gpu8: str) -> dict[str, int]:
    """candidate hash -> times it ran alone on the GPU as a suspect."""
    return {_s(k): int(v) for k, v in r.hgetall(names.suspect_runs_key(gpu8)).items()}


def gpu_running(r: redis.Redis, gpu8: str) -> dict[str, float]:
    """worker -> deadline of every lane announcing a candidate on the GPU (lapsed entries included)."""
    return {_s(w): float(u) for w, u in r.hgetall(names.gpu_running_key(gpu8)).items()}


# ---- shards --------------------------------------------------------------------------------------------------

# Compare-and-set one shard's state: written only if it is still what the writer read (ARGV[2]; '' = absent),
# and, with an owner (ARGV[4]), only while that owner holds the shard's lease; ARGV[5] = '1' releases the
# lease in the same step. 1 written, 0 the shard changed meanwhile, -1 the lease is not ours.
_CAS_SHARD = _script("""
if ARGV[4] ~= '' and redis.call('GET', KEYS[2]) ~= ARGV[4] then return -1 end
local cur = redis.call('HGET', KEYS[1], ARGV[1])
if (cur or '') ~= ARGV[2] then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
if ARGV[5] == '1' then redis.call('DEL', KEYS[2]) end
return 1
""")


def put_shards(r: redis.Redis, job_id: str, shards: list[ShardState], budget: int) -> None:
    """Write a job's shards and its budget once; a re-planned job keeps what it had."""
    with r.pipeline() as p:
        for sh in shards:
            p.hsetnx(names.job_shards_key(job_id), str(sh.shard), sh.model_dump_json())
        p.set(names.job_budget_key(job_id), int(budget), nx=True)
        p.sadd(names.ACTIVE_JOBS_KEY, job_id)
        p.execute()


def shards(r: redis.Redis, job_id: str) -> dict[int, ShardState]:
    raw = r.hgetall(names.job_shards_key(job_id))
    return {int(_s(k)): ShardState.parse(v) for k, v in raw.items()}


def update_shard(r: redis.Redis, job_id: str, shard: int, change: Callable[[ShardState], bool | None],
                 owner: str | None = None, release: bool = False, attempts: int = 5) -> ShardState | None:
    """Read a shard, let `change` modify it (returning False: leave it), and write it back only if nobody
    wrote it meanwhile (compare-and-set), so the reaper and a client never overwrite each other's newer
    state; on such a conflict `change` runs again on the newer state, up to `attempts` times. With `owner`,
    only while that owner holds the shard's lease (`release`: and the lease is released with the write).
    Returns the state written, or None: declined, the lease is not the owner's, or every attempt lost."""
    key, lease = names.job_shards_key(job_id), names.shard_lease_key(job_id, shard)
    for _ in range(attempts):
        raw = r.hget(key, str(shard))
        if raw is None:
            return None
        sh = ShardState.parse(raw)
        if change(sh) is False:
            return None
        got = _CAS_SHARD(keys=[key, lease], args=[str(shard), raw, sh.model_dump_json(), owner or "",
                                                  "1" if release else "0"], client=r)
        if got == 1:
            return sh
        if got == -1:
            return None
    return None


def finish_shard(r: redis.Redis, job_id: str, shard: int, owner: str) -> bool:
    """Mark a shard done and release its lease, atomically, only while `owner` still holds the lease
    (a client that lost it was replaced: the replacement's state stands). True when done by us."""
    def done(sh: ShardState) -> None:
        sh.state, sh.finished_at = ShardPhase.DONE, time.time()

    return update_shard(r, job_id, shard, done, owner=owner, release=True) is not None


def claim_requeue(r: redis.Redis, job_id: str, shard: int) -> bool:
    """One reaper re-sends a shard (for a lease's time)."""
    return bool(r.set(names.shard_requeue_key(job_id, shard), "1", nx=True, ex=timeouts.LEASE_TTL_S))

"""Races on what one owner holds in Redis (a shard's lease, a lane-pool claim, a GPU's gate), shard state
written by compare-and-set, the typed job hash, and the rule that the shared/store package is the only Redis client.

Expiry is simulated by deleting the key (or by reading a deadline from a later clock), never by sleeping,
so nothing here depends on timing. A Redis of its own (a real redis-server) per module: no worker runs."""
from __future__ import annotations

import ast
import time
from pathlib import Path

import pytest

from shared import names, store, timeouts
from shared.messages import FINAL_STATES, JobHash, JobSpec, ShardState

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def r(tmp_path_factory):
    from services.broker.server import EmbeddedRedis

    with EmbeddedRedis(tmp_path_factory.mktemp("redis")) as srv:
        yield store.connect(srv.url)


def _expire(r, key: str) -> None:
    """The key's TTL ran out (as Redis would drop it)."""
    r.delete(key)


# ---- shard leases --------------------------------------------------------------------------------------


def test_two_owners_of_one_lease_the_losers_release_and_renew_do_nothing(r):
    job = "two-owners"
    assert store.take_lease(r, job, 0, "a", ttl_s=30)
    assert not store.take_lease(r, job, 0, "b", ttl_s=30)
    assert not store.release_lease(r, job, 0, "b")
    assert not store.renew_lease(r, job, 0, "b")
    assert store.lease_owner(r, job, 0) == "a"
    assert store.release_lease(r, job, 0, "a")
    assert store.lease_owner(r, job, 0) is None


def test_an_expired_lease_retaken_by_another_owner_is_not_released_or_renewed_by_the_first(r):
    job = "retaken"
    key = names.shard_lease_key(job, 0)
    assert store.take_lease(r, job, 0, "a", ttl_s=30)
    _expire(r, key)
    assert store.take_lease(r, job, 0, "b", ttl_s=30)
    r.expire(key, 5)  # b's own TTL, so a renewal by a would show
    assert not store.renew_lease(r, job, 0, "a", ttl_s=1000)
    assert r.ttl(key) <= 5
    assert not store.release_lease(r, job, 0, "a")
    assert store.lease_owner(r, job, 0) == "b"


def _running(r, job: str, owner: str | None, state: str = "running") -> None:
    sh = ShardState(shard=0, task_ids=["t"], state=state, owner=owner)
    r.hset(names.job_shards_key(job), "0", sh.model_dump_json())


def test_a_lease_that_lapsed_unseen_is_taken_again_by_its_live_owner(r):
    job = "late-renewal"
    key = names.shard_lease_key(job, 0)
    _running(r, job, "a")
    assert store.take_lease(r, job, 0, "a", ttl_s=30)
    assert store.renew_lease_as(r, job, 0, "a") == 1
    _expire(r, key)  # the renewal thread was starved past the TTL; no reaper came
    assert store.renew_lease_as(r, job, 0, "a", ttl_s=30) == 2
    assert store.lease_owner(r, job, 0) == "a" and r.ttl(key) > 0


def test_a_lapsed_lease_is_lost_once_a_reaper_or_another_client_moved_the_shard(r):
    job = "late-renewal-lost"
    key = names.shard_lease_key(job, 0)
    _running(r, job, "a")
    assert store.take_lease(r, job, 0, "a", ttl_s=30)
    _expire(r, key)
    assert store.take_lease(r, job, 0, "reaper.x", ttl_s=30)  # the reaper holds it while it re-sends
    assert store.renew_lease_as(r, job, 0, "a") == 0
    store.release_lease(r, job, 0, "reaper.x")
    _running(r, job, None, state="pending")  # re-sent: the shard is nobody's
    assert not store.renew_lease(r, job, 0, "a")
    _running(r, job, "b")  # another client runs it now
    assert not store.renew_lease(r, job, 0, "a")
    assert store.lease_owner(r, job, 0) is None
    r.delete(names.job_shards_key(job))
    assert not store.renew_lease(r, job, 0, "a")  # no shard at all


class _RetakenAfterRead:
    """A connection on which the watched key expires and is retaken by `thief` right after this client
    reads it: the window of a read-then-delete release. An atomic release reads nothing client-side."""

    def __init__(self, r, key: str, take):
        self._r, self._key, self._take, self.retaken = r, key, take, False

    def __getattr__(self, name):
        return getattr(self._r, name)

    def _after_read(self, key, value):
        if key == self._key and not self.retaken:
            _expire(self._r, key)
            self.retaken = bool(self._take())
        return value

    def get(self, key):
        return self._after_read(key, self._r.get(key))

    def hget(self, key, field):
        return self._after_read(key, self._r.hget(key, field))


def test_a_lease_retaken_in_the_middle_of_a_release_survives_it(r):
    job = "mid-release"
    assert store.take_lease(r, job, 0, "a", ttl_s=30)
    conn = _RetakenAfterRead(r, names.shard_lease_key(job, 0), lambda: store.take_lease(r, job, 0, "b", ttl_s=30))
    store.release_lease(conn, job, 0, "a")
    assert not conn.retaken or store.lease_owner(r, job, 0) == "b"
    store.release_lease(r, job, 0, "b")


def test_a_gate_retaken_in_the_middle_of_a_release_survives_it(r):
    gpu = "racegat0"
    now = time.time()
    assert store.take_gpu_gate(r, gpu, "a", now, now + 30)
    conn = _RetakenAfterRead(r, names.gpu_gate_key(gpu), lambda: store.take_gpu_gate(r, gpu, "b", now, now + 30))
    store.release_gpu_gate(conn, gpu, "a")
    assert not conn.retaken or r.hget(names.gpu_gate_key(gpu), "holder") == b"b"
    store.release_gpu_gate(r, gpu, "b")


# ---- lane-pool claims ----------------------------------------------------------------------------------


def test_a_lane_claim_is_kept_and_released_only_by_its_holder(r):
    scope = "race-pool"
    key = names.lane_claim_key(scope, 0)
    r.delete(key)
    assert store.claim_slot(r, scope, 1, "a") == 0
    assert store.claim_slot(r, scope, 1, "b") is None
    assert store.refresh_claim(r, key, "a")
    _expire(r, key)
    assert store.claim_slot(r, scope, 1, "b") == 0  # a's claim lapsed; b took the slot
    assert not store.refresh_claim(r, key, "a")  # a does not take it back from b
    assert not store.release_claim(r, key, "a")
    assert r.get(key) == b"b"
    assert store.release_claim(r, key, "b") and r.get(key) is None


def test_a_restarted_replica_takes_back_its_own_claim_at_once(r):
    """A lane container restarted in place is `<hostname>.1` again: it must get its slot back at start,
    not be refused as if another replica held it until the claim's TTL lapses."""
    scope = "restart-pool"
    r.delete(*[names.lane_claim_key(scope, i) for i in range(3)])
    assert store.claim_slot(r, scope, 3, "c1.1") == 0
    assert store.claim_slot(r, scope, 3, "c2.1") == 1
    r.delete(names.lane_claim_key(scope, 0))  # slot 0 freed: the restarted c2 still takes its own slot 1
    r.expire(names.lane_claim_key(scope, 1), 3)
    assert store.claim_slot(r, scope, 3, "c2.1") == 1
    assert r.ttl(names.lane_claim_key(scope, 1)) > 3  # taken back with a fresh TTL
    assert store.claim_slot(r, scope, 3, "c3.1") == 0
    assert store.claim_slot(r, scope, 3, "c4.1") == 2
    assert store.claim_slot(r, scope, 3, "c5.1") is None  # a pool held by others is still refused


# ---- GPU gates -----------------------------------------------------------------------------------------


def test_a_gate_is_released_only_by_its_holder(r):
    gpu = "racegat1"
    now = time.time()
    assert store.take_gpu_gate(r, gpu, "a", now, now + 30)
    assert not store.take_gpu_gate(r, gpu, "b", now, now + 30)
    assert not store.release_gpu_gate(r, gpu, "b")
    assert r.hget(names.gpu_gate_key(gpu), "holder") == b"a"
    # a overran its deadline: seen from after it, the gate is free, and b takes it
    assert store.take_gpu_gate(r, gpu, "b", now + 60, now + 90)
    assert not store.release_gpu_gate(r, gpu, "a")
    assert r.hget(names.gpu_gate_key(gpu), "holder") == b"b"
    assert store.release_gpu_gate(r, gpu, "b")
    assert not r.exists(names.gpu_gate_key(gpu))


def test_a_suspect_whose_gate_was_retaken_leaves_it_to_the_new_holder(r):
    from services.measurer.isolation import GpuGate

    gpu = "racegat2"
    with GpuGate(r, gpu, "suspect-a", hold_s=30, poll_s=0.001).alone():
        # a stalled past its deadline; another suspect takes the lapsed gate
        assert store.take_gpu_gate(r, gpu, "suspect-b", time.time() + 120, time.time() + 150)
    assert r.hget(names.gpu_gate_key(gpu), "holder") == b"suspect-b"
    assert "suspect-a" not in store.gpu_running(r, gpu)
    store.release_gpu_gate(r, gpu, "suspect-b")


# ---- shard state: compare-and-set, done only under the lease ----------------------------------------------


def _job(r, job_id: str, *shards: ShardState) -> None:
    r.delete(names.job_shards_key(job_id), names.job_budget_key(job_id), names.job_claims_key(job_id))
    for i in range(len(shards)):
        r.delete(names.shard_lease_key(job_id, i), names.shard_requeue_key(job_id, i))
    store.put_shards(r, job_id, list(shards), 10)
    r.hset(names.job_key(job_id), mapping={"state": "tuning"})


def test_reaper_and_client_racing_on_a_shard_the_cas_loser_does_not_overwrite(r):
    job = "cas-race"
    _job(r, job, ShardState(shard=0, task_ids=["a"], state="running", owner="c1"))
    assert store.take_lease(r, job, 0, "c1")

    def requeue(sh):  # a writer without the lease that read "running" ...
        # ... while the client, which holds the lease, finishes the shard in between
        assert store.finish_shard(r, job, 0, "c1")
        sh.state, sh.owner = "pending", None

    assert store.update_shard(r, job, 0, requeue, attempts=1) is None
    after = store.shards(r, job)[0]
    assert after.state == "done" and after.owner == "c1"
    r.srem(names.ACTIVE_JOBS_KEY, job)


def test_a_cas_conflict_is_retried_on_the_newer_state(r):
    job = "cas-retry"
    _job(r, job, ShardState(shard=0, task_ids=["a"]))
    assert store.take_lease(r, job, 0, "c1")
    seen = []

    def running(sh):
        seen.append(sh.attempts)
        if len(seen) == 1:  # someone else writes first: attempts 0 -> 5
            store.update_shard(r, job, 0, lambda other: setattr(other, "attempts", 5), owner="c1")
        sh.state, sh.attempts = "running", sh.attempts + 1

    written = store.update_shard(r, job, 0, running, owner="c1")
    assert seen == [0, 5] and written is not None and written.attempts == 6
    assert store.shards(r, job)[0].attempts == 6
    r.srem(names.ACTIVE_JOBS_KEY, job)


def test_done_is_refused_without_the_lease(r):
    job = "done-lease"
    _job(r, job, ShardState(shard=0, task_ids=["a"], state="running", owner="c1"))
    assert not store.finish_shard(r, job, 0, "c1")  # no lease at all
    assert store.take_lease(r, job, 0, "c2")  # c1's lease lapsed; c2 resumed the shard
    assert not store.finish_shard(r, job, 0, "c1")
    sh = store.shards(r, job)[0]
    assert sh.state == "running" and sh.finished_at is None
    assert store.lease_owner(r, job, 0) == "c2"
    assert store.finish_shard(r, job, 0, "c2")  # the holder: done, and its lease released at once
    assert store.shards(r, job)[0].state == "done" and store.lease_owner(r, job, 0) is None
    r.srem(names.ACTIVE_JOBS_KEY, job)


def test_the_reaper_leaves_a_shard_its_client_finished_while_the_reaper_looked(r, monkeypatch):
    from services.tuner import reaper

    job = "reap-race"
    _job(r, job, ShardState(shard=0, task_ids=["a"], state="running", owner="c1"),
         ShardState(shard=1, task_ids=["b"], state="running", owner="c2"))
    take = store.take_lease

    def late_take(conn, job_id, shard, owner, ttl_s=timeouts.LEASE_TTL_S):
        if job_id == job and shard == 0 and owner.startswith("reaper"):
            # between the reaper's read ("running", no lease) and its lease: the client comes back,
            # finishes the shard and releases its lease
            assert take(conn, job_id, 0, "c1") and store.finish_shard(conn, job_id, 0, "c1")
        return take(conn, job_id, shard, owner, ttl_s)

    monkeypatch.setattr(store, "take_lease", late_take)
    sent = []
    reaper.reap(r, sent.append, lambda job_id: None)
    assert [s.shard for s in sent if s.job_id == job] == [1]  # shard 1's client is dead; shard 0 is done
    after = store.shards(r, job)
    assert after[0].state == "done" and after[1].state == "pending"
    assert store.lease_owner(r, job, 0) is None and store.lease_owner(r, job, 1) is None
    r.srem(names.ACTIVE_JOBS_KEY, job)


# ---- plans: a planner that dies mid-plan costs seconds, and its message, back an hour later, is dropped ----


def test_a_plan_no_planner_holds_is_sent_again_and_the_old_message_is_dropped(r):
    from services.tuner import reaper

    job, later = "plan-orphan", time.time() + 10 * timeouts.STRANDED_PLAN_S
    store.create_job(r, JobSpec(job_id=job, target="llvm", trials=8), b"{}")
    store.plan_sent(r, job, "first")
    store.set_state(r, job, "planning")
    sent = []
    assert store.take_plan_lease(r, job, "planner-a")  # planning: its lease is renewed while it works
    assert reaper.reap_plans(r, sent.append, later) == [] and sent == []
    assert not store.take_plan_lease(r, job, "planner-b")  # a second message of the job waits its turn

    _expire(r, names.plan_lease_key(job))  # planner-a was killed: its lease lapses
    r.rpush(names.PLAN_QUEUE, "a message nobody took yet")
    assert reaper.reap_plans(r, sent.append, later) == []  # what waits in the queue goes first
    r.delete(names.PLAN_QUEUE)
    assert reaper.reap_plans(r, sent.append, later) and [s.job_id for s in sent] == [job]
    new = sent[0].plan
    assert new != "first" and store.plan_current(r, job, new) and not store.plan_current(r, job, "first")
    assert reaper.reap_plans(r, sent.append, later + 1) == []  # just sent: not stranded again at once
    assert store.plan_current(r, job, None)  # a message of an older client (no token) is not judged

    store.set_state(r, job, "planned")
    assert reaper.reap_plans(r, sent.append, later + 100) == [] and job not in store.planning_jobs(r)
    assert len(sent) == 1


def test_a_lane_drops_a_batch_that_comes_back_after_it_was_started_or_its_job_ended(r):
    from services.measurer.worker import redelivered
    from shared.messages import MeasureBatch

    store.create_job(r, JobSpec(job_id="redeliver", target="llvm", trials=8), b"{}")
    batch = MeasureBatch(batch_id="b-redeliver", job_id="redeliver", target="{}", candidates=[])
    assert redelivered(r, batch) is None  # first delivery
    store.mark_batch_started(r, batch.batch_id, "measure.cpu.c0", "w1", "redeliver", 0)
    assert "redelivery" in redelivered(r, batch)
    other = batch.model_copy(update={"batch_id": "b-redeliver-2"})
    store.set_state(r, "redeliver", "done")
    assert redelivered(r, other) == "its job is done"
    assert redelivered(r, other.model_copy(update={"job_id": "no-such-job"})) is None


# ---- the typed job hash ----------------------------------------------------------------------------------


def test_the_job_hash_is_typed_on_read_and_checked_on_write(r):
    spec = JobSpec(job_id="typed-job", target="llvm", trials=8)
    r.delete(names.job_key(spec.job_id), names.job_cancel_key(spec.job_id))
    store.create_job(r, spec, b"model")
    assert store.set_state(r, spec.job_id, "planned", target_json='{"kind": "llvm"}', lanes=["measure.cpu.c0"],
                           clients=2)
    job = store.job_hash(r, spec.job_id)
    assert job.state == "planned" and job.spec == spec and job.lanes == ["measure.cpu.c0"] and job.clients == 2
    assert isinstance(job.planned_at, float)
    flat = store.job_state(r, spec.job_id)  # the client's plain view: the strings the hash holds
    assert flat["state"] == "planned" and flat["clients"] == "2" and flat["lanes"] == '["measure.cpu.c0"]'
    with pytest.raises(ValueError):
        store.set_state(r, spec.job_id, "tuning", no_such_field="x")
    with pytest.raises(ValueError):
        store.set_state(r, spec.job_id, "no-such-state")
    assert store.job_hash(r, spec.job_id).state == "planned"  # a refused write writes nothing
    store.set_state(r, spec.job_id, "done")
    assert store.cancel_job(r, spec.job_id) == "done"  # a final state is kept (the script's FINAL_STATES)
    assert set(FINAL_STATES) == {"done", "failed", "cancelled"}
    raw = {k.decode(): v.decode() for k, v in r.hgetall(names.job_key(spec.job_id)).items()}
    assert JobHash.from_redis(raw).to_redis() == raw  # parse and dump are each other's inverse


# ---- the shared/store package is the only Redis client-----------------------------------------------------------

# Redis commands (redis-py method names) a module outside the store might call
REDIS_METHODS = frozenset("""
get set getset getdel getex setnx setex psetex mget mset msetnx delete unlink exists expire pexpire expireat persist
ttl pttl type rename incr incrby incrbyfloat decr decrby append strlen
hget hset hsetnx hmget hmset hgetall hkeys hvals hlen hexists hdel hincrby hincrbyfloat hscan hscan_iter
lpush rpush lpop rpop blpop brpop lrange llen ltrim lrem lindex lset lmove blmove
sadd srem smembers sismember scard spop srandmember sscan sscan_iter
zadd zrem zrange zrevrange zrangebyscore zrevrangebyscore zcard zscore zincrby zpopmin zpopmax zscan zscan_iter
scan scan_iter keys eval evalsha register_script script_load pipeline transaction execute watch multi
publish subscribe lock ping info flushdb flushall xadd xread
""".split())

# How the code names a Redis connection or pipeline: these receivers, and calls that make one
CONNECTION_NAMES = frozenset({"r", "redis", "_redis", "conn", "store_conn", "p", "pipe", "pipeline"})
CONNECTION_ATTRS = frozenset({"redis", "r", "conn", "_redis"})  # self.redis, STATE.redis, self.client.redis
CONNECTION_CALLS = frozenset({"redis", "connect", "from_url", "Redis", "StrictRedis", "pipeline"})


def _is_connection(node: ast.expr) -> bool:
    if isinstance(node, ast.Name):
        return node.id in CONNECTION_NAMES
    if isinstance(node, ast.Attribute):
        return node.attr in CONNECTION_ATTRS
    if isinstance(node, ast.Call):
        f = node.func
        return (f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None) in CONNECTION_CALLS
    return False


def direct_redis_calls(root: Path = REPO) -> list[str]:
    """file:line of every call `X.method(...)` outside the shared/store package where `method` is a Redis command
    (REDIS_METHODS) and `X` names a connection the way this code does: a variable `r`, `redis`, `conn`,
    `p`/`pipe` (pipelines) ..., an attribute `.redis`/`.r`/`.conn` (self.redis, STATE.redis), or a call
    that makes one (`redis()`, `store.connect(url)`, `Redis.from_url(url)`, `r.pipeline()`); and every
    import of the redis package (a module that needs a connection takes one from the store). Receivers
    are matched by name, not by type, so `dict.get`, `os.environ.get` or `event.set` never match; a new
    name for a connection must be added here (keep to these names instead)."""
    hits = []
    for top in ("services", "sharetune", "shared"):
        for path in sorted((root / top).rglob("*.py")):
            if root / "shared" / "store" in path.parents:
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                imported = ([a.name for a in node.names] if isinstance(node, ast.Import)
                            else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                if any(m == "redis" or m.startswith("redis.") for m in imported):
                    hits.append(f"{path.relative_to(root)}:{node.lineno}: import of redis")
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and node.func.attr in REDIS_METHODS and _is_connection(node.func.value)):
                    hits.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node.func)}(...)")
    return hits


def test_no_direct_redis_call_outside_the_store():
    hits = direct_redis_calls()
    assert not hits, "Redis called outside the shared/store package (add a function there):\n" + "\n".join(hits)


def test_the_scan_finds_the_forms_the_code_uses(tmp_path):
    (tmp_path / "shared" / "store").mkdir(parents=True)
    (tmp_path / "services").mkdir()
    (tmp_path / "sharetune").mkdir()
    (tmp_path / "shared" / "store" / "jobs.py").write_text("r.set('k', 1)\n")  # the store may
    (tmp_path / "services" / "bad.py").write_text(
        "r.hget('k', 'f')\nself.redis.set('k', 1)\nredis().delete('k')\nstore.connect(u).scan_iter()\n"
        "with r.pipeline() as p:\n    p.hset('k', 'f', 1)\n"
        "os.environ.get('X')\nd.get('k')\nevent.set()\nr.diagonal_wins.get('k')\nimport redis.client\n")
    assert sorted(h.split(": ")[0] for h in direct_redis_calls(tmp_path)) == [
        "services/bad.py:1", "services/bad.py:11", "services/bad.py:2", "services/bad.py:3", "services/bad.py:4",
        "services/bad.py:5", "services/bad.py:6"]

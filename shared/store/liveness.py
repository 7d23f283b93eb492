"""Who is alive: lanes, builders and tuner clients (liveness keys with a TTL), queue lengths, GPUs given up."""
from __future__ import annotations

import json
import time

import redis

from shared import lanes, names, timeouts
from shared.messages import AgentInfo, BuilderInfo, LaneInfo
from shared.store._redis import _s
from shared.store.jobs import update_job
from shared.store.results import lane_batches
from shared.timeouts import RESULT_TTL_S


# ---- lanes, builders and tuner clients (liveness keys), queues ------------------------------------------------


def announce_lane(r: redis.Redis, info: LaneInfo) -> None:
    r.set(names.lane_key(info.queue, info.worker), info.model_dump_json(), ex=timeouts.LANE_TTL_S)


def retire_lane(r: redis.Redis, info: LaneInfo) -> None:
    r.delete(names.lane_key(info.queue, info.worker))


def _live(r: redis.Redis, pattern: str, contract):
    """Every live key matching the pattern, parsed (a key that expired between the scan and the read is skipped)."""
    out = []
    for key in r.scan_iter(match=pattern, count=500):
        raw = r.get(key)
        if raw:
            out.append(contract.parse(raw))
    return out


def live_lanes(r: redis.Redis) -> list[LaneInfo]:
    return sorted(_live(r, names.LANES_PATTERN, LaneInfo), key=lambda l: l.queue)


def lane_alive(r: redis.Redis, queue: str) -> bool:
    """True while at least one worker of the lane keeps its liveness key."""
    return next(iter(r.scan_iter(match=names.lane_key(queue), count=500)), None) is not None


def server_boot(r: redis.Redis) -> str | None:
    """Which start of the Redis server answers (its run_id, new at every start; None: not answered): a message
    sent before a restart may be lost with the writes its AOF had not synced, or held unacknowledged by a consumer
    that lost its connection, for the visibility timeout."""
    try:
        return str(r.info("server").get("run_id")) or None
    except redis.RedisError:
        return None


def lane_worker_alive(r: redis.Redis, queue: str, worker: str) -> bool:
    """True while this worker of the lane keeps its liveness key."""
    return bool(r.exists(names.lane_key(queue, worker)))


def builder_alive(r: redis.Redis, alive_key: str) -> bool:
    """True while the builder whose liveness key this is keeps it (names.builder_key)."""
    return bool(r.exists(alive_key))


def announce_builder(r: redis.Redis, info: BuilderInfo) -> None:
    r.set(names.builder_key(info.family, info.worker), info.model_dump_json(), ex=timeouts.LANE_TTL_S)


def retire_builder(r: redis.Redis, info: BuilderInfo) -> None:
    r.delete(names.builder_key(info.family, info.worker))


def live_builders(r: redis.Redis, family: str | None = None) -> list[BuilderInfo]:
    out = _live(r, names.builder_key(family) if family else names.BUILDERS_PATTERN, BuilderInfo)
    return sorted(out, key=lambda b: (b.family, b.worker))


def announce_agent(r: redis.Redis, info: AgentInfo) -> None:
    r.set(names.agent_key(info.worker), info.model_dump_json(), ex=timeouts.LANE_TTL_S)


def retire_agent(r: redis.Redis, info: AgentInfo) -> None:
    r.delete(names.agent_key(info.worker))


def live_agents(r: redis.Redis) -> list[AgentInfo]:
    return sorted(_live(r, names.AGENTS_PATTERN, AgentInfo), key=lambda a: a.worker)


def forget_worker(r: redis.Redis, worker: str) -> list[str]:
    """A lane's or builder's liveness keys, deleted once the process is known dead (its supervisor saw it exit):
    whoever waits on it (a tuner with a batch there) learns it at once instead of after the key's TTL."""
    keys = [k for pattern in (names.lane_key("*", worker), names.builder_key("*", worker))
            for k in r.scan_iter(match=pattern, count=1000)]
    if keys:
        r.delete(*keys)
    return [_s(k) for k in keys]


def mark_batch_building(r: redis.Redis, batch_id: str, worker: str, alive_key: str, forwarded: bool = False) -> None:
    """A builder took the batch (its liveness key says whether it still lives), or forwarded it to its lane."""
    key = names.batch_results_key(batch_id)
    building = {"at": time.time(), "worker": worker, "alive_key": alive_key, "forwarded": forwarded}
    with r.pipeline() as p:
        p.hset(key, "_building", json.dumps(building))
        p.expire(key, RESULT_TTL_S)
        p.execute()


def host_liveness_key(r: redis.Redis, host: str) -> str | None:
    """A liveness key of a worker of `host` (worker ids are host.pid): a node agent's, a lane's, a builder's, a
    warm tuner client's, a planner's or an updater's; None when no worker of that host keeps one."""
    for pattern in (names.agent_key(f"{host}.*"), names.lane_key("*", f"{host}.*"), names.builder_key("*", f"{host}.*"),
                    names.tuner_key(f"{host}.*"), names.service_key("*", f"{host}.*")):
        key = next(iter(r.scan_iter(match=pattern, count=1000)), None)
        if key is not None:
            return _s(key)
    return None


def announce_tuner(r: redis.Redis, worker: str) -> None:
    r.set(names.tuner_key(worker), "ready", ex=timeouts.LANE_TTL_S)


def retire_tuner(r: redis.Redis, worker: str) -> None:
    r.delete(names.tuner_key(worker))


def announce_service(r: redis.Redis, role: str, worker: str) -> None:
    r.set(names.service_key(role, worker), "ready", ex=timeouts.LANE_TTL_S)


def retire_service(r: redis.Redis, role: str, worker: str) -> None:
    r.delete(names.service_key(role, worker))


def live_services(r: redis.Redis, role: str) -> list[str]:
    """The workers of `role` (planner, updater) that keep their liveness key."""
    return sorted(_s(k).rsplit(":", 1)[-1] for k in r.scan_iter(match=names.service_key(role), count=500))


def live_tuners(r: redis.Redis) -> int:
    """How many tuner clients keep their liveness key."""
    return sum(1 for _ in r.scan_iter(match=names.TUNERS_PATTERN, count=500))


def queue_length(r: redis.Redis, queue: str) -> int:
    """Messages waiting in a Celery queue (its Redis list), not counting those a worker has taken."""
    return int(r.llen(queue))


# ---- GPUs given up ---------------------------------------------------------------------------------------


def give_up_gpu(r: redis.Redis, gpu8: str, error: str, lanes: list[str]) -> list[str]:
    """Record that the supervisor stopped recovering a GPU, and write the error to every active job that
    planned or ran lanes of it (its status shows it; the job may still finish on other GPUs' lanes).
    Returns those jobs' ids."""
    entry = {"gpu8": gpu8, "error": error, "lanes": sorted(set(lanes)), "at": time.time()}
    r.hset(names.GPUS_DOWN_KEY, gpu8, json.dumps(entry))
    hit = []
    for raw in r.smembers(names.ACTIVE_JOBS_KEY):
        job_id = _s(raw)
        planned_lanes = json.loads(_s(r.hget(names.job_key(job_id), "lanes")) or "[]")
        used = set(planned_lanes) | {b.lane for b in lane_batches(r, job_id)}
        if any(_lane_gpu(q) == gpu8 for q in used):
            update_job(r, job_id, gpu_error=error, updated_at=time.time())
            hit.append(job_id)
    return sorted(hit)


def gpus_down(r: redis.Redis) -> dict[str, dict]:
    """gpu8 -> {gpu8, error, lanes, at} for every GPU the supervisor gave up."""
    return {_s(k): json.loads(v) for k, v in r.hgetall(names.GPUS_DOWN_KEY).items()}


def _lane_gpu(queue: str) -> str | None:
    return lanes.fault_domain(queue)  # here, where give_up_gpu's argument `lanes` hides the module

"""Every queue name and Redis key of the system, in one place (arq's lesson).

A lane is one unit of spatial share: a GPU at an MPS percentage, or a set of CPU cores. Each lane has
its own Celery queue, so a measurement sent to a lane runs only under that lane's share.
"""
from __future__ import annotations

import re

PREFIX = "st"

# Celery queues of the services other than the lanes.
PLAN_QUEUE = "plan"
TUNE_QUEUE = "tune"
COSTMODEL_QUEUE = "costmodel"

# Celery task names: the planner and tuner send work by name and never import measurer code.
PLAN_TASK = "sharetune.plan_job"
TUNE_TASK = "sharetune.tune_shard"  # one message per shard of a job
FINISH_TASK = "sharetune.finish_job"  # sent once every shard is done: re-time, compile, result
MEASURE_TASK = "sharetune.measure_batch"
BUILD_TASK = "sharetune.build_batch"  # to a build.<family> queue: build, then forward to the lane
INGEST_TASK = "sharetune.ingest_results"


_GPU_LANE = re.compile(r"^measure\.(?P<gpu>[0-9a-f]{8})\.p(?P<pct>\d{1,3})$")
_CPU_LANE = re.compile(r"^measure\.cpu\.(?:(?P<node>[a-z0-9][a-z0-9_-]*)\.p(?P<pct>\d{1,3})\.)?"
                       r"c(?P<first>\d+)(?:-(?P<last>\d+))?$")
_NODE = re.compile(r"^[a-z0-9][a-z0-9_-]*$")


def gpu_lane_queue(gpu8: str, percent: int) -> str:
    """A GPU lane's queue: the GPU (first 8 hex digits of its UUID) and the MPS percentage."""
    return f"measure.{gpu8}.p{percent}"


def cpu_lane_queue(node: str, share: int, cores: tuple[int, ...]) -> str:
    """A CPU lane's queue: the node, the share and the cores. Cores alone would not do: the same cores are
    a different share on a host with another core count, and a queue must mean one share."""
    if not _NODE.match(node):
        raise ValueError(f"not a node name: {node!r} (lower-case letters, digits, '-' and '_')")
    first, last = cores[0], cores[-1]
    span = f"c{first}" if first == last else f"c{first}-{last}"
    return f"measure.cpu.{node}.p{share}.{span}"


def parse_gpu_lane_queue(queue: str) -> tuple[str, int] | None:
    """(gpu8, percent) of a GPU lane queue, else None."""
    m = _GPU_LANE.match(queue)
    return (m["gpu"], int(m["pct"])) if m else None


def parse_cpu_lane_queue(queue: str) -> tuple[str | None, int | None, tuple[int, ...]] | None:
    """(node, share, cores) of a CPU lane queue, else None. The short form `measure.cpu.c0-1` (what an
    operator types: cores of the host it runs on) has no node and no share: None for both."""
    m = _CPU_LANE.match(queue)
    if not m:
        return None
    first = int(m["first"])
    last = int(m["last"]) if m["last"] is not None else first
    return m["node"], int(m["pct"]) if m["pct"] else None, tuple(range(first, last + 1)) if last >= first else ()


def lane_key(queue: str, worker: str = "*") -> str:
    """Liveness + description of one worker of a lane (JSON LaneInfo), with a TTL. Several workers
    (on one host or several) may serve the same lane queue; each has its own key."""
    return f"{PREFIX}:lane:{queue}:{worker}"


LANES_PATTERN = f"{PREFIX}:lane:*"


# ---- builders: stateless workers that build candidates for one target family ----------------------------
# A family is what a built artifact depends on: the target kind and its instruction set (CUDA arch, LLVM
# mcpu). A lane's candidates can be built by any builder of its family, on any host.

_FAMILY = re.compile(r"^(cuda\.sm_[0-9]+[a-z]?|llvm\.[a-z0-9_.+-]+)$")


def check_family(family: str) -> str:
    if not _FAMILY.match(family):
        raise ValueError(f"not a build family: {family!r} (e.g. cuda.sm_90, llvm.znver3)")
    return family


def build_queue(family: str) -> str:
    return f"build.{check_family(family)}"


def builder_key(family: str, worker: str = "*") -> str:
    """Liveness + description of one builder worker (JSON BuilderInfo), with a TTL."""
    return f"{PREFIX}:builder:{family}:{worker}"


BUILDERS_PATTERN = f"{PREFIX}:builder:*"


def agent_key(worker: str = "*") -> str:
    """Liveness + description of one node agent (JSON AgentInfo), with a TTL: the process that starts, watches
    and restarts one host's lanes and builders and recovers its GPUs."""
    return f"{PREFIX}:agent:{worker}"


AGENTS_PATTERN = f"{PREFIX}:agent:*"


def tuner_key(worker: str) -> str:
    """Liveness of a tuner client that has finished its warm-up, with a TTL."""
    return f"{PREFIX}:tuner:{worker}"


TUNERS_PATTERN = f"{PREFIX}:tuner:*"


def service_key(role: str, worker: str = "*") -> str:
    """Liveness of a planner or cost-model updater worker (`role`), with a TTL: what its container's health
    probe looks for (services.healthcheck)."""
    return f"{PREFIX}:service:{role}:{worker}"


def job_key(job_id: str) -> str:
    """Hash: spec, status, error, timestamps, result."""
    return f"{PREFIX}:job:{job_id}"


def job_model_key(job_id: str) -> str:
    return f"{PREFIX}:job:{job_id}:model"


def job_tasks_key(job_id: str) -> str:
    """Hash task_id -> JobTask JSON (name, weight, workload key)."""
    return f"{PREFIX}:job:{job_id}:tasks"


def job_progress_key(job_id: str) -> str:
    """Hash task_id -> TaskProgress JSON."""
    return f"{PREFIX}:job:{job_id}:progress"


def job_cancel_key(job_id: str) -> str:
    """Set (no TTL) when a user cancels a job; the tuner stops between rounds, lanes skip its batches."""
    return f"{PREFIX}:job:{job_id}:cancel"


def job_batches_key(job_id: str) -> str:
    """List of LaneBatch JSON: which lane worker measured which batch of the job, and when (reports)."""
    return f"{PREFIX}:job:{job_id}:batches"


def lane_claim_key(scope: str, slot: int) -> str:
    """A measurer replica's claim on slot `slot` of a lane pool (docker compose --scale), with a TTL."""
    return f"{PREFIX}:claim:{scope}:{slot}"


JOBS_KEY = f"{PREFIX}:jobs"  # sorted set of job ids by submit time
ACTIVE_JOBS_KEY = f"{PREFIX}:jobs:active"  # set of job ids whose shards are being tuned (the reaper's list)
PLANNING_JOBS_KEY = f"{PREFIX}:jobs:planning"  # set of job ids not planned yet (the reaper's other list)


def job_plan_key(job_id: str) -> str:
    """The job's current plan message (its token: an older message is a late duplicate) and when it was sent."""
    return f"{PREFIX}:job:{job_id}:plan"


def plan_lease_key(job_id: str) -> str:
    """The planner planning the job now (with a TTL its heartbeat renews)."""
    return f"{PREFIX}:job:{job_id}:plan:lease"


def job_shards_key(job_id: str) -> str:
    """Hash shard number -> ShardState JSON (its tasks, state, owner)."""
    return f"{PREFIX}:job:{job_id}:shards"


def shard_lease_key(job_id: str, shard: int) -> str:
    """The tuner client that holds a shard (its worker id), with a TTL its heartbeat renews."""
    return f"{PREFIX}:job:{job_id}:shard:{shard}:lease"


def shard_requeue_key(job_id: str, shard: int) -> str:
    """Short-lived guard so that one reaper, not every tuner, re-sends a stranded shard."""
    return f"{PREFIX}:job:{job_id}:shard:{shard}:requeue"


def job_budget_key(job_id: str) -> str:
    """Trials the job may still claim (job-wide, across shards); claimed atomically per round."""
    return f"{PREFIX}:job:{job_id}:budget"


def job_claims_key(job_id: str) -> str:
    """Hash shard -> trials claimed and not yet recorded (refunded when a dead client's shard is reaped)."""
    return f"{PREFIX}:job:{job_id}:claims"


def job_measured_recently_key(job_id: str) -> str:
    """Hash {v, t}: the job's trials recorded, each halved every half-life (store.measured_by_job), as of t."""
    return f"{PREFIX}:job:{job_id}:measured-recently"


def job_history_key(job_id: str) -> str:
    """Hash task_id -> JSON list of the task's best latency (s) after each of its rounds: the input of
    the job-wide gradient, read by every shard's client."""
    return f"{PREFIX}:job:{job_id}:history"


def job_searched_key(job_id: str) -> str:
    """Hash task_id -> the best latency (s) of the task's searched candidates alone, its default schedule aside
    (the history counts the default too): how far a task's search is from its default."""
    return f"{PREFIX}:job:{job_id}:searched"


def job_finish_key(job_id: str) -> str:
    """Guard so that the finishing step (re-time, compile) is sent once, by the last shard's client."""
    return f"{PREFIX}:job:{job_id}:finish"


def job_splits_key(job_id: str) -> str:
    """Hash shard -> JSON of where that shard's client spent its time (search, wait, build...)."""
    return f"{PREFIX}:job:{job_id}:splits"


def job_recorded_elsewhere_key(job_id: str) -> str:
    """Trials the job measured whose candidate another job had recorded first (the store keeps a candidate's
    first record): spent and recorded, under the other job's id."""
    return f"{PREFIX}:job:{job_id}:recorded_elsewhere"


def job_first_rounds_key(job_id: str) -> str:
    """Set of the task ids whose first round some client has claimed trials for (the first-round reserve leaves
    nothing more for them)."""
    return f"{PREFIX}:job:{job_id}:first_rounds"


def job_transient_keys(job_id: str) -> list[str]:
    """What only a running job needs: its model, plan, budget, claims, first rounds claimed, gradient history (and
    searched bests), finish guard, time splits and cancel flag: the model above all is tens of MB. They expire shared.timeouts.ENDED_JOB_STATE_TTL_S
    after the job ends; its status, tasks, progress, shards, batches and result stay."""
    return [job_model_key(job_id), job_plan_key(job_id), plan_lease_key(job_id), job_budget_key(job_id),
            job_claims_key(job_id), job_measured_recently_key(job_id), job_history_key(job_id),
            job_searched_key(job_id), job_finish_key(job_id), job_splits_key(job_id),
            job_cancel_key(job_id), job_recorded_elsewhere_key(job_id), job_first_rounds_key(job_id)]


def job_resends_key(job_id: str) -> str:
    """List of the job's re-sent batches, JSON {at, batch, to, kind, why}, the newest RESENDS_KEPT."""
    return f"{PREFIX}:job:{job_id}:resends"


def job_resend_counts_key(job_id: str) -> str:
    """Hash re-send kind -> how many batches were sent again for it (every one, not only the kept)."""
    return f"{PREFIX}:job:{job_id}:resend_counts"


def job_keys(job_id: str) -> list[str]:
    """Every key of a job (shard leases and re-queue guards aside: they lapse by their TTL). `prune` deletes
    them; the workloads' records and defaults are the tuning knowledge and stay."""
    return [job_key(job_id), job_tasks_key(job_id), job_progress_key(job_id), job_batches_key(job_id),
            job_shards_key(job_id), job_resends_key(job_id), job_resend_counts_key(job_id)] + job_transient_keys(job_id)


def reference_key(wkey: str) -> str:
    """A workload's default-scheduled module (packed TVM JSON): what the lanes check a candidate's output against."""
    return f"{PREFIX}:ref:{wkey}"


def workload_key(wkey: str) -> str:
    """One tuning workload (a task's IRModule at a target and share): packed TVM JSON + metadata."""
    return f"{PREFIX}:wl:{wkey}"


def records_key(wkey: str) -> str:
    """Hash candidate_key -> Record JSON: every measured candidate of a workload (idempotent)."""
    return f"{PREFIX}:rec:{wkey}"


def similar_key(target_kind: str, op: str) -> str:
    """Hash workload key -> WorkloadShape JSON: the workloads of one operator kind on one target kind that have
    valid records (where a new task's warm seeds come from: services.tuner.similarity)."""
    return f"{PREFIX}:similar:{target_kind}:{op}"


def default_key(wkey: str) -> str:
    """A workload's default schedule as measured on a lane (DefaultTiming JSON): what a task runs untuned."""
    return f"{PREFIX}:default:{wkey}"


def live_best_key(bar_key: str) -> str:
    """A task's best fully timed seconds so far in a job, kept by the lanes as they time its candidates (the
    screening bar of candidates already sent tightens with it)."""
    return f"{PREFIX}:livebest:{bar_key}"


def batch_results_key(batch_id: str) -> str:
    """Hash candidate_id -> MeasureResult JSON, written by the lane that measured the batch."""
    return f"{PREFIX}:batch:{batch_id}"


def training_rows_key(target_key: str) -> str:
    """List of cost-model training rows (JSON) for one target family."""
    return f"{PREFIX}:cm:rows:{target_key}"


def training_best_key(target_key: str) -> str:
    """Hash workload group -> JSON list of its fastest training rows, for one target family."""
    return training_rows_key(target_key) + ":best"


def snapshot_key(target_key: str) -> str:
    """Newest cost-model snapshot (JSON CostModelSnapshot) for one target family."""
    return f"{PREFIX}:cm:snap:{target_key}"


def snapshot_version_key(target_key: str) -> str:
    """Counter of a target family's snapshot versions."""
    return snapshot_key(target_key) + ":version"


DEADLETTER_KEY = f"{PREFIX}:deadletter"  # list of rejected messages, with why


# ---- poison candidates and device faults ---------------------------------------------------------------
# A candidate is named here by the hash of its scheduled module (candidate_hash in shared.store), so the
# same program sent again (another batch, another job, another lane) meets its history.

CRASHES_KEY = f"{PREFIX}:crashes"  # hash candidate hash -> times a process died (or hung) running it
QUARANTINE_KEY = f"{PREFIX}:quarantine"  # hash candidate hash -> Quarantined JSON: never run again


def gpu_faults_key(gpu8: str) -> str:
    """List of GpuFault JSON: lanes of one GPU that saw their CUDA context die (MPS takes all of them)."""
    return f"{PREFIX}:gpufault:{gpu8}"


def gpu_gate_key(gpu8: str) -> str:
    """Hash {holder, until}: the lane worker running a suspect candidate alone on this GPU."""
    return f"{PREFIX}:gpugate:{gpu8}"


def suspect_runs_key(gpu8: str) -> str:
    """Hash candidate hash -> times it ran alone on this GPU as a suspect (services.measurer.isolation)."""
    return f"{PREFIX}:gpususpects:{gpu8}"


def gpu_running_key(gpu8: str) -> str:
    """Hash worker -> deadline: lane workers of this GPU with a candidate running now."""
    return f"{PREFIX}:gpurunning:{gpu8}"


GPUS_DOWN_KEY = f"{PREFIX}:gpudown"  # hash gpu8 -> JSON {gpu8, error, lanes, at}: GPUs the supervisor gave up

EXIT_GPU_FAULT = 75  # a GPU lane exits with this code when its CUDA context is lost, to be restarted

"""The wire contracts: every message on a queue and every value in Redis is JSON validated by one of
these pydantic models. Never pickle. A message that fails validation is answered as data (an error
result, a failed job, a dead-letter entry), not by a lost message."""
from __future__ import annotations

import json
import time
from enum import StrEnum
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from shared import lanes, timeouts
from shared.errors import ShareError, TargetError
from shared.ids import worker_id

MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # larger payloads are refused before parsing
MAX_MODEL_BYTES = 64 * 1024 * 1024  # a submitted model (file, bytes, or its stored Relax form) beyond this is refused


class Contract(BaseModel):
    """Base of every message: unknown fields are an error, so a typo is caught at the boundary."""

    model_config = ConfigDict(extra="forbid", frozen=False)

    @classmethod
    def parse(cls, data: Any):
        """Validate a decoded dict, a JSON string or bytes; raise MessageError naming the contract."""
        from pydantic import ValidationError

        from shared.errors import MessageError

        if isinstance(data, (bytes, bytearray)):
            if len(data) > MAX_MESSAGE_BYTES:
                raise MessageError(f"{cls.__name__}: message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
            data = data.decode()
        try:
            if isinstance(data, str):
                if len(data) > MAX_MESSAGE_BYTES:
                    raise MessageError(f"{cls.__name__}: message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
                return cls.model_validate_json(data)
            return cls.model_validate(data)
        except ValidationError as err:
            raise MessageError(f"malformed {cls.__name__}: {_brief(err)}") from None
        except (ShareError, TargetError) as err:  # raised by validators, already clear
            raise MessageError(f"malformed {cls.__name__}: {err}") from None


def _brief(err) -> str:
    parts = []
    for e in err.errors()[:5]:
        loc = ".".join(str(p) for p in e.get("loc", ())) or "(message)"
        parts.append(f"{loc}: {e.get('msg')}")
    return "; ".join(parts)


def check_share(share: int) -> int:
    if not isinstance(share, int) or isinstance(share, bool) or not 1 <= share <= 100:
        raise ShareError(f"share must be a whole percentage in 1..100, got {share!r}")
    return share


def target_kind(target: str | dict) -> str:
    """The kind of a target given as a name ("llvm"), a dict, or a target's JSON text."""
    if isinstance(target, dict):
        kind = target.get("kind")
    elif isinstance(target, str):
        text = target.strip()
        kind = json.loads(text).get("kind") if text.startswith("{") else text.split()[0] if text else ""
    else:
        kind = None
    supported = lanes.target_kinds()
    if kind not in supported:
        raise TargetError(f"unknown target {target!r}: supported target kinds are {', '.join(supported)}")
    return kind


def lane_kind(target: str | dict) -> str:
    """Which kind of lane measures for a target (shared.lanes): cpu for llvm, gpu for cuda."""
    return lanes.for_target(target).name


# ---- jobs -------------------------------------------------------------------------------------------

# "full": the job's TimingConfig (number x repeat, min_repeat_ms floor); "brief": the screening window only
# (the candidate was not within its bar of the task's best, so it got no more lane time)
Timing = Literal["full", "brief"]
TimingPolicy = Literal["screen", "uniform"]


class JobState(StrEnum):
    """A job's state, in the order a job passes through them; the store and the HTTP API carry the values."""

    QUEUED = "queued"
    PLANNING = "planning"
    PLANNED = "planned"
    TUNING = "tuning"
    RETIMING = "retiming"
    COMPILING = "compiling"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


# the states a job never leaves: the one definition every service, the client and the store's scripts use
FINAL_STATES: tuple[JobState, ...] = (JobState.DONE, JobState.FAILED, JobState.CANCELLED)


class ShardPhase(StrEnum):
    """Where one shard of a job is: waiting for a client, searched by one (under its lease), or done."""

    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"


class JobOptions(Contract):
    """A job's options as its user gives them: the one declaration of their defaults, ranges and meaning.
    `Client.submit`'s keywords, the CLI's `submit` flags and the HTTP API's request body are made from it."""

    target: str = Field(default="llvm", description="a target kind (llvm, cuda) or a target's JSON")
    share: int | None = Field(default=None, description="percent of a device a lane of the job holds (CPU: of "
                              "the machine's cores); default: the share the live lanes of the target's kind agree on")
    trials: int = Field(default=64, ge=1, le=100_000, description="candidates measured in all")
    trials_per_iter: int = Field(default=16, ge=1, le=1024, description="candidates a task's round measures")
    max_trials_per_task: int | None = Field(default=None, ge=1, description="at most this many for one task")
    seed: int | None = Field(default=None, description="the search's random seed (default: a fresh one)")
    only_tasks: list[str] | None = Field(default=None, description="tune only the tasks with these names")
    retime_top_k: int = Field(default=0, ge=0, le=32, description="re-time each task's k best with neighbours idle")
    clients: int | None = Field(default=None, ge=1, le=256, description="tuner clients searching the job's tasks "
                                "at once (its shards); default: one per live client, never more than its tasks")
    cost_model: Literal["shared", "per_client"] = Field(
        default="shared", description="shared: the central updater's model of the target family; per_client: "
        "each shard trains its own")
    untuned_baseline: bool = Field(default=True, description="also compile the model untuned, to compare against")
    timing: TimingPolicy = Field(default="screen", description="screen: a candidate is timed briefly, fully only "
                                 "near its task's best; uniform: every candidate fully")
    wait_for_lanes: bool = Field(default=False, description="a share no live lane serves yet: wait for its lanes "
                                 "(until cancelled) instead of refusing")
    isolated: bool = Field(default=False, description="tune as on an empty store: its workloads, records, default "
                           "timings, warm seeds and cost model are its own, no other job's (replicates of a search)")
    rounds_ahead: int | None = Field(default=None, ge=0, le=2, description="while every task of a client is being "
                                     "measured, rounds a task may have searched and sent before its batch lands; "
                                     "default: the tuner's setting (SHARETUNE_ROUNDS_AHEAD)")
    time_limit_s: float | None = Field(default=None, gt=0, le=30 * 86400, description="stop searching this many "
                                       "seconds after tuning started; the rounds in flight are measured and the job "
                                       "finishes as one whose budget is spent (state done, result.stopped says why)")
    patience: int | None = Field(default=None, ge=1, le=100_000, description="stop once the model's estimated "
                                 "latency (each task's best times its weight, its default schedule where faster) "
                                 "has not improved by min_gain_pct in this many trials")
    min_gain_pct: float = Field(default=1.0, gt=0, lt=100, description="what counts as an improvement for "
                                "patience: the estimate this many percent below its value at the last one")
    name: str | None = Field(default=None, description="the job's name (default: the model's)")

    @field_validator("share")
    @classmethod
    def _share(cls, v):
        return v if v is None else check_share(v)

    @field_validator("target")
    @classmethod
    def _target(cls, v):
        target_kind(v)
        return v

    @classmethod
    def checked(cls, **fields) -> "JobOptions":
        """The options, validated once, before any work is done for them; SpecError names the field, its
        range and the value (a share out of range: ShareError)."""
        from pydantic import ValidationError

        from shared.errors import SpecError

        try:
            return cls.model_validate(fields)
        except ValidationError as err:
            parts = []
            for e in err.errors()[:5]:
                field = ".".join(str(p) for p in e.get("loc", ())) or "job"
                msg = e.get("msg", "").replace("Input should be", "must be")
                if e.get("type") == "extra_forbidden":
                    msg = f"is not a job option (options: {', '.join(cls.model_fields)})"
                parts.append(f"{_FLAGS.get(field, field)} {msg}, got {e.get('input')!r}")
            raise SpecError("; ".join(parts)) from None
        except TargetError as err:
            raise SpecError(str(err)) from None


class JobSpec(JobOptions):
    """A submitted job: its options resolved (the share, the name) and what the client measured of its model."""

    job_id: str
    name: str = "model"
    share: int = 100
    trials: int = Field(ge=1, le=100_000)
    # the model's inputs (shape, dtype), to time its compiled modules after its model left the store
    inputs: list[tuple[list[int], str]] | None = None
    submitted_at: float = Field(default_factory=time.time)


def cli_flag(option: str) -> str:
    """The CLI's flag of a JobOptions field: its name with dashes, except where the CLI spells it shorter."""
    return {"trials_per_iter": "--per-iter"}.get(option, "--" + option.replace("_", "-"))


# how an error names a job's numbers: the user's words and the CLI's flag
_FLAGS = {field: f"{words} ({cli_flag(field)})" for field, words in
          {"trials_per_iter": "trials per round", "clients": "clients", "trials": "trials",
           "retime_top_k": "retime top k"}.items()}


class JobRef(Contract):
    """The body of plan/tune requests: the job's state lives in Redis, the message only names it. `plan`:
    a plan message's token; one older than the job's current plan message is a late duplicate."""

    job_id: str
    plan: str | None = None


class ShardRef(Contract):
    """The body of a tune request: one shard of a job (the state lives in Redis)."""

    job_id: str
    shard: int = Field(ge=0)


class ShardState(Contract):
    """One tuner client's part of a job: its tasks, whether it is waiting, running (and whose), or done."""

    shard: int
    task_ids: list[str]
    state: ShardPhase = ShardPhase.PENDING
    owner: str | None = None  # worker id (host.pid) of the client running it
    attempts: int = 0  # how many times a client started it (more than one: it was resumed)
    refunded: int = 0  # trials a dead client had claimed but not recorded, handed back to the budget
    queued_at: float = Field(default_factory=time.time)
    started_at: float | None = None
    finished_at: float | None = None
    expected_cost: float = 0.0  # the balancing figure the planner used


class JobTask(Contract):
    task_id: str  # = workload key: one task per distinct workload at a target and share
    name: str
    weight: int
    wkey: str
    flops: float = 0.0


class TaskProgress(Contract):
    task_id: str
    name: str
    trials: int = 0
    errors: int = 0
    best_us: float | None = None
    reused_trials: int = 0  # records found in the store before this job (identical workloads)
    exhausted: bool = False  # its design space is spent (nothing new over several rounds), not its budget


class TaskBest(Contract):
    task_id: str
    name: str
    weight: int
    trials: int
    best_us: float | None
    best_candidate: str | None = None  # record key of the best candidate (st:rec:<wkey> field)
    best_lane: str | None = None
    default_us: float | None = None  # its default schedule on a lane (None: not measured, or it failed)
    applied: bool = True  # the tuned model runs its best record (False: the default was as fast or faster)


class TrialAccounting(Contract):
    """Where a job's trials went, as the store knows them. `claimed` from its budget (refunds handed back),
    `outstanding` claimed by a round not yet recorded, `recorded` its records (results and errors), `lost`
    claimed, settled and yet without a record (0 for a finished job), `reused` records found in the store
    from before the job; `resends` batches sent again to another lane or builder, by kind."""

    claimed: int
    outstanding: int
    recorded: int
    lost: int
    reused: int = 0
    resends: int = 0
    resend_kinds: dict[str, int] = {}


class JobResult(Contract):
    job_id: str
    tasks: list[TaskBest]
    trials: int
    tuned_module_path: str | None = None
    untuned_module_path: str | None = None
    database_dir: str | None = None
    target: str
    wall_s: float
    time_split_s: dict[str, float] = {}
    retime: dict[str, Any] = {}  # re-timing of the top-k: how many, mean and max shared-vs-isolated gap
    lanes: dict[str, Any] = {}  # each lane's own busy clock over the job (see lane_utilisation)
    # the job's valid records by the timing they got: {"full": n, "brief": m} (screened timing's saving)
    timings: dict[str, int] = {}
    # the spread of the full timings' repeats, (max - min) / median: {"timings": n, "p50": x, "p90": y} and the
    # same of kernels under 20 us as short_timings, short_p50, short_p90 (shared.ranking.spread_summary); wide
    # where a lane's timing loop was preempted
    timing_spread: dict[str, float] = {}
    accounting: TrialAccounting | None = None  # as it stood when the job finished
    stopped: str | None = None  # why the search ended before the budget (time_limit_s, patience)


class JobHash(BaseModel):
    """A job's hash in Redis (names.job_key), typed: every field as the store writes it. Redis keeps
    strings, so `from_redis` parses (JSON fields decoded, numbers validated) and `to_redis` dumps; a
    partial write goes through `dump_fields`, which refuses a field this model does not have."""

    # a field written by an older or newer version is ignored on read, so one stray field cannot make a
    # job unreadable; writes are checked by dump_fields
    model_config = ConfigDict(extra="ignore")

    state: JobState
    spec: JobSpec | None = None
    updated_at: float | None = None
    # when the job entered each state (set_state stamps "<state>_at"; ETAs and reports read them)
    queued_at: float | None = None
    planning_at: float | None = None
    planned_at: float | None = None
    tuning_at: float | None = None
    retiming_at: float | None = None
    compiling_at: float | None = None
    done_at: float | None = None
    failed_at: float | None = None
    cancelled_at: float | None = None
    error: str | None = None
    gpu_error: str | None = None  # a GPU the supervisor gave up, while the job goes on elsewhere
    target_json: str | None = None  # the exact target the planner resolved from the live lanes
    lanes: list[str] | None = None  # the lane queues the planner saw serving the job
    clients: int | None = None  # how many shards (tuner clients) the job was split into
    advice: str | None = None  # budget advice from the planner
    waiting_for: str | None = None  # parked: what the planner waits for
    parked_at: float | None = None
    result: JobResult | None = None
    latency_us: dict[str, Any] | None = None  # end-to-end latency, once the client timed it
    # the search stopped before its budget (store.stop_search): why, when, and the trials left unspent
    stopped: str | None = None
    stopped_at: float | None = None
    stopped_unspent: int | None = None
    # patience's mark: the estimated latency (s) at its last improvement and the job's trials then
    estimate_mark_s: float | None = None
    estimate_mark_trials: int | None = None
    # whether the central cost model ranks the job's first rounds (store.decide_ranked_first_rounds: the first
    # client's answer is every client's, so all size their first rounds alike)
    ranked_first_rounds: bool | None = None

    JSON_FIELDS: ClassVar[frozenset[str]] = frozenset({"spec", "result", "lanes", "latency_us"})

    @classmethod
    def from_redis(cls, raw: dict) -> "JobHash":
        data = {}
        for k, v in raw.items():
            k = k.decode() if isinstance(k, bytes) else k
            v = v.decode() if isinstance(v, bytes) else v
            data[k] = json.loads(v) if k in cls.JSON_FIELDS else v
        return cls.model_validate(data)

    @classmethod
    def dump_fields(cls, **fields) -> dict[Any, str]:  # Any: redis-py's mapping keys
        """Validate some of the fields and encode them as the hash stores them (None: not written)."""
        unknown = set(fields) - set(cls.model_fields)
        if unknown:
            raise ValueError(f"a job has no field {', '.join(sorted(unknown))}")
        out = {}
        for k, v in fields.items():
            if v is None:
                continue
            v = _job_field(k).validate_python(v)
            if isinstance(v, BaseModel):
                out[k] = v.model_dump_json()
            elif k in cls.JSON_FIELDS:
                out[k] = json.dumps(v)
            else:
                out[k] = str(v)
        return out

    def to_redis(self) -> dict[str, str]:
        return self.dump_fields(**{k: getattr(self, k) for k in type(self).model_fields})


_JOB_FIELDS: dict[str, Any] = {}


def _job_field(name: str):
    """A validator for one field of JobHash (built once per field)."""
    from pydantic import TypeAdapter

    if name not in _JOB_FIELDS:
        annotation = JobHash.model_fields[name].annotation
        assert annotation is not None  # every JobHash field is annotated
        _JOB_FIELDS[name] = TypeAdapter(annotation)
    return _JOB_FIELDS[name]

def lane_utilisation(batches: list["LaneBatch"], start: float | None = None, end: float | None = None) -> dict:
    """Each lane worker's busy clock over a job: seconds inside batches and that time as a fraction of the
    span (by default the job's first batch start to its last batch end): a lane's idle time is the rest."""
    if not batches:
        return {}
    start = min(b.started_at for b in batches) if start is None else start
    end = max(b.finished_at for b in batches) if end is None else end
    span = max(1e-9, end - start)
    busy: dict[str, float] = {}
    count: dict[str, int] = {}
    for b in batches:
        key = f"{b.lane}/{b.worker}"
        busy[key] = busy.get(key, 0.0) + max(0.0, min(b.finished_at, end) - max(b.started_at, start))
        count[key] = count.get(key, 0) + b.candidates
    per = {k: {"busy_s": round(v, 3), "busy_frac": round(v / span, 4), "candidates": count[k]} for k, v in busy.items()}
    return {"span_s": round(span, 3), "mean_busy_frac": round(sum(v / span for v in busy.values()) / len(busy), 4),
            "per_lane": per}


def measurement_shares(measured_at: dict[str, list[float]]) -> dict:
    """How several jobs at once shared the measurements, from when each job's trials were measured: the
    window in which all of them were measuring (the last job's first trial to the first job's last), each
    job's share of the trials measured in it, and `share_spread`, the largest relative departure of a job's
    share from an equal split (0: equal; 1: a job had none, or twice its part). None-valued when they never
    all measured at once. `per_10s`: each job's trials measured in each 10 s from the first job's first."""
    spans = {j: (min(ts), max(ts)) for j, ts in measured_at.items() if ts}
    t0 = min((s[0] for s in spans.values()), default=0.0)
    buckets = 1 + int((max(s[1] for s in spans.values()) - t0) // 10) if spans else 0
    out: dict = {"jobs": len(measured_at), "first_measured_at": {j: s[0] for j, s in spans.items()},
                 "window_s": None, "share": None, "share_spread": None,
                 "per_10s": {j: [sum(int((t - t0) // 10) == b for t in ts) for b in range(buckets)]
                             for j, ts in measured_at.items()}}
    lo, hi = (max(s[0] for s in spans.values()), min(s[1] for s in spans.values())) if spans else (0.0, 0.0)
    if len(spans) < len(measured_at) or hi <= lo:
        return out
    counts = {j: sum(lo <= t <= hi for t in ts) for j, ts in measured_at.items()}
    total = sum(counts.values())
    out.update(window_s=round(hi - lo, 2), share={j: round(c / total, 4) for j, c in counts.items()},
               share_spread=round(max(abs(c / total * len(counts) - 1) for c in counts.values()), 4))
    return out


# ---- lanes and measurement -----------------------------------------------------------------------------


class LaneInfo(Contract):
    queue: str
    kind: str  # a registered lane kind (shared.lanes): cpu, gpu
    share: int  # percent of the device, as this lane measures at
    cores: list[int] = []
    gpu_uuid: str | None = None
    target: str  # the target JSON this lane builds for
    host: str
    pid: int
    started_at: float
    batches: int = 0

    @property
    def worker(self) -> str:
        return worker_id(self.host, self.pid)
    candidates: int = 0


class LaneBatch(Contract):
    """One batch a lane worker measured for a job: the facts behind lane utilisation in reports."""

    batch_id: str
    lane: str
    worker: str
    started_at: float
    finished_at: float
    candidates: int
    errors: int = 0


class TimingConfig(Contract):
    """Timing hygiene as MetaSchedule's EvaluatorConfig: number x repeat with a floor in ms."""

    number: int = Field(default=3, ge=1)
    repeat: int = Field(default=1, ge=1)
    min_repeat_ms: int = Field(default=100, ge=0)
    timeout_s: float = Field(default=timeouts.RUN_TIMEOUT_S, gt=0)
    # screening (a candidate that carries `full_below_s`): one launch, then about this much kernel time in
    # three repeats; only a candidate whose brief median is under its bar gets the full timing above
    brief_ms: float = Field(default=10.0, gt=0, le=1000)
    # a full timing first runs its repeats with this floor each (ms); where they agree within `settle_spread`
    # ((max - min) / median) those are its figures, else they run again at min_repeat_ms. 0: min_repeat_ms only.
    # Needs two repeats or more (a GPU lane's three): one repeat cannot agree with anything
    settle_ms: int = Field(default=0, ge=0)
    settle_spread: float = Field(default=0.01, gt=0, le=1)
    # a screened candidate's repeats at settle_ms that disagree are kept all the same where even the fastest is
    # slower than its task's best so far: it cannot be the new best, and a longer window would not make it one
    # (a kernel under 20 us repeats ~3-4 % apart at 50 ms too). False: only agreement keeps them
    settle_above_best: bool = True


MAX_ARTIFACT_BYTES = 16 * 1024 * 1024  # a built candidate larger than this is refused by the lane


class Artifact(Contract):
    """A candidate built by a builder worker: the exported shared library as base64, with its size and
    SHA-256, so the lane that loads it can refuse a corrupted or oversized one as that candidate's error.
    Size and checksum are checked by the lane, not here: a bad artifact must not fail its whole batch."""

    format: Literal["so"] = "so"
    data: str  # base64 of the library's bytes
    size: int
    sha256: str
    build_s: float = 0.0
    build_cpu_s: float | None = None  # CPU seconds of the builder's process for this build
    builder: str = ""  # the builder worker (host.pid) that built it


class Candidate(Contract):
    candidate_id: str
    mod: str  # packed TVM JSON of the scheduled IRModule (shared.packed_json)
    args_info: list[Any]  # ArgInfo.as_json() of each argument: ["TENSOR", dtype, shape]
    artifact: Artifact | None = None  # built by a builder: the lane only times it
    # screened timing: timed briefly first, fully only when the brief median is under this many seconds
    # (the task's best so far plus a margin); None: the full timing (uniform policy, or nothing to beat yet)
    full_below_s: float | None = Field(default=None, gt=0)
    # the task's key for the lanes' live best (store.live_bests), set on screened rounds: the bar tightens as
    # the round finds better, and a round sent with nothing to beat is screened once it has a best
    bar_key: str | None = Field(default=None, max_length=200)
    # the store key of the task's default-scheduled module (store.put_reference): a lane that times this candidate
    # fully also runs that module on the same inputs and answers a candidate whose output differs with an error
    # ("wrong result"), so a schedule TVM lowers wrongly never becomes a best. `reference`: that module's packed IR,
    # filled in by the lane from the store before it measures (never sent by the tuner)
    reference_key: str | None = Field(default=None, max_length=300)
    reference: str | None = None


class MeasureBatch(Contract):
    batch_id: str
    job_id: str
    target: str  # target JSON the candidates were scheduled for
    timing: TimingConfig = TimingConfig()
    candidates: list[Candidate]


class BuildRequest(Contract):
    """A batch for a builder worker: build every candidate, then send the built ones to `lane` (a lane
    queue) as a MeasureBatch with the same batch id; a failed build is answered by the builder itself."""

    lane: str
    batch: MeasureBatch
    priority: int = Field(default=0, ge=0, le=9, description="the broker priority the built batch goes to its lane "
                          "with, 0 first (the round's own)")


class BuilderInfo(Contract):
    """A live builder worker (its liveness key, with a TTL): the build family it serves and its counters."""

    family: str
    host: str
    pid: int
    started_at: float
    built: int = 0
    failed: int = 0
    build_s: float = 0.0  # seconds spent building, summed

    @property
    def worker(self) -> str:
        return worker_id(self.host, self.pid)


class AgentInfo(Contract):
    """A live node agent (its liveness key, with a TTL): the host's lanes and builders it keeps running, the
    GPUs it recovers, and what it gave up (a process or GPU that kept failing), with why."""

    host: str
    pid: int
    started_at: float
    lanes: list[str] = []
    builders: int = 0
    gpus: list[str] = []  # UUIDs
    restarts: int = 0  # processes started again, summed
    recoveries: int = 0  # GPU recoveries
    given_up: dict[str, str] = {}  # process name or GPU -> why

    @property
    def worker(self) -> str:
        return worker_id(self.host, self.pid)


class ErrorKind(StrEnum):
    """What failed for a candidate that came back without timings."""

    BUILD = "build"  # it did not compile, or its artifact was refused
    RUN = "run"  # it compiled and running it failed (a launch error, a fault, a wrong result)
    CRASH = "crash"  # it killed or hung its process, or is quarantined for having done so
    CANCELLED = "cancelled"  # its job was cancelled before it ran
    LANE = "lane"  # no lane answered it (the lane died or overran, and no other took it)
    MALFORMED = "malformed"  # its batch's message failed validation


class MeasureResult(Contract):
    """One candidate's outcome: its timings, or an error of a kind (`error_kind`) with its message."""

    candidate_id: str
    run_secs: list[float] | None = None
    error: str | None = None
    error_kind: ErrorKind | None = None
    build_s: float = 0.0
    run_s: float = 0.0
    lane: str = ""
    share: int | None = None
    device: dict[str, Any] = {}
    # how the candidate failed when it took its process with it: "crash" (signal), "timeout" (hung and
    # killed), "quarantined" (crashed max_crashes times before: answered without running)
    fault: Literal["crash", "timeout", "quarantined"] | None = None
    timing: Timing | None = None  # which timing run_secs come from
    window_ms: int | None = None  # a full timing's floor a repeat (TimingConfig.settle_ms where they agreed)
    build_cpu_s: float | None = None  # CPU seconds its build took (builder or lane build pool)
    output_checked: bool = False  # its output was compared with its task's reference's (and matched)

    @model_validator(mode="after")
    def _timings_or_an_error(self):
        if (self.error is None) != (self.error_kind is None):
            raise ValueError("an error and its kind come together")
        if self.error is None and not self.run_secs:
            raise ValueError("a result has timings or an error")
        return self


class Quarantined(Contract):
    """A candidate that killed or hung its process too often; lanes answer it without running it."""

    candidate_hash: str
    error: str  # the last crash, e.g. "candidate killed its process: SIGSEGV"
    crashes: int
    lane: str
    job_id: str = ""
    batch_id: str = ""
    at: float = Field(default_factory=time.time)


class GpuFault(Contract):
    """A GPU lane whose CUDA context died: the candidate it ran and why (culprit or MPS victim)."""

    gpu8: str
    lane: str
    worker: str
    candidate_hash: str | None
    error: str
    role: Literal["culprit", "victim", "unknown"]
    at: float = Field(default_factory=time.time)


class Record(Contract):
    """A measured candidate: exportable to TVM's JSON database (trace + run_secs + target + args)."""

    candidate_key: str
    wkey: str
    trace: str  # packed TVM JSON of TuningRecord.as_json() (trace, run_secs, target, args)
    run_secs: list[float] | None  # the figures the record is ranked by (isolated ones once re-timed)
    error: str | None = None
    target: str
    args_info: list[Any]
    share: int
    lane: str = ""
    device: dict[str, Any] = {}
    job_id: str = ""
    measured_at: float = Field(default_factory=time.time)
    shared_run_secs: list[float] | None = None  # as measured while neighbouring lanes worked
    retimed_at: float | None = None  # set when re-timed with the job's other lanes idle
    timing: Timing = "full"  # "brief": screened out, run_secs are the brief window's (never an exported best)
    brief_run_secs: list[float] | None = None  # a brief record later given the full timing: its brief figures
    window_ms: int | None = None  # its full timing's floor a repeat (MeasureResult.window_ms)
    build_cpu_s: float | None = None
    output_checked: bool = False  # its output matched its task's default schedule's (MeasureResult.output_checked)
    # a warm seed: the candidate is a record of this (nearby) workload, its trace re-fitted to this one
    # (services/tuner/metaschedule/seeds.py); None: the task's own search proposed it
    seeded_from: str | None = None


class DefaultTiming(Contract):
    """A workload's default schedule (what the model runs for that task without a tuning record: DLight's
    rules on a GPU, the plain loop nest on a CPU), timed once on a lane of the workload's share."""

    wkey: str
    run_secs: list[float] | None = None
    error: str | None = None
    lane: str = ""
    measured_at: float = Field(default_factory=time.time)


class Workload(Contract):
    wkey: str
    name: str
    target: str
    share: int
    mod: str  # packed TVM JSON


class WorkloadShape(Contract):
    """A workload with valid records, as the index of similar workloads holds it (services.tuner.similarity):
    its operator kind and its PrimFunc's buffer parameters (shapes and dtypes)."""

    wkey: str
    op: str  # the task name without its numeric suffix
    target: str
    share: int
    params: list[list[int]]
    dtypes: list[str]


# ---- cost model -------------------------------------------------------------------------------------


class TrainingRow(Contract):
    group: str  # workload key: costs are normalised within a group
    features: list[float]
    cost_s: float  # mean run time; infinite costs (errors) are not sent
    brief: bool = False  # timed by the brief screening window only (noisier): trained with a lower weight


class TrainingBatch(Contract):
    target_key: str
    rows: list[TrainingRow]


class CostModelSnapshot(Contract):
    target_key: str
    version: int
    n_rows: int  # rows stored for the family
    train_rows: int = 0  # rows this model was trained on (bounded: see services.tuner.updater)
    feature_dim: int
    model: str  # base64 of the XGBoost model in its own JSON format
    trained_at: float

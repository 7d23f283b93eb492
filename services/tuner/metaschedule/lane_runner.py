"""MetaSchedule's builder and runner, backed by the measurer lanes (its Py* hooks, no fork of TVM).

The builder does not build: it serialises each scheduled module and hands back a handle, so the lanes
build and time in their warm processes. The runner splits a batch of candidates over the live lanes of
the job's share, one Celery message per lane, and returns a future per candidate that resolves from the
results the lanes write to Redis. A lane that vanishes or a batch that overruns resolves to an error
result, never to a hang."""
from __future__ import annotations

import logging
import statistics
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from tvm.ir.utils import derived_object
from tvm.s_tir.meta_schedule.builder import BuilderInput, BuilderResult, PyBuilder
from tvm.s_tir.meta_schedule.runner import PyRunner, PyRunnerFuture, RunnerFuture, RunnerInput, RunnerResult

from shared import lanes as lane_kinds
from shared import names, store, timeouts
from services.tuner.allocation import message_priority
from services.tuner.metaschedule.ir_codec import dump_ir
from shared.messages import BuildRequest, Candidate, ErrorKind, LaneInfo, MeasureBatch, MeasureResult, TimingConfig

log = logging.getLogger("sharetune.tuner.lanes")

HANDLE_PREFIX = "lane-candidate:"
# Times a batch's unanswered candidates are sent again after its lane died. A GPU fault under MPS ends every
# lane of the GPU, and finding its culprit may end them once more (the culprit faulting alone), so an
# innocent suspect may need two re-sends; a candidate that keeps killing lanes is quarantined and answered
# long before the sends run out (services.measurer.isolation.judge).
REDISPATCH = 3
HEALTH_CHECK_S = 0.25  # how often a waiting batch looks at its lane's and builder's liveness (their TTLs are seconds)


@dataclass
class TimeSplit:
    """Where the tuner's time goes, in seconds (lanes report build and run; the rest is ours)."""

    serialize: float = 0.0
    wait: float = 0.0  # blocked on lane results
    queue: float = 0.0  # from send until a lane started the batch
    build: float = 0.0  # summed over candidates (lanes work in parallel)
    run: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def as_dict(self) -> dict[str, float]:
        return {k: round(getattr(self, k), 3) for k in ("serialize", "wait", "queue", "build", "run")}


class CandidateStash:
    """Scheduled modules waiting between build() and run(), by handle, in the tuner process."""

    def __init__(self):
        self._items: dict[str, str] = {}

    def put(self, packed_mod: str) -> str:
        handle = HANDLE_PREFIX + uuid.uuid4().hex
        self._items[handle] = packed_mod
        return handle

    def take(self, handle: str) -> str:
        return self._items.pop(handle)


@derived_object
class DeferredBuilder(PyBuilder):
    def __init__(self, stash: CandidateStash, split: TimeSplit):
        super().__init__()
        self.stash = stash
        self.split = split

    def build(self, build_inputs: list[BuilderInput]) -> list[BuilderResult]:
        t0 = time.perf_counter()
        out = []
        for bi in build_inputs:
            try:
                out.append(BuilderResult(self.stash.put(dump_ir(bi.mod)), None))
            except Exception as err:  # noqa: BLE001 - reported as a build error for this candidate
                out.append(BuilderResult(None, f"cannot serialise candidate: {type(err).__name__}: {err}"))
        self.split.serialize += time.perf_counter() - t0
        return out


class BatchWatch:
    """The tuner's view of one batch of candidates. If the lane worker that took it dies (its liveness
    key expires), or no worker of the lane is left, or the batch overruns, the unanswered candidates are
    sent again to a live lane (up to `redispatch` times); only then do they come back as errors."""

    def __init__(self, runner: "LaneRunner", batch: MeasureBatch, lane: str, redispatch: int = REDISPATCH,
                 via: str | None = None):
        self.runner, self.redis = runner, runner.redis
        self.batch, self.lane = batch, lane
        self.via = via  # the build queue the batch goes through before its lane, if builders serve it
        self.ids = {c.candidate_id for c in batch.candidates}
        self.sent_at = time.time()
        self.results: dict[str, MeasureResult] = {}
        self.started_at: float | None = None
        self.worker: str | None = None
        self.failed: str | None = None
        self.redispatch_left = redispatch
        self.queue_time_counted = False
        self._lane_missing_since: float | None = None
        self._no_lane_since: float | None = None  # a re-send is due but no lane is live yet
        self._checked_at = 0.0  # when the lane's and builder's liveness was last looked at
        self.boot = runner.server_boot()  # the Redis server's start the batch was sent in (store.server_boot)
        self._built_seen = False

    def complete(self) -> bool:
        return self.ids <= self.results.keys()

    def poll(self) -> None:
        if self.failed or self.complete():
            return
        started, building, results = store.batch_progress(self.redis, self.batch.batch_id, self.results.keys())
        self.results.update({k: v for k, v in results.items() if k in self.ids})
        if started and self.started_at is None:
            self.started_at, self.worker = started["at"], started.get("worker")
        if self.complete():
            return
        now = time.time()
        if now - self._checked_at < HEALTH_CHECK_S:  # results are read every poll, liveness a few times a second
            return
        self._checked_at = now
        timeout = self.runner.timing.timeout_s
        kind, why = None, None
        if building and not self._built_seen:  # a builder has the message: what may be lost now is what it forwards
            self._built_seen, self.boot = True, self.runner.server_boot()
        if self.started_at is None and (not building or building.get("forwarded")) and self._server_restarted():
            kind, why = ("broker-restarted", f"the Redis server restarted after batch {self.batch.batch_id} was sent "
                         f"to {self.lane}, before a lane started it: its message may be lost")
        elif self.started_at is not None:
            if self.worker and not store.lane_worker_alive(self.redis, self.lane, self.worker):
                kind, why = "lane-died", f"lane {self.lane} worker {self.worker} died during batch {self.batch.batch_id}"
            elif now - self.started_at > len(self.batch.candidates) * timeout + self.runner.grace_s:
                kind, why = "lane-timeout", f"lane {self.lane} did not finish batch {self.batch.batch_id} in time"
        elif self.via and building and not building.get("forwarded"):
            if building.get("alive_key") and not store.builder_alive(self.redis, building["alive_key"]):
                kind, why = "builder-died", f"builder {building.get('worker')} died while building batch {self.batch.batch_id}"
            elif now - building["at"] > len(self.batch.candidates) * timeout + self.runner.grace_s:
                kind, why = ("builder-timeout",
                             f"builder {building.get('worker')} did not finish batch {self.batch.batch_id} in time")
        elif self.via and not building:
            since = self.runner.builders_missing_since()
            if since is not None and now - since > timeouts.NO_BUILDER_GRACE_S:
                kind, why = "no-builder", f"no builder of {self.runner.family} is left to build batch {self.batch.batch_id}"
        elif not store.lane_alive(self.redis, self.lane):
            self._lane_missing_since = self._lane_missing_since or now
            if now - self._lane_missing_since > timeouts.LANE_TTL_S:
                kind, why = "lane-gone", f"lane {self.lane} is gone (no heartbeat for {timeouts.LANE_TTL_S} s)"
        else:
            self._lane_missing_since = None
        if why:
            queue = self.runner.live_queue() if self.redispatch_left > 0 else None
            if queue is not None:
                self._redispatch(queue, kind, why)
            elif self.redispatch_left > 0 and now - (self._no_lane_since or now) < self.runner.grace_s:
                self._no_lane_since = self._no_lane_since or now  # lanes restarting (e.g. after a GPU fault)
            else:
                self.failed = why

    def _server_restarted(self) -> bool:
        """Has the Redis server restarted since the batch was sent (or last re-sent)? Then its message may be gone: a
        write the AOF had not synced, or a message a consumer held unacknowledged when its connection dropped (given
        out again only after the visibility timeout, an hour)."""
        now = self.runner.server_boot()
        return self.boot is not None and now is not None and now != self.boot

    def _redispatch(self, queue: str, kind: str, why: str) -> None:
        pending = [c for c in self.batch.candidates if c.candidate_id not in self.results]
        old = self.batch.batch_id
        self.batch = self.batch.model_copy(update={"batch_id": uuid.uuid4().hex, "candidates": pending})
        log.warning("job %s: %d candidate(s) of batch %s sent again to %s as batch %s: %s", self.batch.job_id,
                    len(pending), old, queue, self.batch.batch_id, why)
        try:
            store.note_resend(self.redis, self.batch.job_id, old, queue, kind, why)
        except Exception:  # noqa: BLE001 - the accounting must not stop the re-send itself
            log.warning("could not record the re-send of batch %s", old, exc_info=True)
        self.lane, self.sent_at, self.started_at, self.worker = queue, time.time(), None, None
        self.boot, self._built_seen = self.runner.server_boot(), False
        self.via = None  # the lane builds what it is re-sent: a builder may be what failed
        self._lane_missing_since = None
        self.redispatch_left -= 1
        self.runner.send(self.batch, queue)

    def result_for(self, candidate_id: str) -> MeasureResult | None:
        if candidate_id in self.results:
            return self.results[candidate_id]
        if self.failed:
            return MeasureResult(candidate_id=candidate_id, error=self.failed, error_kind=ErrorKind.LANE,
                                 lane=self.lane)
        return None


@derived_object
class LaneFuture(PyRunnerFuture):
    def __init__(self, runner: "LaneRunner", watch: BatchWatch, candidate_id: str):
        super().__init__()
        self.runner, self.watch, self.candidate_id = runner, watch, candidate_id

    def done(self) -> bool:
        if self.watch.result_for(self.candidate_id) is None:
            self.watch.poll()
        return self.watch.result_for(self.candidate_id) is not None

    def result(self) -> RunnerResult:
        t0 = time.perf_counter()
        res = self.watch.result_for(self.candidate_id)
        while res is None:
            self.watch.poll()
            res = self.watch.result_for(self.candidate_id)
            if res is None:
                time.sleep(0.01)
        self.runner.on_result(self.watch, res, time.perf_counter() - t0)
        if res.error is not None:
            return RunnerResult(None, res.error)
        # the search ranks by the median of the repeats (robust to a neighbour's burst); the record
        # in the store keeps every repeat
        return RunnerResult([statistics.median(res.run_secs)], None)


@dataclass(frozen=True)
class JobLanes:
    """Whose candidates a runner sends and which lanes measure them: the job, the lane kind and share that
    serve it, and the target (JSON) its candidates are built for."""

    job_id: str
    kind: str
    share: int
    target_json: str


@dataclass(frozen=True)
class BatchRules:
    """How a runner's batches are timed and waited for: the candidates' timing, the grace a started batch gets
    before its candidates count as lost, and how long it waits for a lane of the job's share (the tuner's
    live-lane policy, TunerSettings.live_lane_policy)."""

    timing: TimingConfig
    grace_s: float = timeouts.BATCH_GRACE_S
    policy: lane_kinds.LiveLanePolicy = lane_kinds.LiveLanePolicy()


@derived_object
class LaneRunner(PyRunner):
    """Sends candidates to the lanes that serve (kind, share); `lanes()` is re-read on every batch, so
    lanes that start or stop while a job runs are used or avoided. With none live, it waits as the live-lane
    policy says (shared.lanes.LiveLanePolicy.give_up_s), then gives up."""

    def __init__(self, send, redis, job: JobLanes, stash: CandidateStash, split: TimeSplit, rules: BatchRules):
        """`send(task_name, payload, queue)` publishes one message (the tuner's Celery boundary gives it)."""
        super().__init__()
        self.policy = rules.policy
        self._send, self.redis, self.job_id = send, redis, job.job_id
        self.kind, self.share, self.target_json = job.kind, job.share, job.target_json
        self.stash, self.split, self.timing, self.grace_s = stash, split, rules.timing, rules.grace_s
        self.measured: dict[str, MeasureResult] = {}  # candidate handle -> result, for the record callback
        # screened timing: the brief median under which the next candidates get the full timing (the
        # task's best so far plus shared.ranking.SCREEN_MARGIN); None: every candidate gets it
        self.full_below_s: float | None = None
        self.bar_key: str | None = None  # the round's task, whose live best the lanes keep (Candidate.bar_key)
        # the round's workload, whose reference module the lanes check fully timed outputs against
        # (Candidate.reference_key), sent only with `check_outputs` (TunerSettings.check_outputs)
        self.reference_key: str | None = None
        self.check_outputs = True
        # the job's fair step among the running jobs (allocation.round_priority), asked once a round; None: 0
        self.priority: Callable[[], int] | None = None
        self.head = False  # the round is a head task's first round (allocation.head_tasks): its messages go first
        self._rr = 0
        try:  # builders serve a family; a target with none (e.g. no explicit arch) is built by its lanes
            self.family = lane_kinds.target_family(self.target_json)
        except ValueError:
            self.family = None
        self._builders_seen: tuple[float, bool] = (0.0, False)  # (when looked, any live)
        self._boot_seen: tuple[float, str | None] = (0.0, None)  # (when looked, the Redis server's run_id)
        self._no_builders_since: float | None = None

    def lanes(self) -> list[LaneInfo]:
        return lane_kinds.serving(store.live_lanes(self.redis), self.kind, self.share)

    def run(self, runner_inputs: list[RunnerInput]) -> list[RunnerFuture]:
        candidates = [
            Candidate(
                candidate_id=ri.artifact_path,
                mod=self.stash.take(ri.artifact_path),
                args_info=[_plain(a.as_json()) for a in ri.args_info],
                full_below_s=self.full_below_s,
                bar_key=self.bar_key,
                reference_key=self.reference_key if self.check_outputs else None,
            )
            for ri in runner_inputs
        ]
        watches = self.dispatch(candidates)
        return [LaneFuture(self, watches[c.candidate_id], c.candidate_id) for c in candidates]

    def timing_of(self, handle: str | None) -> str | None:
        """Which timing a measured candidate got ("full", "brief"), by its handle, until its record is made."""
        res = self.measured.get(handle) if handle else None
        return res.timing if res is not None else None

    def measure_now(self, candidates: list[Candidate], one_lane: bool = False) -> dict[str, MeasureResult]:
        """Measure candidates outside the search (e.g. re-timing) and wait for every result; they carry
        no bar, so each gets the full timing; they go ahead of the rounds (the first rounds' order waits on the
        default schedules' timings). Their full timings take the whole floor (no settling: these figures decide
        what is exported)."""
        watches = self.dispatch(candidates, one_lane, ahead=True, timing=self.timing.model_copy(update={"settle_ms": 0}))
        out = {}
        for cand in candidates:
            watch = watches[cand.candidate_id]
            while (res := watch.result_for(cand.candidate_id)) is None:
                watch.poll()
                time.sleep(0.02)
            out[cand.candidate_id] = res
        return out

    def dispatch(self, candidates: list[Candidate], one_lane: bool = False,
                 ahead: bool | None = None, timing: TimingConfig | None = None) -> dict[str, BatchWatch]:
        """Deal candidates round-robin over one slot per live lane worker (a queue served by two workers
        gets two sub-batches), send one batch per slot; returns each candidate's watch. When builders
        serve the job's target family, each candidate goes to them alone (its own batch): the builders
        build in parallel and the lanes, fed one built candidate at a time, only time. `ahead`: the messages go
        ahead of the job's other rounds (default: whether this round is a head task's first, `self.head`);
        `timing`: instead of the job's."""
        timing = timing or self.timing
        lanes = self.lanes() or self._wait_for_lanes()
        slots = sorted(l.queue for l in lanes)[: 1 if one_lane else None]
        fair = self.priority() if self.priority is not None else 0
        priority = message_priority(fair, self.head if ahead is None else ahead)
        if not one_lane and self.family and self.builders_live():
            return self._dispatch_to_builders(candidates, slots, priority, timing)
        parts: list[list[Candidate]] = [[] for _ in slots]
        for i, cand in enumerate(candidates):
            parts[(self._rr + i) % len(slots)].append(cand)
        self._rr += len(candidates)
        watches = {}
        for queue, part in zip(slots, parts):
            if not part:
                continue
            batch = MeasureBatch(batch_id=uuid.uuid4().hex, job_id=self.job_id, target=self.target_json,
                                 timing=timing, candidates=part)
            watch = BatchWatch(self, batch, queue)
            self.send(batch, queue, priority=priority)
            watches.update({c.candidate_id: watch for c in part})
        return watches

    def builders_live(self, max_age_s: float = 1.0) -> bool:
        """Whether a builder of the job's family lives, looked up at most once a second for all watches."""
        at, live = self._builders_seen
        now = time.time()
        if now - at > max_age_s:
            live = bool(self.family) and bool(store.live_builders(self.redis, self.family))
            self._builders_seen = (now, live)
            self._no_builders_since = None if live else (self._no_builders_since or now)
        return live

    def server_boot(self, max_age_s: float = 1.0) -> str | None:
        """The Redis server's start (store.server_boot), looked up at most once a second for all watches."""
        at, boot = self._boot_seen
        now = time.time()
        if now - at > max_age_s:
            boot = store.server_boot(self.redis)
            self._boot_seen = (now, boot)
        return boot

    def builders_missing_since(self) -> float | None:
        """Since when no builder of the family was seen (one clock for every candidate waiting on them)."""
        self.builders_live()
        return self._no_builders_since

    def _dispatch_to_builders(self, candidates: list[Candidate], slots: list[str], priority: int,
                              timing: TimingConfig) -> dict[str, BatchWatch]:
        via = names.build_queue(self.family)
        watches = {}
        for i, cand in enumerate(candidates):
            queue = slots[(self._rr + i) % len(slots)]
            batch = MeasureBatch(batch_id=uuid.uuid4().hex, job_id=self.job_id, target=self.target_json,
                                 timing=timing, candidates=[cand])
            watches[cand.candidate_id] = BatchWatch(self, batch, queue, via=via)
            self.send(batch, queue, via, priority)
        self._rr += len(candidates)
        return watches

    def send(self, batch: MeasureBatch, queue: str, via: str | None = None, priority: int = 0) -> None:
        if via is not None:
            request = BuildRequest(lane=queue, batch=batch, priority=priority)
            self._send(names.BUILD_TASK, request.model_dump(mode="json"), via, priority)
        else:
            self._send(names.MEASURE_TASK, batch.model_dump(mode="json"), queue, priority)

    def live_queue(self) -> str | None:
        """A lane queue of this job's share with a live worker (the least loaded is Celery's business)."""
        lanes = self.lanes()
        return lanes[self._rr % len(lanes)].queue if lanes else None

    def _wait_for_lanes(self) -> list[LaneInfo]:
        deadline = time.time() + self.policy.give_up_s
        while time.time() < deadline:
            lanes = self.lanes()
            if lanes:
                return lanes
            time.sleep(0.5)
        raise RuntimeError(f"no live measurer lane serves {self.kind} at {self.share} %")

    def on_result(self, watch: BatchWatch, res: MeasureResult, waited_s: float) -> None:
        with self.split.lock:
            self.measured[res.candidate_id] = res
            self.split.wait += waited_s
            self.split.build += res.build_s
            self.split.run += res.run_s
            if watch.started_at is not None and not watch.queue_time_counted:
                watch.queue_time_counted = True
                self.split.queue += max(0.0, watch.started_at - watch.sent_at)


def module_candidate(candidate_id: str, mod) -> Candidate:
    """A scheduled module (its PrimFunc "main") as a candidate the lanes measure outside the search
    (re-timing, default schedules)."""
    from tvm.s_tir.meta_schedule.arg_info import ArgInfo

    return Candidate(candidate_id=candidate_id, mod=dump_ir(mod),
                     args_info=[_plain(a.as_json()) for a in ArgInfo.from_prim_func(mod["main"])])


def _plain(obj):
    """ArgInfo.as_json() holds TVM containers and IntImm; make plain JSON values of them."""
    if isinstance(obj, (str, bool)) or obj is None:
        return obj
    if isinstance(obj, (int, float)):
        return obj
    if hasattr(obj, "value") and not isinstance(obj, (list, tuple, dict)):
        return obj.value
    if isinstance(obj, dict) or hasattr(obj, "items"):
        return {str(k): _plain(v) for k, v in obj.items()}
    try:
        return [_plain(x) for x in obj]
    except TypeError:
        return str(obj)

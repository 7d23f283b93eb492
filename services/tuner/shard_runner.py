"""A tuner client's core, free of Celery: the shard runner, built once when the worker starts.

A client holds the shard it searches with a lease (a Redis key with a TTL that a thread renews). A client
that dies loses its lease; any live client's reaper (its heartbeat runs it) then refunds the shard's
unrecorded claim and sends the shard again, and the next client resumes it from the store. A client
asked to stop hands its shard back at the next round; a finished shard is marked done only under the
lease, and the client that marks a job's last shard done runs the job's finishing step.

Sending is given: `send(task_name, payload, queue)`, `send_shard(job_id, shard)`, `send_finish(job_id)`."""
from __future__ import annotations

import functools
import logging
import threading
import time
import traceback
from collections.abc import Callable

from shared import names, store, timeouts
from shared.errors import SharetuneError
from shared.heartbeat import keep_beating
from shared.messages import FINAL_STATES, JobState, ShardPhase, ShardRef
from shared.settings import TunerSettings

log = logging.getLogger("sharetune.tuner")


def fail_job(r, job_id: str, stage: str, err: BaseException) -> None:
    """End a job with a message naming the stage and the problem (logged with its traceback)."""
    msg = str(err) if isinstance(err, SharetuneError) else f"{type(err).__name__}: {err}"
    log.error("job %s failed while %s: %s\n%s", job_id, stage, msg, traceback.format_exc())
    store.set_state(r, job_id, JobState.FAILED, error=f"{stage}: {msg}")


def left_to_lapse(job_id: str, step: str, err: BaseException) -> dict:
    """A step that gave up because Redis was away: not the job's fault, so the job is not failed; the
    step's lease or hold lapses, and a reaper sends it again once Redis is back."""
    log.warning("job %s: %s left to be sent again, Redis was away: %s", job_id, step, err)
    return {"job_id": job_id, "redis_away": step}


class ShardRunner:
    """Leases, searches, hands back and finishes shards for one tuner client (one worker process)."""

    def __init__(self, redis, worker: str, settings: TunerSettings, send: Callable[[str, dict, str], None],
                 send_shard: Callable[[str, int], None], send_finish: Callable[[str], None]):
        self.redis, self.worker, self.settings = redis, worker, settings
        self.send, self.send_shard, self.send_finish = send, send_shard, send_finish
        self.stopping = threading.Event()  # set on warm shutdown: the running shard is handed back at its next round

    # ------------------------------------------------------------------------- life cycle
    def start(self) -> None:
        """Keep a liveness key (the stack waits for it; the planner counts clients by it) and run the
        reaper, which re-sends the shards of clients that died, until the client stops."""
        from services.tuner import reaper

        def beat():
            while not self.stopping.is_set():
                try:
                    store.announce_tuner(self.redis, self.worker)
                    reaper.reap(self.redis, lambda ref: self.send_shard(ref.job_id, ref.shard), self.send_finish,
                                send_plan=lambda ref: self.send(names.PLAN_TASK, ref.model_dump(mode="json"),
                                                                names.PLAN_QUEUE))
                except Exception as err:  # noqa: BLE001 - a Redis hiccup must not end the heartbeat
                    log.warning("heartbeat/reaper: %s", err)
                time.sleep(timeouts.HEARTBEAT_S)

        threading.Thread(target=beat, name="tuner-heartbeat", daemon=True).start()

    def stop(self) -> None:
        self.stopping.set()
        try:  # a stopped client is no longer counted when jobs are split into shards
            store.retire_tuner(self.redis, self.worker)
        except Exception:  # noqa: BLE001
            pass

    # ------------------------------------------------------------------------- one shard
    def run(self, ref: ShardRef) -> dict | None:
        """Search one shard under its lease until its tasks' budget is spent (then mark it done), or hand it
        back when told to stop; a shard handed back to take turns with another is followed by that one (or, where
        another client took that one first, by the neediest job's waiting shard). The last shard's outcome; None
        when its job failed (its state says why)."""
        out, turn = self._run_one(ref)
        lost = 0
        while turn is not None and not self.stopping.is_set():
            out, turn = self._run_one(turn)
            if turn is None and (out or {}).get("skipped") == HELD and lost < MAX_LOST_TURNS:
                # another client handed its shard back for the same one first: take the neediest job's waiting
                # shard now, not the next message of the queue (whichever job's shard was handed back first)
                lost += 1
                turn = self._neediest_waiting()
        return out

    def _neediest_waiting(self) -> ShardRef | None:
        from services.tuner.allocation import neediest

        running, waiting = clients_board(self.redis, 0.0)
        if not waiting:
            return None
        job, shard = neediest(running, waiting)
        return ShardRef(job_id=job, shard=shard)

    def _run_one(self, ref: ShardRef) -> tuple[dict | None, ShardRef | None]:
        """One shard's search: its outcome, and the shard it was handed back for, if any."""
        out = self._search(ref)
        turn = (out or {}).pop("turn", None)
        return out, turn

    def _search(self, ref: ShardRef) -> dict | None:
        from services.tuner import search
        from services.tuner.metaschedule.loop_parts import Stopped, TurnTaken

        r, me, s = self.redis, self.worker, self.settings
        started = time.time()
        state = store.job_status(r, ref.job_id)
        if state == JobState.CANCELLED:
            self.finish_cancelled(ref.job_id)  # a shard no client took: the job may be finished now
        if state in FINAL_STATES:
            return {"job_id": ref.job_id, "skipped": state}  # a re-delivered message for a finished job
        shard = store.shards(r, ref.job_id).get(ref.shard)
        if shard is None or shard.state == ShardPhase.DONE:
            return {"job_id": ref.job_id, "shard": ref.shard, "skipped": "done"}
        if self.stopping.is_set() or not store.take_lease(r, ref.job_id, ref.shard, me):
            if self.stopping.is_set():
                self.send_shard(ref.job_id, ref.shard)  # taken while shutting down: hand it straight back
            return {"job_id": ref.job_id, "shard": ref.shard, "skipped": HELD}

        def running(sh):
            if sh.state == ShardPhase.DONE:  # finished by the client that held it until we took the lease
                return False
            sh.state, sh.owner, sh.attempts = ShardPhase.RUNNING, me, sh.attempts + 1
            sh.started_at = sh.started_at or time.time()

        if store.update_shard(r, ref.job_id, ref.shard, running, owner=me) is None:
            store.release_lease(r, ref.job_id, ref.shard, me)
            return {"job_id": ref.job_id, "shard": ref.shard, "skipped": "done, or the lease lapsed"}
        if state in (JobState.PLANNED, JobState.QUEUED):
            store.set_state(r, ref.job_id, JobState.TUNING)
        lease = Lease(r, ref.job_id, ref.shard, me, self.stopping, s.shard_quantum_s,
                      s.fair_measure if s.fair_clients else None)
        try:
            run = search.tune_shard(self.send, r, ref.job_id, ref.shard, s, check=lease.check)
        except Stopped as why:
            lease.stop()
            self._hand_back(ref, lease, why)
            out = {"job_id": ref.job_id, "shard": ref.shard, "handed_back": str(why)}
            if isinstance(why, TurnTaken):  # the waiting shard is taken at once (its queued message finds it held)
                out["turn"] = ShardRef(job_id=why.job_id, shard=why.shard)
            return out
        except Exception as err:  # noqa: BLE001
            lease.stop()
            if store.outage_since(started, err):  # the lease lapses; the reaper refunds and re-sends the shard
                return left_to_lapse(ref.job_id, f"shard {ref.shard}", err)
            fail_job(r, ref.job_id, f"tuning shard {ref.shard}", err)
            return None
        lease.stop()
        if not store.finish_shard(r, ref.job_id, ref.shard, me):
            # the lease lapsed (this client stalled): the reaper sent the shard again, and its next client,
            # which resumes from the records this one stored, marks it done
            log.warning("job %s shard %s: lease lost before the shard was marked done", ref.job_id, ref.shard)
            return {"job_id": ref.job_id, "shard": ref.shard, "lease_lost": True, "trials": run.trials}
        if all(sh.state == ShardPhase.DONE for sh in store.shards(r, ref.job_id).values()):
            # finished here, at once: a step sent to the queue would wait behind other jobs' shards, which a
            # client busy with a long job keeps taking turns with (a client that dies in it leaves the guard
            # to lapse, and the reaper sends the step)
            if store.claim_finish(r, ref.job_id, me):
                self.finish(ref.job_id)
        return {"job_id": ref.job_id, "shard": ref.shard, "trials": run.trials, "reused": run.reused}

    def _hand_back(self, ref: ShardRef, lease: Lease, why: BaseException) -> None:
        """A stopped search: a live job's shard goes back to pending with its unrecorded claim refunded and
        is sent again; a cancelled job's shard is over (its in-flight round is recorded)."""
        r, me = self.redis, self.worker
        log.warning("job %s shard %s handed back: %s", ref.job_id, ref.shard, why)
        state = store.job_status(r, ref.job_id)
        if lease.held() and state not in (JobState.FAILED, JobState.CANCELLED):
            refunded = store.refund_claim(r, ref.job_id, ref.shard, store.shards(r, ref.job_id)[ref.shard].task_ids)

            def handed_back(sh):
                sh.refunded += refunded
                sh.state, sh.owner, sh.queued_at = ShardPhase.PENDING, None, time.time()

            # written only while the lease is ours, and released with it: a client that lost its lease
            # was replaced, and the replacement's state stands
            if store.update_shard(r, ref.job_id, ref.shard, handed_back, owner=me, release=True):
                self.send_shard(ref.job_id, ref.shard)
        elif lease.held() and state == JobState.CANCELLED:
            if store.finish_shard(r, ref.job_id, ref.shard, me):
                self.finish_cancelled(ref.job_id)

    # ------------------------------------------------------------------------- a job's end
    def finish_cancelled(self, job_id: str) -> None:
        """A cancelled job gets the same finishing step as a finished one, on what was measured (best so far
        per task, the exported database, a compiled model), once no client searches it any more; its state
        stays "cancelled"."""
        r = self.redis
        if store.job_result(r, job_id) is not None:
            return
        if any(sh.state == ShardPhase.RUNNING for sh in store.shards(r, job_id).values()):
            return  # the client still searching finishes it when it stops
        if store.claim_finish(r, job_id, self.worker):
            self.send_finish(job_id)

    def finish(self, job_id: str) -> dict | None:
        """The job's finishing step (re-time, export, compile, result), once; None when it failed."""
        from services.tuner import search

        r = self.redis
        started = time.time()
        state = store.job_status(r, job_id)
        if state in (JobState.DONE, JobState.FAILED) or (state == JobState.CANCELLED and store.job_result(r, job_id)):
            return {"job_id": job_id, "skipped": state}
        if state == JobState.CANCELLED and store.job_hash(r, job_id).target_json is None:
            return {"job_id": job_id, "skipped": "cancelled before it was planned"}  # nothing measured to finish on
        # the guard this step was sent under outlives a dead client by FINISH_QUEUED_S: held with a short TTL
        # while it runs, so a client killed mid-finish has the reaper send it again within seconds
        hold = functools.partial(store.hold_finish, r, job_id, self.worker)
        hold()
        stop = keep_beating(hold, timeouts.FINISH_LEASE_RENEW_S, f"finish hold of {job_id}")
        try:
            result = search.finish_job(self.send, r, job_id, self.settings)
        except Exception as err:  # noqa: BLE001
            if store.outage_since(started, err):  # the hold lapses; the reaper sends the finishing step again
                return left_to_lapse(job_id, "finishing", err)
            fail_job(r, job_id, "finishing", err)
            return None
        finally:
            stop.set()
        return {"job_id": job_id, "trials": result.trials}


WAITING_S = 2.0  # a shard queued this long has found no free client
HELD = "held by another client"
MAX_LOST_TURNS = 3  # a client that lost the shard it handed its own back for tries the neediest this often


def clients_board(redis, waited_s: float, own_job: str | None = None):
    """How the active jobs hold the tuner clients (allocation.board_of): running shards per job, and the shards
    waiting at least `waited_s`, less those of jobs other than `own_job` that have ended (until the reaper
    retires them)."""
    from services.tuner.allocation import board_of

    board = {job: list(store.shards(redis, job).values()) for job in store.active_jobs(redis)}
    running, waiting = board_of(board, time.time(), waited_s)
    ended = {job for job in {w[0] for w in waiting} - {own_job} if store.job_status(redis, job) in FINAL_STATES}
    return running, [w for w in waiting if w[0] not in ended]


class Lease:
    """Renews a client's lease on a shard while it searches; `check` (called between rounds) raises
    Stopped once the client stops or the lease was lost (this client stalled and was replaced), the job
    failed or was cancelled, or it is time to take turns with a shard no client has taken."""

    def __init__(self, redis, job_id: str, shard: int, worker: str, stopping: threading.Event, quantum_s: float,
                 fair_clients: str | None = None):
        # fair_clients: what jobs' shares are counted in when it hands its shard to a job behind (TunerSettings
        # fair_measure; None: it does not)
        self.redis, self.job_id, self.shard, self.worker = redis, job_id, shard, worker
        self.stopping, self.quantum_s, self.fair_clients = stopping, quantum_s, fair_clients
        self.started = time.time()
        self._lost = threading.Event()
        self._done = threading.Event()
        threading.Thread(target=self._renew, name=f"lease-{job_id}-{shard}", daemon=True).start()

    def _renew(self):
        last = time.monotonic()
        while not self._done.wait(timeouts.LEASE_RENEW_S):
            try:
                got = store.renew_lease_as(self.redis, self.job_id, self.shard, self.worker)
            except Exception as err:  # noqa: BLE001 - Redis away for a moment: try again
                log.warning("lease renewal of %s/%s: %s", self.job_id, self.shard, err)
                continue
            if not got:
                self._lost.set()
                return
            if got == 2:  # this thread was starved past the TTL (a loaded host), and no one had taken the shard
                log.warning("lease of %s/%s lapsed %.1f s after its last renewal (TTL %d s) and was taken again",
                            self.job_id, self.shard, time.monotonic() - last, timeouts.LEASE_TTL_S)
            last = time.monotonic()

    def held(self) -> bool:
        return not self._lost.is_set()

    def check(self, passed: bool = False, blocked: bool = False) -> None:
        """`passed`: every task of the shard has had its first round; `blocked`: the shard can measure
        nothing more until other shards' tasks have had theirs (then it takes turns at once, not after its
        quantum: the job's clients may all be held by other jobs, say waiting out a GPU recovery)."""
        from services.tuner.allocation import MIN_HOLD_S, owing_first_rounds, turn_to_take
        from services.tuner.metaschedule.loop_parts import Stopped, TurnTaken

        if self.stopping.is_set():
            raise Stopped("the tuner client is shutting down")
        if self._lost.is_set():
            raise Stopped("the shard's lease was lost (this client stalled past its TTL)")
        state = store.job_status(self.redis, self.job_id)
        if state in (JobState.FAILED, JobState.CANCELLED):
            raise Stopped(f"the job is {state}")
        held = time.time() - self.started
        if held > MIN_HOLD_S or (passed and blocked):
            # fewer clients than shards (of this job, or of all the jobs at once): take turns with a waiting one
            running, waiting = clients_board(self.redis, WAITING_S, self.job_id)
            owing = owing_first_rounds(list(store.shards(self.redis, self.job_id).values()),
                                       set(store.history(self.redis, self.job_id))) if blocked else None
            loads = (store.fair_loads(self.redis, self.fair_clients) if self.fair_clients and held > self.quantum_s
                     else None)
            turn = turn_to_take(self.job_id, running, waiting, held, self.quantum_s, passed, blocked, owing, loads)
            if turn is not None:
                raise TurnTaken(*turn, f"taking turns with shard {turn[1]} of job {turn[0]}, which no client has")

    def stop(self):
        self._done.set()

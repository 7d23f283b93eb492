"""The timeouts that depend on each other, in one place, each with the reason for its order against the others
(tests/test_timeouts.py checks every order written here). Settings that override one (SHARETUNE_BATCH_GRACE_S,
SHARETUNE_WATCHDOG_MARGIN_S, a job's TimingConfig.timeout_s) take their defaults from here."""
from __future__ import annotations

# ---- liveness: a key its owner's heartbeat refreshes, which lapses when the owner dies ------------------
LANE_TTL_S = 30  # a lane's, builder's or tuner client's liveness key (and a replica's lane claim)
# three beats a TTL: one beat lost to a restarting Redis is not taken for a death
HEARTBEAT_S = LANE_TTL_S / 3
LEASE_TTL_S = 20  # a tuner client's hold on a shard (and the reaper's re-send guard)
LEASE_RENEW_S = LEASE_TTL_S / 4  # renewed four times a TTL: a client busy in a search round keeps it
PLAN_LEASE_TTL_S = 15  # a planner's hold on the job it plans
PLAN_LEASE_RENEW_S = PLAN_LEASE_TTL_S / 3
FINISH_LEASE_TTL_S = 20  # a tuner client's hold on the finishing step it runs: the reaper sends it again once it lapses
FINISH_LEASE_RENEW_S = FINISH_LEASE_TTL_S / 4
# a finishing step sent but not yet started (it waits in the tune queue behind shards): not sent again
# before this, unless a client took it and died, or the tune queue is empty past STRANDED_AFTER_S (a worker
# took its message and was killed before it started: the message waits out Redis's visibility timeout)
FINISH_QUEUED_S = 900

# a candidate waiting on a build queue that no live builder serves (the last builder's key lapsed, or its
# agent saw it exit): sent to a lane, which builds it itself, after this long. Its death is already proven,
# so this only covers a builder its agent is restarting; a lane building meanwhile loses nothing
NO_BUILDER_GRACE_S = HEARTBEAT_S

# ---- re-sends: only once the hold they replace has lapsed, so a live owner is never second-guessed ----------
# a pending shard whose message nobody took (queue empty): well past a lease, so a client that took the
# message and is starting (its lease not yet taken) is not raced
STRANDED_AFTER_S = 90
# a job awaiting its plan that no planner holds (no lease, plan queue empty), this long after its last send:
# past a plan lease, so a planner killed mid-plan costs seconds, not Redis's 1 h visibility timeout
STRANDED_PLAN_S = 20

# ---- one candidate on a lane ---------------------------------------------------------------------------------
RUN_TIMEOUT_S = 60.0  # a candidate's build and run, each (TimingConfig.timeout_s)
# past its allowance (GPU lanes: the build wait from the pool, then the run), a kernel that has not returned
# is hung: the lane reports it and exits
WATCHDOG_MARGIN_S = 15.0
GATE_SLACK_S = 5.0  # a suspect's hold on its GPU's gate outlives its watchdog by this much


def watchdog_allowance_s(timeout_s: float, builds_in_pool: bool) -> float:
    """A GPU lane waits up to `timeout_s` for a candidate's build from its pool, then runs it for up to
    `timeout_s`; in-process it builds and runs within one."""
    return timeout_s * (2 if builds_in_pool else 1)


def gate_hold_s(timeout_s: float, builds_in_pool: bool, watchdog_margin_s: float = WATCHDOG_MARGIN_S) -> float:
    """How long an entry of a GPU's gate (a suspect alone, or a candidate running beside others) holds: past
    the watchdog that ends a hung candidate's lane, so the gate never lapses while its kernel still spins and
    another suspect never runs beside it; a lane that died holding it blocks the GPU no longer than this."""
    return watchdog_allowance_s(timeout_s, builds_in_pool) + watchdog_margin_s + GATE_SLACK_S


# ---- a batch -----------------------------------------------------------------------------------------------
# extra time a started batch gets before its unanswered candidates count as lost and are re-sent: past a lane
# coming back (a GPU recovery: ~20 s on the H200) and a candidate's full timing
BATCH_GRACE_S = 120.0
# a job's measured trials count toward its fair share for about this long: halved every MEASURED_HALF_LIFE_S
# (store.measured_by_job), so the jobs' shares follow their recent rates
MEASURED_HALF_LIFE_S = 60.0

# Redis's visibility timeout: an unacknowledged message (its worker died) returns to its queue after this long,
# so it must outlast the longest batch a live lane can take (16 candidates x the run timeout x 2 crash retries
# is 32 min at the defaults). A dead worker's message coming back this late is recognised and dropped (a plan
# by its token, a batch whose job ended or that a lane already started), and the reaper re-sends what a dead
# tuner or planner held within seconds: nothing waits for it.
VISIBILITY_TIMEOUT_S = 3600

# ---- what outlives a job --------------------------------------------------------------------------------------
RESULT_TTL_S = 24 * 3600  # a batch's results and a lane's batch log (x30) in the store
# an ended job's model and running state: past a cancelled job's finishing step, which reads its model
ENDED_JOB_STATE_TTL_S = 3600

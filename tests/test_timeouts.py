"""The orders shared/timeouts.py promises, checked: each hold outlives the beats that renew it, each re-send
waits past the hold it replaces, a GPU gate outlives the watchdog of the candidate holding it."""
from shared import timeouts as t


def test_every_hold_is_renewed_several_times_before_it_lapses():
    assert t.HEARTBEAT_S * 3 <= t.LANE_TTL_S
    assert t.LEASE_RENEW_S * 3 <= t.LEASE_TTL_S
    assert t.PLAN_LEASE_RENEW_S * 3 <= t.PLAN_LEASE_TTL_S


def test_a_re_send_waits_past_the_hold_it_replaces():
    assert t.STRANDED_AFTER_S > t.LEASE_TTL_S + t.LANE_TTL_S
    assert t.STRANDED_PLAN_S > t.PLAN_LEASE_TTL_S


def test_a_gpu_gate_outlives_the_watchdog_of_the_candidate_holding_it():
    """Before, the gate held timeout + 30 s while a pooled GPU lane's watchdog allowed 2 x timeout + margin:
    at the 60 s default a hung suspect's gate lapsed at 90 s, before its watchdog fired at 135 s."""
    for timeout in (2.0, 10.0, t.RUN_TIMEOUT_S, 300.0):
        for pooled in (False, True):
            for margin in (5.0, t.WATCHDOG_MARGIN_S):
                assert t.gate_hold_s(timeout, pooled, margin) > t.watchdog_allowance_s(timeout, pooled) + margin


def test_a_batch_is_given_up_only_after_a_candidate_and_a_lane_restart():
    assert t.BATCH_GRACE_S > t.RUN_TIMEOUT_S and t.BATCH_GRACE_S > t.LANE_TTL_S
    assert t.ENDED_JOB_STATE_TTL_S < t.RESULT_TTL_S


def test_a_live_lanes_longest_batch_never_comes_back_to_its_queue():
    assert t.VISIBILITY_TIMEOUT_S > 16 * t.RUN_TIMEOUT_S * 2 + t.BATCH_GRACE_S


def test_a_candidate_waits_for_a_restarting_builder_one_beat_not_a_second_ttl():
    """The last builder's key has lapsed (or its agent saw it exit) before this clock starts: its death is
    proven, so the wait covers only a restart announcing itself, and the lane builds meanwhile."""
    assert t.HEARTBEAT_S <= t.NO_BUILDER_GRACE_S < t.LANE_TTL_S

"""A batch's watch in the tuner (lane_runner.BatchWatch) after the Redis server restarts: a batch no lane had
started is sent again (its message may have been lost with the writes the AOF had not synced, or held by a consumer
whose connection dropped); one a lane started is left to the lane's own checks. A real Redis; the runner's view of
the server's start is given."""
from __future__ import annotations

from shared import store
from shared.messages import Candidate, MeasureBatch, TimingConfig


class _Runner:
    def __init__(self, r):
        self.redis, self.timing, self.grace_s, self.boot, self.sent = r, TimingConfig(), 30.0, "first", []

    def server_boot(self):
        return self.boot

    def live_queue(self):
        return "measure.q2"

    def send(self, batch, queue):
        self.sent.append((batch.batch_id, queue))

    def builders_missing_since(self):
        return None


def _watch(runner, batch_id):
    from services.tuner.metaschedule.lane_runner import BatchWatch

    batch = MeasureBatch(batch_id=batch_id, job_id="j", target="{}", timing=TimingConfig(),
                         candidates=[Candidate(candidate_id=f"{batch_id}-c", mod="m", args_info=[])])
    return BatchWatch(runner, batch, "measure.q1")


def _poll(watch):
    watch._checked_at = 0.0  # past the health-check interval
    watch.poll()


def test_a_batch_no_lane_started_is_sent_again_after_the_redis_server_restarts(tmp_path):
    from services.broker.server import EmbeddedRedis

    with EmbeddedRedis(tmp_path / "redis") as srv:
        r = store.connect(srv.url)
        boot = store.server_boot(r)
        assert boot and store.server_boot(r) == boot  # the same start, asked twice
        runner = _Runner(r)
        waiting, started = _watch(runner, "b-waiting"), _watch(runner, "b-started")
        store.mark_batch_started(r, "b-started", "measure.q1", None, "j", 1)
        _poll(waiting)
        _poll(started)
        assert runner.sent == []  # the same server: nothing to suspect
        runner.boot = "second"
        _poll(started)
        assert runner.sent == []  # a lane has it: its worker's liveness and the timeout decide
        _poll(waiting)
        assert runner.sent == [(waiting.batch.batch_id, "measure.q2")] and waiting.batch.batch_id != "b-waiting"
        assert store.resend_counts(r, "j") == {"broker-restarted": 1}
        _poll(waiting)
        assert len(runner.sent) == 1  # sent again once per restart

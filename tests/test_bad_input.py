"""Bad input gets a clear error naming the problem, and nothing already recorded is lost."""
import time

import pytest

from shared import names, store
from shared.errors import ModelError, ShareError, TargetError

pytestmark = pytest.mark.e2e


def _all_record_counts(redis_conn):
    return {k: redis_conn.hlen(k) for k in redis_conn.scan_iter(match=f"{names.PREFIX}:rec:*")}


@pytest.fixture
def records_before(tuned_tiny, redis_conn):
    before = _all_record_counts(redis_conn)
    assert before
    yield before
    after = _all_record_counts(redis_conn)
    for key, n in before.items():
        assert after.get(key, 0) >= n, f"records lost under {key}"


@pytest.mark.parametrize("share", [0, 150])
def test_share_outside_range(client, records_before, share):
    with pytest.raises(ShareError, match=f"1..100, got {share}"):
        client.submit("tiny", target="llvm", share=share, trials=4)


def test_unknown_target(client, records_before):
    with pytest.raises(TargetError, match="unknown target 'tpu'"):
        client.submit("tiny", target="tpu", share=50, trials=4)


def test_corrupt_onnx(client, lane_share, records_before, tmp_path):
    bad = tmp_path / "broken.onnx"
    bad.write_bytes(b"\x08\x07this is not a protobuf" * 10)
    with pytest.raises(ModelError, match="ONNX"):
        client.submit(str(bad), target="llvm", share=lane_share, trials=4)


def test_unsupported_onnx_operator(client, lane_share, records_before):
    from onnx import TensorProto, helper

    node = helper.make_node("FooBarOp", ["x"], ["y"])
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(ModelError, match="FooBarOp"):
        client.submit(model.SerializeToString(), target="llvm", share=lane_share, trials=4)


def test_model_with_no_tunable_operator_fails_the_job_clearly(client, lane_share, records_before):
    from onnx import TensorProto, helper

    node = helper.make_node("Identity", ["x"], ["y"])
    graph = helper.make_graph([node], "only_identity", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    job = client.submit(model, target="llvm", share=lane_share, trials=4)
    final = job.wait(timeout_s=300)
    assert final["state"] == "failed"
    assert "no tunable operator" in final["error"]


def test_job_at_a_share_no_lane_serves_fails_clearly(stack, client, records_before):
    # 7 % is a valid share, but no lane of this stack serves it: the planner says so once its wait is over
    # (lane_wait_s=0: over at once; before that the job is parked, see test_operator.py).
    from shared.messages import JobSpec

    r = client.redis
    spec = JobSpec(job_id="noshare1", target="llvm", share=7, trials=4)
    from services.tuner.metaschedule.ir_codec import dump_ir
    from sharetune.intake import to_relax

    store.create_job(r, spec, dump_ir(to_relax("tiny").mod).encode())
    # plan directly with a short wait rather than through the worker's long default
    from services.tuner import planner
    from shared.lanes import LiveLanePolicy

    with pytest.raises(ShareError, match="no live measurer lane serves cpu at 7 %"):
        planner.plan(r, "noshare1", LiveLanePolicy(park_s=0))


def test_malformed_message_on_a_lane_queue_is_answered(client, redis_conn, records_before):
    lane = client.lanes()[0].queue
    before = redis_conn.llen(names.DEADLETTER_KEY)
    bad = {"batch_id": "bad-batch-1", "candidates": [{"candidate_id": "c1", "mod": 42}]}
    client.app.send_task(names.MEASURE_TASK, args=[bad], queue=lane)
    deadline = time.time() + 120
    while time.time() < deadline:
        _, results = store.batch_results(redis_conn, "bad-batch-1")
        if "c1" in results:
            break
        time.sleep(0.2)
    assert "malformed MeasureBatch" in results["c1"].error
    assert redis_conn.llen(names.DEADLETTER_KEY) == before + 1
    assert store.lane_alive(redis_conn, lane)


def test_malformed_message_on_the_plan_queue_is_dead_lettered(client, redis_conn, records_before):
    before = redis_conn.llen(names.DEADLETTER_KEY)
    client.app.send_task(names.PLAN_TASK, args=[{"job": "x"}], queue=names.PLAN_QUEUE)
    deadline = time.time() + 60
    while time.time() < deadline and redis_conn.llen(names.DEADLETTER_KEY) == before:
        time.sleep(0.2)
    import json

    entry = json.loads(redis_conn.lindex(names.DEADLETTER_KEY, -1))
    assert entry["source"] == names.PLAN_QUEUE and "malformed JobRef" in entry["why"]


def test_candidate_that_fails_to_build_comes_back_as_an_error(client, redis_conn, records_before):
    from shared.packed_json import pack_json_text
    from shared.messages import Candidate, MeasureBatch

    lane = client.lanes()[0]
    batch = MeasureBatch(batch_id="broken-build-1", job_id="t", target=lane.target,
                         candidates=[Candidate(candidate_id="c1", mod=pack_json_text('{"not": "tvm"}'),
                                               args_info=[["TENSOR", "float32", [4]]])])
    client.app.send_task(names.MEASURE_TASK, args=[batch.model_dump(mode="json")], queue=lane.queue)
    deadline = time.time() + 120
    results = {}
    while time.time() < deadline and "c1" not in results:
        _, results = store.batch_results(redis_conn, "broken-build-1")
        time.sleep(0.2)
    assert results["c1"].error.startswith("build failed")
    assert results["c1"].lane == lane.queue
    assert store.lane_alive(redis_conn, lane.queue)


HUNDRED_MB = 100 * 1024 * 1024


def test_a_100_mb_model_is_refused_at_submit(client, records_before, tmp_path):
    with pytest.raises(ModelError, match="over the limit of 67108864 bytes"):
        client.submit(b"\x08" * HUNDRED_MB, target="llvm", share=50, trials=4)
    big = tmp_path / "big.onnx"
    with open(big, "wb") as f:
        f.truncate(HUNDRED_MB)
    with pytest.raises(ModelError, match="over the limit"):
        client.submit(str(big), target="llvm", share=50, trials=4)


def _last_dead_letter(redis_conn, before, timeout_s=120):
    import json

    deadline = time.time() + timeout_s
    while time.time() < deadline and redis_conn.llen(names.DEADLETTER_KEY) == before:
        time.sleep(0.2)
    assert redis_conn.llen(names.DEADLETTER_KEY) > before, "nothing was dead-lettered"
    return json.loads(redis_conn.lindex(names.DEADLETTER_KEY, -1))


def test_a_100_mb_message_is_refused_by_the_store_and_the_lane_serves_on(client, redis_conn, records_before):
    """The embedded Redis takes no value over 96 MiB: the publisher is told at once, nothing is queued (an
    entry over the message cap that fits in Redis is refused by the lane's guard: tests/test_queue_entries.py)."""
    from kombu.exceptions import OperationalError

    lane = client.lanes()[0]
    worker = lane.worker
    with pytest.raises(OperationalError):
        client.app.send_task(names.MEASURE_TASK, args=[{"batch_id": "huge-1", "pad": "x" * HUNDRED_MB}],
                             queue=lane.queue, retry=False)
    assert redis_conn.llen(lane.queue) == 0
    assert any(l.worker == worker for l in client.lanes())  # the same lane process serves on


def test_a_pickled_message_on_a_lane_queue_is_refused_not_unpickled(client, redis_conn, records_before, tmp_path):
    lane = client.lanes()[0]
    worker = lane.worker
    before = redis_conn.llen(names.DEADLETTER_KEY)
    marker = tmp_path / "unpickled"

    class Bomb:  # unpickling this would create the marker file
        def __reduce__(self):
            return (open, (str(marker), "w"))

    # a hostile producer's message, published raw: no Celery app of ours ever serialises with pickle
    import pickle
    import uuid

    task_id = uuid.uuid4().hex
    with client.app.connection_for_write() as conn:
        conn.Producer().publish(
            pickle.dumps(((Bomb(),), {}, {})), routing_key=lane.queue, content_type="application/x-python-serialize",
            content_encoding="binary", headers={"lang": "py", "task": names.MEASURE_TASK, "id": task_id,
                                                "root_id": task_id, "parent_id": None, "group": None})
    entry = _last_dead_letter(redis_conn, before)
    assert entry["source"] == lane.queue and "pickle" in entry["why"] and entry["body"] == ""
    assert not marker.exists()
    assert any(l.worker == worker for l in client.lanes())

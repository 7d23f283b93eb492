"""Several jobs at once share the stack's tuner clients: jobs submitted while the clients are busy with a long
job are tuned to their budgets while it still runs (clients take turns), and every trial is recorded. How
evenly jobs share the lanes at scale: bench/scale_h200.py's multi-job run."""
from __future__ import annotations

import time

from shared import store
from shared.messages import FINAL_STATES, measurement_shares

JOBS, TRIALS, PER_ITER = 4, 16, 8


def _matmul_model(k: int) -> bytes:
    """An ONNX model of one small matmul whose shape the rest of the suite never tunes: each job a fresh
    workload with a real design space, and no records of earlier tests to seed or answer it from."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, k])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 24])
    w = numpy_helper.from_array(np.random.default_rng(k).standard_normal((k, 24)).astype("float32"), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], f"mm{k}", [x], [y], [w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def _measured(redis_conn, job) -> list[float]:
    return [rec.measured_at for task in store.job_tasks(redis_conn, job.job_id)
            for rec in store.records(redis_conn, task.wkey) if rec.job_id == job.job_id]


def test_jobs_submitted_while_the_clients_are_busy_do_not_wait_for_the_busy_job(client, redis_conn, lane_share):
    options = dict(target="llvm", share=lane_share, trials_per_iter=PER_ITER, clients=1, untuned_baseline=False)
    busy = client.submit(_matmul_model(60), trials=5000, seed=9, name="multi-busy", **options)  # minutes of work
    deadline = time.time() + 600
    while not _measured(redis_conn, busy):  # it holds the clients
        assert time.time() < deadline and busy.state()["state"] not in FINAL_STATES, busy.status()
        time.sleep(0.2)
    later = [client.submit(_matmul_model(52 + i), trials=TRIALS, seed=10 + i, name=f"multi-{i}", **options)
             for i in range(JOBS - 1)]
    finals = [job.wait(timeout_s=1200) for job in later]
    assert [f["state"] for f in finals] == ["done"] * (JOBS - 1), finals
    # they took turns with the busy job instead of waiting for it to spend its budget
    assert busy.state()["state"] == "tuning", busy.status()
    busy.cancel()
    assert busy.wait(timeout_s=600)["state"] == "cancelled"
    for job in later:
        acc = store.trial_accounting(redis_conn, job.job_id)
        assert job.status()["trials"] == TRIALS
        assert acc["recorded"] == acc["claimed"] == TRIALS, acc
    acc = store.trial_accounting(redis_conn, busy.job_id)
    assert acc["lost"] == 0 and acc["recorded"] == len(_measured(redis_conn, busy)), acc
    shares = measurement_shares({job.job_id: _measured(redis_conn, job) for job in [busy, *later]})
    print({"multi_job": {k: v for k, v in shares.items() if k != "first_measured_at"}})


def test_shares_count_the_window_in_which_every_job_measured_and_each_jobs_trials_every_10_s():
    out = measurement_shares({"a": [0.0, 1.0, 2.0, 15.0, 25.0], "b": [5.0, 12.0, 13.0, 22.0]})
    assert out["window_s"] == 17.0  # b's first trial to b's last, the first job to end
    assert out["share"] == {"a": 0.2, "b": 0.8} and out["share_spread"] == 0.6
    assert out["per_10s"] == {"a": [3, 1, 1], "b": [1, 2, 1]}
    assert measurement_shares({"a": [1.0], "b": []})["share"] is None  # they never measured at once

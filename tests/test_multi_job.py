"""Several jobs submitted at once share the stack's tuner clients and lanes: every one finishes with its
budget recorded, a job submitted while the clients are busy starts before the earlier ones end (clients take
turns after their quantum). How evenly they share the lanes at scale: bench/scale_h200.py's multi-job run."""
from __future__ import annotations

from shared import store
from shared.messages import measurement_shares

JOBS, TRIALS, PER_ITER = 4, 40, 8


def test_four_jobs_at_once_all_finish_and_share_the_lanes(client, redis_conn, lane_share):
    jobs = []
    for seed in range(JOBS):  # back to back: the clients are all busy when the later ones arrive
        jobs.append(client.submit("tiny", target="llvm", share=lane_share, trials=TRIALS, trials_per_iter=PER_ITER,
                                  seed=10 + seed, clients=1, name=f"multi-{seed}", untuned_baseline=False))
    finals = [job.wait(timeout_s=1200) for job in jobs]
    assert [f["state"] for f in finals] == ["done"] * JOBS, finals
    for job in jobs:
        acc = store.trial_accounting(redis_conn, job.job_id)
        assert job.status()["trials"] == TRIALS
        assert acc["recorded"] == acc["claimed"] == TRIALS, acc
    measured = {job.job_id: [rec.measured_at for task in store.job_tasks(redis_conn, job.job_id)
                             for rec in store.records(redis_conn, task.wkey) if rec.job_id == job.job_id]
                for job in jobs}
    shares = measurement_shares(measured)
    first, last = measured[jobs[0].job_id], measured[jobs[-1].job_id]
    # the last job submitted measured before the first one ended: it did not wait for the jobs ahead of it
    assert min(last) < max(first), shares
    # the clients took turns: one after another, the jobs' trials would come in exactly JOBS runs
    order = [job for _, job in sorted((t, job) for job, ts in measured.items() for t in ts)]
    runs = 1 + sum(a != b for a, b in zip(order, order[1:]))
    assert runs > JOBS, (runs, shares)
    print({"multi_job": {k: v for k, v in shares.items() if k != "first_measured_at"}, "runs": runs,
           "last_started_after_first_s": round(min(last) - min(first), 1)})

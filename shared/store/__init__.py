"""Redis is the only shared state, and this module its only client: every Redis command of the services,
the client and the CLI is one of the functions of its modules (tests/test_store_races.py checks that no module
outside this package calls Redis). They read and write through the contracts in shared.messages; every write is
idempotent (keys derive from content), so a re-delivered message or a restarted process cannot duplicate
or lose what is already recorded. Whatever is held by one owner (a shard's lease, a lane's claim, a GPU's
gate) is renewed and released only by its owner, atomically (a Lua compare-and-expire/delete): an owner
whose hold expired and was retaken never deletes its successor's. Callers pass the connection.

One module per aggregate: jobs (spec, state, plan, tasks, budget, retention), leases (shard leases, lane claims,
GPU gates, shards), records (workloads, records, defaults, trial accounting), liveness (node agents, lanes, builders,
tuner clients, GPUs given up), results (batch results, poison candidates, GPU faults), costmodels (training rows,
snapshots). Callers use this package's names: `from shared import store; store.create_job(...)`."""
from shared.store._redis import (connect, connect_probe, masked_url, note_unreachable, outage_since,  # noqa: F401
                                 REDIS_OUTAGE_S, unreachable)
from shared.store.jobs import (  # noqa: F401
    active_jobs, budget_left, cancel_job, claim_finish, claim_trials, clear_job_fields, create_job, in_flight_by_job,
    count_measured, fair_loads, measured_by_job,
    deactivate_job, decide_ranked_first_rounds, expire_transient, first_rounds_claimed, history, hold_finish,
    job_cancelled, job_hash, job_model, job_progress,
    job_result, job_spec, job_state, job_status, job_tasks, jobs, mark_estimate, memory, parked_since, plan_current,
    job_bytes, plan_sent, planned, planning_jobs, prune_jobs, push_history, put_progress, put_searched, put_split,
    put_tasks, searched,
    reclaim_stranded_finish, refund_claim, release_plan_lease, renew_plan_lease, replace_stranded_plan,
    set_result, set_state, settle_claim, splits, stop_search, take_plan_lease, update_job
)
from shared.store.leases import (  # noqa: F401
    claim_requeue, claim_slot, clear_gpu_isolation, count_suspect_run, enter_gpu_running, finish_shard,
    gpu_running, lease_owner, leave_gpu_running, put_shards, refresh_claim, release_claim,
    release_gpu_gate, release_lease, renew_lease, renew_lease_as, set_gpu_running, shards, suspect_runs, take_gpu_gate,
    take_lease, update_shard
)
from shared.store.records import (  # noqa: F401
    CANCELLED, default_timing, default_timings, has_records, known_records, put_default, put_record, put_reference,
    put_workload, references,
    record_count, record_round, records, replace_record, similar_workloads, trial_accounting, valid_record, workload
)
from shared.store.liveness import (  # noqa: F401
    announce_agent, announce_builder, announce_lane, announce_service, announce_tuner, builder_alive, forget_worker,
    give_up_gpu, gpus_down, host_liveness_key, lane_alive, lane_worker_alive, live_agents, live_builders, live_lanes,
    live_services, live_tuners, mark_batch_building, queue_length, retire_agent, retire_builder, retire_lane,
    retire_service, retire_tuner, server_boot
)
from shared.store.results import (  # noqa: F401
    batch_progress, batch_results, batch_started, candidate_hash, crash_clear, crash_count,
    crash_pending, dead_letter, DEADLETTER_KEEP, gpu_faults, lane_batches, live_bests, log_lane_batch, lower_live_best,
    mark_batch_started, note_resend, put_result, quarantine, quarantined, quarantined_all, report_gpu_fault,
    resend_counts, resends
)
from shared.store.costmodels import (  # noqa: F401
    best_rows, best_rows_of, newest_training_rows, next_snapshot_version, push_training_rows,
    put_best_rows, put_snapshot, snapshot, snapshot_version, training_row_count
)

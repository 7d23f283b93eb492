"""Real programs that crash or hang, and helpers that send them to lanes and read back what happened: shared
by the fault tests (tests/test_faults.py, test_poison.py, ...) and the fault benchmarks (bench/gpu_fault.py,
bench/chaos.py), with the GPU benchmark's own programs and figures.

Each program is a genuine TVM PrimFunc: the run-time segfault writes 4 GiB past its buffer, the hang runs
2^40 iterations. Only the build segfault needs the lane's test hook (LaneSettings.test_fault_hooks): no
TVM input crashes the compiler on cue. `salt` makes a distinct program, so each test meets a candidate
with no crash history in the session's Redis."""
from __future__ import annotations

import json
import time

from shared import names, store
from shared.messages import FINAL_STATES, Candidate, JobState, MeasureBatch, TimingConfig

ARGS = [["TENSOR", "float32", [16]], ["TENSOR", "float32", [16]]]


def candidate(func, cid: str, name: str = "main", args_info=None) -> Candidate:
    """A PrimFunc as a lane's candidate (its arguments: two 16-float tensors unless `args_info` says)."""
    import tvm

    from services.measurer.metaschedule.candidate_codec import dump_ir

    return Candidate(candidate_id=cid, mod=dump_ir(tvm.IRModule({name: func.with_attr("global_symbol", name)})),
                     args_info=args_info or ARGS)


def good(cid: str, salt: int = 0) -> Candidate:
    from tvm.script import tirx as T

    @T.prim_func
    def f(A: T.Buffer((16,), "float32"), B: T.Buffer((16,), "float32")):
        for i in range(16):
            B[i] = A[i] + T.float32(salt)

    return candidate(f, cid)


def segv_at_run(cid: str, salt: int = 0) -> Candidate:
    from tvm.script import tirx as T

    @T.prim_func
    def f(A: T.Buffer((16,), "float32"), B: T.Buffer((16,), "float32")):
        for i in range(16):
            B[i + 1073741824] = A[i] + T.float32(salt)  # 4 GiB past the end: unmapped, SIGSEGV

    return candidate(f, cid)


def hang_at_run(cid: str, salt: int = 0) -> Candidate:
    from tvm.script import tirx as T

    @T.prim_func
    def f(A: T.Buffer((16,), "float32"), B: T.Buffer((16,), "float32")):
        for i in T.serial(T.int64(1099511627776)):  # 2^40 dependent iterations: hours
            B[i % T.int64(16)] = B[i % T.int64(16)] * A[(i + T.int64(1)) % T.int64(16)] + T.float32(salt)

    return candidate(f, cid)


def segv_at_build(cid: str, salt: int = 0) -> Candidate:
    from tvm.script import tirx as T

    from services.measurer.metaschedule.sandbox import TEST_SEGV_BUILD

    @T.prim_func
    def f(A: T.Buffer((16,), "float32"), B: T.Buffer((16,), "float32")):
        for i in range(16):
            B[i] = A[i] * T.float32(salt)

    return candidate(f, cid, name=f"{TEST_SEGV_BUILD}_{salt}")


def send_batch(client, lane, candidates, batch_id: str, timeout_s: float = 30.0, job_id: str = "faults") -> None:
    batch = MeasureBatch(batch_id=batch_id, job_id=job_id, target=lane.target,
                         timing=TimingConfig(min_repeat_ms=0, timeout_s=timeout_s), candidates=candidates)
    client.app.send_task(names.MEASURE_TASK, args=[batch.model_dump(mode="json")], queue=lane.queue)


def wait_results(redis_conn, batch_id: str, ids, timeout_s: float = 300.0) -> dict:
    deadline = time.time() + timeout_s
    results = {}
    while time.time() < deadline:
        _, results = store.batch_results(redis_conn, batch_id)
        if set(ids) <= results.keys():
            return results
        time.sleep(0.2)
    raise TimeoutError(f"batch {batch_id}: only {sorted(results)} of {sorted(ids)} answered in {timeout_s} s")


def conv_only(redis_conn, tuned_job) -> list[str]:
    return [t.name for t in store.job_tasks(redis_conn, tuned_job.job_id) if "conv2d" in t.name]


def batch_in_flight(redis_conn, before, job_id, timeout_s=300):
    """A started batch of the job with at most one result written: (its key, its _started info). A job that
    ends first fails this at once, with its state (no use waiting out the timeout)."""
    deadline = time.time() + timeout_s
    state_at = 0.0
    while time.time() < deadline:
        for key in set(redis_conn.scan_iter(match=f"{names.PREFIX}:batch:*")) - before:
            started = redis_conn.hget(key, "_started")
            if started and redis_conn.hlen(key) - 1 < 2:
                info = json.loads(started)
                if info.get("job_id") == job_id:
                    return key, info
        if time.time() - state_at > 0.5:
            state_at = time.time()
            state = store.job_state(redis_conn, job_id)
            if state.get("state") in FINAL_STATES:
                raise AssertionError(f"job {job_id} ended before a batch of it was seen in flight: {state}")
        time.sleep(0.005)
    raise AssertionError("no batch was seen in flight")


def lane_worker(redis_conn, queue: str) -> str:
    return next(l.worker for l in store.live_lanes(redis_conn) if l.queue == queue)


def job_figures(redis_conn, job, budget: int) -> dict:
    """jobs_completed / candidates_lost / trials_respent of one finished job, from the store:
    lost = trials the job claimed from its budget with no record of them (shared.store.trial_accounting),
    or the whole budget if the job did not finish; lane_errors = records that came back without a
    measurement because a lane died or overran (their records say so). Re-spent = candidates started in
    more than one batch (a killed batch's unanswered ones, measured again)."""
    st = job.state()
    trials = job.status()["trials"]
    recs = [r for t in store.job_tasks(redis_conn, job.job_id) for r in store.records(redis_conn, t.wkey)
            if r.job_id == job.job_id]
    lane_lost = sum(1 for r in recs if r.error and ("lane " in r.error or "timed out" in r.error))
    started = 0
    for key in redis_conn.scan_iter(match=f"{names.PREFIX}:batch:*"):
        raw = redis_conn.hget(key, "_started")
        if raw:
            info = json.loads(raw)
            if info.get("job_id") == job.job_id:
                started += int(info.get("candidates") or 0)
    accounting = store.trial_accounting(redis_conn, job.job_id)
    return {"jobs_completed": int(st.get("state") == JobState.DONE),
            "candidates_lost": accounting["lost"] if st.get("state") == JobState.DONE else budget,
            "lane_errors": lane_lost, "claimed": accounting["claimed"], "recorded": accounting["recorded"],
            "trials_respent": max(0, started - trials), "trials": trials}


def job_audit(r, job_id: str) -> dict:
    """One job's end, from the store: its state and reason, and where its trials went (the chaos soak's audit)."""
    st = store.job_state(r, job_id)
    acc = store.trial_accounting(r, job_id) or {}
    recs = [x for t in store.job_tasks(r, job_id) for x in store.records(r, t.wkey) if x.job_id == job_id]
    keys = [(rec.wkey, rec.candidate_key) for rec in recs]
    # a record twice (the store keys them by candidate, so only a second key could) or more records than
    # trials claimed (a trial counted twice)
    duplicated = len(keys) - len(set(keys)) + max(0, len(recs) - (acc.get("claimed") or len(recs)))
    return {"job_id": job_id, "state": st.get("state"), "error": st.get("error"),
            "claimed": acc.get("claimed"), "recorded": acc.get("recorded"), "lost": acc.get("lost"),
            "resends": acc.get("resends"), "records": len(recs), "duplicated": duplicated}


def record_row(path: str | None, row: dict) -> None:
    """Append a figures row for bench/faults.py to `path`, the file it asks for (FaultFiguresSettings.faults_out,
    SHARETUNE_FAULTS_OUT; None: not asked, nothing written)."""
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")


# GPU programs of the GPU fault benchmark (bench/gpu_fault.py): two 1024-float tensors each
GPU_ARGS = [["TENSOR", "float32", [1024]]] * 2


def faulting_candidate(cid: str):
    from tvm.script import tirx as T

    @T.prim_func
    def f(A: T.Buffer((1024,), "float32"), B: T.Buffer((1024,), "float32")):
        for bx in T.thread_binding(8, thread="blockIdx.x"):
            for tx in T.thread_binding(128, thread="threadIdx.x"):
                B[T.Cast("int64", bx * 128 + tx) + T.int64(1099511627776)] = A[bx * 128 + tx]

    return candidate(f, cid, args_info=GPU_ARGS)


def hanging_candidate(cid: str):
    """2^40 dependent multiply-adds per thread (~40 min on an H200): it spins past any timeout. A finite
    loop whose result is stored, so the CUDA compiler may not delete it as an infinite loop without effects."""
    from tvm.script import tirx as T

    @T.prim_func
    def f(A: T.Buffer((1024,), "float32"), B: T.Buffer((1024,), "float32")):
        for bx in T.thread_binding(8, thread="blockIdx.x"):
            for tx in T.thread_binding(128, thread="threadIdx.x"):
                for i in T.serial(T.int64(1099511627776)):
                    B[bx * 128 + tx] = B[bx * 128 + tx] * A[bx * 128 + tx] + T.float32(1)

    return candidate(f, cid, args_info=GPU_ARGS)


def oversized_launch_candidate(cid: str):
    """256 KiB of dynamic shared memory per block, past the H200's 227 KiB: the launch is refused (an
    ordinary, non-sticky error; the context lives on)."""
    from tvm.script import tirx as T

    @T.prim_func
    def f(A: T.Buffer((1024,), "float32"), B: T.Buffer((1024,), "float32")):
        for bx in T.thread_binding(8, thread="blockIdx.x"):
            for tx in T.thread_binding(128, thread="threadIdx.x"):
                S = T.alloc_buffer((65536,), "float32", scope="shared.dyn")
                S[tx * 512] = A[bx * 128 + tx]
                B[bx * 128 + tx] = S[tx * 512]

    return candidate(f, cid, args_info=GPU_ARGS)


# the GPU fault benchmark's figures, from what the store and the supervisor saw
def phase_times(phases: dict) -> dict:
    """A recovery's phase times as seconds after its fault (or after its detection, with no report)."""
    t0 = phases.get("fault_at") or phases.get("detected_at")
    keys = ("detected_at", "clients_ended_at", "mps_restarted_at", "lanes_started_at", "lanes_live_at",
            "first_batch_at")
    return {k.removesuffix("_at") + "_s": (round(phases[k] - t0, 2) if phases.get(k) and t0 else None) for k in keys}


def recovery_s(phases: dict) -> float | None:
    """First fault -> the GPU's lanes measuring again (a batch answered, else all lanes live again)."""
    t0 = phases.get("fault_at") or phases.get("detected_at")
    back = phases.get("first_batch_at") or phases.get("lanes_live_at")
    return round(back - t0, 2) if t0 and back else None


def row_figures(row: dict, quarantined: list[dict], recoveries: list[dict], gpu8: str | None) -> dict:
    """A row's figures from what the store and the supervisor saw during it: quarantine entries other than
    the culprit's are innocents; the recoveries of the faulted GPU that began inside the row."""
    start, end = row["started_at"], row.get("ended_at", float("inf"))
    in_row = [q for q in quarantined if start <= q["at"] <= end]
    row["culprit_quarantined"] = any(q["candidate_hash"] == row["culprit"] for q in quarantined)
    row["innocents_quarantined"] = sum(1 for q in in_row if q["candidate_hash"] != row["culprit"])
    phases = [e["phases"][gpu8] for e in recoveries
              if gpu8 and gpu8 in e.get("phases", {}) and start <= e["detected_at"] <= end]
    row["recoveries"] = [phase_times(p) for p in phases]
    row["recovery_s"] = recovery_s(phases[0]) if phases else None
    return row


def bystander_figures(batches, start: float, end: float) -> dict:
    """The bystander's trials measured while a row ran, and its longest wait for an answered batch inside the
    row (from the row's start, between batches, to the row's end while it still had work): a stall shows."""
    done = sorted(b.finished_at for b in batches)
    inside = [b for b in batches if start <= b.finished_at <= end]
    marks = [start] + [t for t in done if start <= t <= end] + ([end] if done and done[-1] > end else [])
    return {"bystander_trials": sum(b.candidates - b.errors for b in inside),
            "bystander_max_gap_s": round(max((b - a for a, b in zip(marks, marks[1:])), default=0.0), 2)
            if done and done[-1] > start else None}


def plan_lanes(uuids: list[str], cores: int) -> dict:
    """The GPU fault benchmark's lane queues: GPU 0 at 4x25 % (job A, where faults are injected) and one CPU lane
    on the last core (the bystander). The rehearsal (no GPU): two CPU lanes, job A's injections on the first."""
    from shared import lanes as lane_kinds
    from shared.ids import gpu8

    from shared.settings import HostSettings

    host = HostSettings().host()

    def queue(q: str) -> str:  # the lane's full queue name on this host (a CPU lane's carries its share)
        return lane_kinds.parse(q, host).queue

    if not uuids:
        cpus = [queue("measure.cpu.c0"), queue("measure.cpu.c1")] if cores >= 2 else [queue("measure.cpu.c0")]
        return {"faulted": cpus[0], "faulted_gpu8": None, "lanes": cpus, "bystander": cpus[-1]}
    u8 = gpu8(uuids[0])
    gpu, cpu = queue(f"measure.{u8}.p25"), queue(f"measure.cpu.c{cores - 1}")
    return {"faulted": gpu, "faulted_gpu8": u8, "lanes": [gpu] * 4 + [cpu], "bystander": cpu}


def gpu_fault_table(rows: list[dict]) -> str:
    """The GPU fault benchmark's rows as the table it prints."""
    lines = [f"{'row':16} {'done':>4} {'culprit_q':>9} {'innocent_q':>10} {'lost':>4} {'reruns':>6} {'recovery_s':>10} "
             f"{'bystander':>9} {'by_gap_s':>8}"]
    for row in rows:
        lines.append(f"{row['scenario']:16} {row['jobs_completed']:>4} {str(row['culprit_quarantined']):>9} "
                     f"{row['innocents_quarantined']:>10} {row['lost_candidates']:>4} {row['suspect_reruns']:>6} "
                     f"{str(row['recovery_s']):>10} {row['bystander_trials']:>9} {str(row['bystander_max_gap_s']):>8}")
    return "\n".join(lines)


# the CPU fault benchmark (bench/faults.py): the bad-input tests -> the scenario they answer (each must end with a
# clear error, not a lost job)
BAD_INPUTS = {
    "test_corrupt_onnx": "bad input: corrupt ONNX",
    "test_unsupported_onnx_operator": "bad input: unsupported operator",
    "test_share_outside_range[0]": "bad input: share 0",
    "test_share_outside_range[150]": "bad input: share 150",
    "test_unknown_target": "bad input: unknown target",
    "test_a_100_mb_model_is_refused_at_submit": "bad input: a 100 MB model at submit",
    "test_a_100_mb_message_on_a_lane_queue_is_refused_before_parsing": "bad input: a 100 MB message on a queue",
    "test_a_pickled_message_on_a_lane_queue_is_refused_not_unpickled": "bad input: a pickled message on a queue",
    "test_malformed_message_on_a_lane_queue_is_answered": "bad input: a message that fails validation (lane)",
    "test_malformed_message_on_the_plan_queue_is_dead_lettered": "bad input: a message that fails validation (plan)",
    "test_model_with_no_tunable_operator_fails_the_job_clearly": "bad input: no tunable operator",
}


def junit_outcomes(junit) -> dict[str, str]:
    """Each test's outcome (passed, failed, skipped) in a pytest JUnit XML report."""
    import xml.etree.ElementTree as ET

    outcomes = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        failed = case.find("failure") is not None or case.find("error") is not None
        outcomes[case.get("name")] = "skipped" if case.find("skipped") is not None else "failed" if failed else "passed"
    return outcomes


def fault_rows(rows_path, outcomes: dict[str, str]) -> list[dict]:
    """The fault tests' figures rows (the JSON lines record_row wrote to `rows_path`), then a row per bad input."""
    rows = [json.loads(line) for line in rows_path.read_text().splitlines()] if rows_path.exists() else []
    for test, scenario in BAD_INPUTS.items():
        rows.append({"scenario": scenario, "jobs_completed": None, "candidates_lost": 0, "trials_respent": 0,
                     "recovery_s": None, "answered_with_clear_error": outcomes.get(test) == "passed", "test": test})
    return rows


def fault_table(rows: list[dict]) -> str:
    """The CPU fault benchmark's rows as the table it prints."""
    lines = [f"{'scenario':62} {'done':>4} {'lost':>4} {'respent':>7} {'recovery_s':>10}"]
    for row in rows:
        lines.append(f"{row['scenario'][:62]:62} {str(row.get('jobs_completed')):>4} {row['candidates_lost']:>4} "
                     f"{row['trials_respent']:>7} {str(row.get('recovery_s')):>10}")
    return "\n".join(lines)

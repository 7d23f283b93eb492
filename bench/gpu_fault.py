"""On the GPU machine: four 25 % MPS lanes tune a job while a deliberately faulting CUDA candidate (a
kernel that writes 4 TiB past its buffer: an illegal address) is sent to their queue, three times.

Expected: 1st and 2nd injection fault the GPU; every lane of it loses its context under MPS; the stack's
supervisor restarts the MPS daemon and the four lanes; the tuner re-sends the in-flight candidates;
the 2nd fault quarantines the culprit (max_crashes 2); the job's own candidates that were in flight
at a fault are re-run alone and cleared (innocents_quarantined 0); the 3rd injection is answered
"quarantined" without running; the job completes. Writes $OUT/gpu_fault.json (one row, also printed) with detection
and recovery times, the errors the lanes saw, and the job's figures.

    bash bench/device_run.sh gpufault            # or: python3 bench/gpu_fault.py [--budget-s 220]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from shared import store  # noqa: E402


def faulting_candidate(cid: str):
    import tvm
    from tvm.script import tirx as T

    from shared.codec import dump_ir
    from shared.messages import Candidate

    @T.prim_func
    def f(A: T.Buffer((1024,), "float32"), B: T.Buffer((1024,), "float32")):
        T.func_attr({"global_symbol": "main"})
        for bx in T.thread_binding(8, thread="blockIdx.x"):
            for tx in T.thread_binding(128, thread="threadIdx.x"):
                B[T.Cast("int64", bx * 128 + tx) + T.int64(1099511627776)] = A[bx * 128 + tx]

    return Candidate(candidate_id=cid, mod=dump_ir(tvm.IRModule({"main": f})),
                     args_info=[["TENSOR", "float32", [1024]]] * 2)


def wait_for(pred, deadline: float, poll_s: float = 0.1):
    while time.time() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(poll_s)
    return None


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget-s", type=float, default=220.0, help="stop waiting after this long in all")
    ap.add_argument("--work", default="/tmp/gpu_fault")
    ap.add_argument("--trials", type=int, default=16)
    args = ap.parse_args()
    out = Path(os.environ.get("OUT", "/tmp/out"))
    out.mkdir(parents=True, exist_ok=True)

    import faultlib
    from services.measurer.observers import make_observer
    from sharetune.client import Client
    from sharetune.stack import Stack

    t_begin = time.time()
    deadline = t_begin + args.budget_s
    gpu = make_observer().inventory()[0]
    u8 = gpu.uuid.lower().removeprefix("gpu-")[:8]
    queue = f"measure.{u8}.p25"
    row: dict = {"scenario": "GPU: 4x25 % MPS lanes, one faulting CUDA candidate injected 3 times",
                 "gpu": gpu.name, "injections": [], "jobs_completed": 0}
    with Stack(Path(args.work), lanes=[queue] * 4, tuners=1, log_level="INFO") as stack:
        row["stack_up_s"] = round(time.time() - t_begin, 1)
        client = Client(stack.redis_url)
        r = client.redis
        lane = client.lanes()[0]
        job = client.submit("tiny", target="cuda", share=25, trials=args.trials, trials_per_iter=8, seed=0)
        wait_for(lambda: job.state().get("state") in ("tuning", "done", "failed"), deadline)
        bad = faulting_candidate("bad")
        chash = store.candidate_hash(bad.mod)
        for n in (1, 2, 3):
            if time.time() > deadline:
                break
            inj = {"n": n}
            row["injections"].append(inj)
            seen_faults = len(store.gpu_faults(r, u8))
            recoveries = len(stack.recoveries)
            t0 = time.time()
            faultlib.send_batch(client, lane, [bad.model_copy(update={"candidate_id": f"bad{n}"})], f"gpufault-{n}",
                                timeout_s=30)
            if n == 3:  # quarantined by now: answered without running, no fault
                res = wait_for(lambda: store.batch_results(r, "gpufault-3")[1].get("bad3"), deadline)
                inj.update(answered=res.error if res else None, fault=res.fault if res else None,
                           answer_s=round(time.time() - t0, 2),
                           new_faults=len(store.gpu_faults(r, u8)) - seen_faults)
                break
            faults = wait_for(lambda: store.gpu_faults(r, u8)[seen_faults:], deadline)
            if not faults:
                inj["detected"] = False
                break
            inj["detect_s"] = round(min(f.at for f in faults) - t0, 2)
            event = wait_for(lambda: stack.recoveries[recoveries:], deadline)
            if event:
                inj["supervisor_detect_s"] = round(event[0]["detected_at"] - t0, 2)
            t_up = wait_for(lambda: (len([l for l in client.lanes() if l.queue == queue and l.started_at > t0]) >= 4)
                            and time.time(), deadline, 0.2)
            inj["recovered_s"] = round(t_up - t0, 2) if t_up else None
            time.sleep(1.0)  # lanes of the GPU may report a little after the first one
            faults = store.gpu_faults(r, u8)[seen_faults:]
            inj["faults"] = [{"role": f.role, "lane_worker": f.worker, "culprit": f.candidate_hash == chash,
                              "error": f.error[:240]} for f in faults]
            inj["crash_count"] = store.crash_count(r, chash)
            inj["quarantined"] = store.quarantined(r, chash) is not None
        final = wait_for(lambda: (st := job.state()).get("state") in ("done", "failed") and st, deadline, 0.5)
        row["job_state"] = final.get("state") if final else job.state().get("state")
        row["job_error"] = final.get("error") if final else None
        if final and final.get("state") == "done":
            figures = faultlib.job_figures(r, job, args.trials)
            row.update(figures)
            row["job_wall_s"] = job.result().wall_s
        row["quarantined"] = [q.model_dump() for q in store.quarantined_all(r)]
        # neighbours in flight at a fault are suspects, re-run alone (services/measurer/isolation.py): none of
        # them may end in the quarantine
        row["innocents_quarantined"] = sum(1 for q in store.quarantined_all(r) if q.candidate_hash != chash)
        row["supervisor"] = [{k: v for k, v in e.items() if k != "faults"} for e in stack.recoveries]
        recovered = [i.get("recovered_s") for i in row["injections"] if i.get("recovered_s") is not None]
        row["recovery_s"] = max(recovered) if recovered else None
    row["total_s"] = round(time.time() - t_begin, 1)
    text = json.dumps(row, indent=1, default=str)
    (out / "gpu_fault.json").write_text(text)
    print(text, flush=True)
    return 0 if row.get("job_state") == "done" else 1


if __name__ == "__main__":
    sys.exit(main())

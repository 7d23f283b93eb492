"""On the GPU machine: GPU fault containment with two GPUs busy. Job A tunes on GPU 0's four 25 % MPS lanes,
job B at the same time on GPU 1's two 50 % lanes (another share, so B's candidates never go to GPU 0).
Two rows, one stack:

  illegal address  a kernel that writes 4 TiB past its buffer, sent to GPU 0's lanes until quarantined
  hung kernel      a kernel that spins forever; the lane's watchdog reports it and the lane exits

Each culprit is sent up to three times: the 1st and 2nd fault GPU 0 (every client of its MPS server is
ended, the lanes start again), the 2nd quarantines it (SHARETUNE_MAX_CRASHES 2), the 3rd is answered
"quarantined" without running. Job A's candidates in flight at a fault are re-run alone and cleared.

Per row: jobs_completed, culprit_quarantined, innocents_quarantined, recovery_s (first fault -> GPU 0's
lanes live again), lost_candidates, other_gpu_trials_during_fault (job B's trials measured on GPU 1 while
GPU 0 was down). On one GPU there is no job B (other_gpu_trials_during_fault: null). Writes
$OUT/gpu_fault_h200.json.

    bash bench/device_run.sh gpufault            # or: python3 bench/gpu_fault.py [--budget-s 240]
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

ROWS = ("illegal address", "hung kernel")
INJECT_TIMEOUT_S = 2.0  # the injected batch's run timeout: the watchdog's allowance is 2x this plus its margin
WATCHDOG_MARGIN_S = 5.0


# ---- pure parts ----------------------------------------------------------------------------------------

def plan_lanes(uuids: list[str]) -> dict:
    """Lane queues of the run: GPU 0 at 4x25 % (job A, where faults are injected), GPU 1 at 2x50 %
    (job B, the bystander) when there is one."""
    from shared.ids import gpu8

    u8 = [gpu8(u) for u in uuids]
    plan = {"faulted": f"measure.{u8[0]}.p25", "faulted_gpu8": u8[0], "lanes": [f"measure.{u8[0]}.p25"] * 4,
            "other": None, "other_gpu8": None}
    if len(u8) > 1:
        plan.update(other=f"measure.{u8[1]}.p50", other_gpu8=u8[1])
        plan["lanes"] += [plan["other"]] * 2
    return plan


def trials_in_window(batches: list[dict], start: float, end: float) -> int:
    """Trials answered without error by batches that finished inside [start, end]."""
    return sum(b["candidates"] - b["errors"] for b in batches if start <= b["finished_at"] <= end)


def row_figures(row: dict, culprit: str, quarantined: list[dict], other_batches: list[dict] | None) -> dict:
    """The figures of one row from what it saw: quarantine entries written during the row other than
    the culprit's are innocents; job B's trials between the row's first fault and GPU 0's lanes live again."""
    t0, t1 = row.get("first_fault_at"), row.get("lanes_back_at")
    in_row = [q for q in quarantined if row["started_at"] <= q["at"] <= row.get("ended_at", float("inf"))]
    row["culprit_quarantined"] = any(q["candidate_hash"] == culprit for q in quarantined)
    row["innocents_quarantined"] = sum(1 for q in in_row if q["candidate_hash"] != culprit)
    row["recovery_s"] = round(t1 - t0, 2) if t0 and t1 else None
    row["other_gpu_trials_during_fault"] = (trials_in_window(other_batches, t0, t1)
                                            if other_batches is not None and t0 and t1 else None)
    return row


# ---- the culprits ----------------------------------------------------------------------------------------

def faulting_candidate(cid: str):
    import tvm
    from tvm.script import tirx as T

    from services.measurer.metaschedule.codec import dump_ir
    from shared.messages import Candidate

    @T.prim_func
    def f(A: T.Buffer((1024,), "float32"), B: T.Buffer((1024,), "float32")):
        T.func_attr({"global_symbol": "main"})
        for bx in T.thread_binding(8, thread="blockIdx.x"):
            for tx in T.thread_binding(128, thread="threadIdx.x"):
                B[T.Cast("int64", bx * 128 + tx) + T.int64(1099511627776)] = A[bx * 128 + tx]

    return Candidate(candidate_id=cid, mod=dump_ir(tvm.IRModule({"main": f})),
                     args_info=[["TENSOR", "float32", [1024]]] * 2)


def hanging_candidate(cid: str):
    """2^40 dependent multiply-adds per thread (~40 min on an H200): it spins past any timeout. A finite
    loop whose result is stored, so the CUDA compiler may not delete it as an infinite loop without effects."""
    import tvm
    from tvm.script import tirx as T

    from services.measurer.metaschedule.codec import dump_ir
    from shared.messages import Candidate

    @T.prim_func
    def f(A: T.Buffer((1024,), "float32"), B: T.Buffer((1024,), "float32")):
        T.func_attr({"global_symbol": "main"})
        for bx in T.thread_binding(8, thread="blockIdx.x"):
            for tx in T.thread_binding(128, thread="threadIdx.x"):
                for i in T.serial(T.int64(1099511627776)):
                    B[bx * 128 + tx] = B[bx * 128 + tx] * A[bx * 128 + tx] + T.float32(1)

    return Candidate(candidate_id=cid, mod=dump_ir(tvm.IRModule({"main": f})),
                     args_info=[["TENSOR", "float32", [1024]]] * 2)


def wait_for(pred, deadline: float, poll_s: float = 0.1):
    while time.time() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(poll_s)
    return None


# ---- the run ---------------------------------------------------------------------------------------------

def run_row(kind: str, make, stack, client, plan: dict, deadline: float) -> dict:
    """Inject one culprit up to three times; returns the row's raw observations."""
    import faultlib
    from shared import store

    r = client.redis
    u8, queue = plan["faulted_gpu8"], plan["faulted"]
    bad = make(f"{kind[:4]}0")
    chash = store.candidate_hash(bad.mod)
    row = {"scenario": f"GPU 0 4x25 % lanes: {kind} candidate injected until quarantined", "culprit": chash,
           "started_at": time.time(), "injections": []}
    lane = next(l for l in client.lanes() if l.queue == queue)
    for n in (1, 2, 3):
        if time.time() > deadline:
            row["stopped"] = "time budget spent"
            break
        inj = {"n": n}
        row["injections"].append(inj)
        seen = len(store.gpu_faults(r, u8))
        t0 = time.time()
        batch_id = f"gpufault-{kind[:4]}-{n}-{int(t0)}"
        faultlib.send_batch(client, lane, [bad.model_copy(update={"candidate_id": f"bad{n}"})], batch_id,
                            timeout_s=INJECT_TIMEOUT_S)
        if store.quarantined(r, chash) is not None:  # answered without running, no fault
            res = wait_for(lambda: store.batch_results(r, batch_id)[1].get(f"bad{n}"), deadline)
            inj.update(answered=res.error[:200] if res else None, answer_s=round(time.time() - t0, 2),
                       new_faults=len(store.gpu_faults(r, u8)) - seen)
            break
        faults = wait_for(lambda: store.gpu_faults(r, u8)[seen:], deadline)
        if not faults:
            inj["detected"] = False
            break
        first = min(f.at for f in faults)
        row.setdefault("first_fault_at", first)
        inj["detect_s"] = round(first - t0, 2)
        back = wait_for(lambda: (len([l for l in client.lanes() if l.queue == queue and l.started_at > first]) >= 4)
                        and time.time(), deadline, 0.2)
        inj["lanes_back_s"] = round(back - first, 2) if back else None
        if back and n == 1:
            row["lanes_back_at"] = back
        time.sleep(1.0)  # neighbours' reports of the same incident
        inj["faults"] = [{"role": f.role, "culprit": f.candidate_hash == chash, "error": f.error[:200]}
                         for f in store.gpu_faults(r, u8)[seen:]]
        inj["crash_count"] = store.crash_count(r, chash)
        inj["quarantined"] = store.quarantined(r, chash) is not None
        if not back:
            break
    row["ended_at"] = time.time()
    row["gpus_given_up"] = dict(stack.gpus_given_up)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget-s", type=float, default=240.0, help="stop waiting after this long in all (stack start included)")
    ap.add_argument("--work", default="/tmp/gpu_fault")
    ap.add_argument("--trials", type=int, default=16, help="trials of each job")
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of: {', '.join(ROWS)}")
    args = ap.parse_args()
    out = Path(os.environ.get("OUT", "/tmp/out"))
    out.mkdir(parents=True, exist_ok=True)
    os.environ["SHARETUNE_WATCHDOG_MARGIN_S"] = str(WATCHDOG_MARGIN_S)  # lanes inherit it
    os.environ.setdefault("SHARETUNE_MAX_CRASHES", "2")

    import faultlib
    from services.measurer.observers import make_observer
    from shared import store
    from shared.messages import FINAL_STATES
    from sharetune.client import Client
    from sharetune.stack import Stack

    t_begin = time.time()
    deadline = t_begin + args.budget_s
    gpus = make_observer().inventory()
    plan = plan_lanes([g.uuid for g in gpus])
    result: dict = {"gpus": [g.name for g in gpus], "lanes": plan["lanes"], "rows": [],
                    "note": None if plan["other"] else "one GPU: no bystander job; other_gpu_trials_during_fault is null"}
    makers = {"illegal address": faulting_candidate, "hung kernel": hanging_candidate}
    wanted = [k.strip() for k in args.rows.split(",") if k.strip() in makers]
    with Stack(Path(args.work), lanes=plan["lanes"], log_level="INFO") as stack:
        result["stack_up_s"] = round(time.time() - t_begin, 1)
        client = Client(stack.redis_url)
        r = client.redis
        job_a = client.submit("tiny", target="cuda", share=25, trials=args.trials, trials_per_iter=8, seed=0)
        job_b = (client.submit("tiny", target="cuda", share=50, trials=args.trials, trials_per_iter=8, seed=1)
                 if plan["other"] else None)
        wait_for(lambda: job_a.state().get("state") in ("tuning", "done", "failed"), deadline)
        for i, kind in enumerate(wanted):
            # the later row keeps time for itself and for the jobs to finish
            row_deadline = min(deadline - 20, time.time() + (deadline - 20 - time.time()) / (len(wanted) - i))
            result["rows"].append(run_row(kind, makers[kind], stack, client, plan, row_deadline))
        jobs = [j for j in (job_a, job_b) if j is not None]
        wait_for(lambda: all(j.state().get("state") in FINAL_STATES for j in jobs), deadline, 0.5)
        states = {j.job_id: j.state() for j in jobs}
        figures = faultlib.job_figures(r, job_a, args.trials)
        quarantined = [q.model_dump() for q in store.quarantined_all(r)]
        other_batches = ([b.model_dump() for b in store.lane_batches(r, job_b.job_id)] if job_b else None)
        for row in result["rows"]:
            row_figures(row, row["culprit"], quarantined, other_batches)
            row["jobs_completed"] = sum(1 for s in states.values() if s.get("state") == "done")
            row["lost_candidates"] = figures["candidates_lost"]  # job A's, over the whole run (both rows)
        result["jobs"] = {j: {"state": s.get("state"), "error": s.get("error"), "gpu_error": s.get("gpu_error")}
                          for j, s in states.items()}
        result["job_a"] = figures
        result["supervisor"] = [{k: v for k, v in e.items() if k != "faults"} for e in stack.recoveries]
        result["total_s"] = round(time.time() - t_begin, 1)
        # written before the stack stops, in case stopping outlasts the call's time limit
        (out / "gpu_fault_h200.json").write_text(json.dumps(result, indent=1, default=str))
    result["total_s"] = round(time.time() - t_begin, 1)
    text = json.dumps(result, indent=1, default=str)
    (out / "gpu_fault_h200.json").write_text(text)
    print(text, flush=True)
    print(f"{'row':18} {'done':>4} {'culprit_q':>9} {'innocent_q':>10} {'recovery_s':>10} {'lost':>4} {'other_gpu':>9}")
    for row in result["rows"]:
        kind = row["scenario"].split(": ")[1].split(" candidate")[0]
        print(f"{kind:18} {row['jobs_completed']:>4} {str(row['culprit_quarantined']):>9} {row['innocents_quarantined']:>10} "
              f"{str(row['recovery_s']):>10} {row['lost_candidates']:>4} {str(row['other_gpu_trials_during_fault']):>9}")
    return 0 if all(s.get("state") == "done" for s in states.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

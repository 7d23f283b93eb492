"""On the GPU machine: GPU fault containment on one GPU. Job A tunes on GPU 0's four 25 % MPS lanes, where the
faults are injected; a bystander job tunes on a CPU lane all the while (it must not stall). One stack, a row a
scenario (SCENARIOS): an illegal address (error 700 reaches every MPS client of the GPU), a hung kernel (the lane's
watchdog reports it and the lane exits), a launch failure (an ordinary launch error: the lane is kept, nothing to
quarantine, no recovery).

Each culprit is sent as the tuner would re-send it (up to MAX_SENDS times): the GPU's fault makes every candidate
in flight a suspect; re-sent, each suspect runs alone (services.measurer.isolation), so the culprit faults alone
and is quarantined (SHARETUNE_MAX_CRASHES 2) while job A's innocents are cleared; the last send must be answered
"quarantined" without running. Per row: jobs_completed, culprit_quarantined, innocents_quarantined,
lost_candidates (claimed minus recorded, both jobs, whole run), suspect_reruns, recovery_s (first fault -> the
GPU's lanes measuring again) and each recovery's phases. Writes $OUT/gpu_fault_h200.json.

`--rehearse`: the same driver on CPU lanes, the sandbox's crash, hang and build crash as culprits
(sharetune.testing.faults), quarantined without a recovery. Writes $OUT/gpu_fault_rehearsal.json.

    bash bench/device_run.sh gpufault            # or: python3 -m bench.gpu_fault [--budget-s 300]
    python -m bench.gpu_fault --rehearse         # on CPU
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bench.harness.common import out_dir, wait_for, write_results
from bench.harness.jobs import gpus as find_gpus, local_stack
from sharetune.testing import faults as fault_kit

INJECT_TIMEOUT_S = 2.0  # the injected batch's run timeout: the watchdog's allowance is 2x this plus its margin
WATCHDOG_MARGIN_S = 5.0
MAX_SENDS = 4


@dataclass(frozen=True)
class Scenario:
    name: str
    gpu_maker: str  # functions of sharetune.testing.faults: on the GPU, and in the rehearsal
    cpu_maker: str
    poison_on_gpu: bool  # whether its candidate must end quarantined on the GPU
    weight: float  # its part of the time budget: two GPU recoveries, a watchdog's wait on top, none


SCENARIOS = (Scenario("illegal address", "faulting_candidate", "segv_at_run", True, 1.0),
             Scenario("hung kernel", "hanging_candidate", "hang_at_run", True, 1.3),
             Scenario("launch failure", "oversized_launch_candidate", "segv_at_build", False, 0.3))


def run_row(sc: Scenario, make, stack, client, plan: dict, deadline: float, rehearse: bool) -> dict:
    """Send one culprit as a tuner would re-send it, until it is answered "quarantined" without running
    (a poison scenario) or answered at all (an ordinary error); returns the row's raw observations."""
    from shared import store

    r = client.redis
    u8, queue = plan["faulted_gpu8"], plan["faulted"]
    bad = make(f"{sc.name[:4]}0", int(time.time()) % 100000) if rehearse else make(f"{sc.name[:4]}0")
    chash = store.candidate_hash(bad.mod)
    poison = True if rehearse else sc.poison_on_gpu
    row = {"scenario": sc.name, "culprit": chash, "poison": poison, "started_at": time.time(), "injections": [],
           "suspect_runs_before": sum(store.suspect_runs(r, u8).values()) if u8 else 0}
    faults = (lambda: store.gpu_faults(r, u8)) if u8 else (lambda: [])
    for n in range(1, MAX_SENDS + 1):
        if time.time() > deadline:
            row["stopped"] = "time budget spent"
            break
        lane = wait_for(lambda: next((l for l in client.lanes() if l.queue == queue), None),
                        deadline - time.time(), 0.2)
        if lane is None:
            row["stopped"] = "no live lane to send to"
            break
        inj = {"n": n, "quarantined_before": store.quarantined(r, chash) is not None}
        row["injections"].append(inj)
        seen, recovered = len(faults()), len(stack.recoveries)
        t0 = time.time()
        batch_id = f"gpufault-{sc.name[:4]}-{n}-{int(t0 * 1000)}"
        fault_kit.send_batch(client, lane, [bad.model_copy(update={"candidate_id": f"bad{n}"})], batch_id,
                            timeout_s=INJECT_TIMEOUT_S)
        answer = lambda: store.batch_results(r, batch_id)[1].get(f"bad{n}")  # noqa: E731
        # a lane that aborts with its context reports nothing: the supervisor's recovery shows the fault
        wait_for(lambda: answer() or faults()[seen:] or len(stack.recoveries) > recovered, deadline - time.time())
        new, events = faults()[seen:], stack.recoveries[recovered:]
        if new or events:
            first = min([f.at for f in new] + [e["detected_at"] for e in events])
            row.setdefault("first_fault_at", first)
            inj["detect_s"] = round(first - t0, 2)
            back = wait_for(lambda: (len([l for l in client.lanes() if l.queue == queue and l.started_at > first])
                                     >= plan["lanes"].count(queue)) and time.time(), deadline - time.time(), 0.2)
            inj["lanes_back_s"] = round(back - first, 2) if back else None
            time.sleep(0.5)  # neighbours' reports of the same incident
            inj["faults"] = [{"role": f.role, "culprit": f.candidate_hash == chash, "error": f.error[:200]}
                             for f in faults()[seen:]]
        res = answer()
        inj["answered"] = res.error[:200] if res and res.error else ("ok" if res else None)
        inj["crash_count"] = store.crash_count(r, chash)
        inj["quarantined"] = store.quarantined(r, chash) is not None
        if inj["quarantined_before"]:
            inj["ran"] = bool(new or events)  # a quarantined candidate must be answered without running
            break
        if res is not None and not poison and not (new or events):
            break  # an ordinary error: answered, the lane kept
        if (new or events) and not inj.get("lanes_back_s"):
            break
    row["ended_at"] = time.time()
    if u8:
        row["suspect_reruns"] = sum(store.suspect_runs(r, u8).values()) - row.pop("suspect_runs_before")
    else:
        row["suspect_reruns"] = row.pop("suspect_runs_before")
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget-s", type=float, default=None,
                    help="stop waiting after this long in all, stack start included (300; rehearsal 1200)")
    ap.add_argument("--work", default=None)
    ap.add_argument("--trials", type=int, default=None, help="trials of job A (32; rehearsal 8)")
    ap.add_argument("--bystander-trials", type=int, default=None,
                    help="trials of the bystander job, enough to run through every row (64; rehearsal 24)")
    ap.add_argument("--rows", default=",".join(s.name for s in SCENARIOS),
                    help=f"comma-separated, of: {', '.join(s.name for s in SCENARIOS)}")
    ap.add_argument("--rehearse", action="store_true", help="on CPU lanes, with the sandbox's fake faults")
    args = ap.parse_args(argv)
    rehearse = args.rehearse
    budget_s = args.budget_s or (1200.0 if rehearse else 300.0)
    trials = args.trials or (8 if rehearse else 32)
    bystander_trials = args.bystander_trials or (24 if rehearse else 64)
    work = Path(args.work or ("/tmp/gpu_fault_rehearsal" if rehearse else "/tmp/gpu_fault"))
    out = out_dir()
    os.environ["SHARETUNE_WATCHDOG_MARGIN_S"] = str(WATCHDOG_MARGIN_S)  # lanes inherit these
    os.environ.setdefault("SHARETUNE_MAX_CRASHES", "2")
    if rehearse:
        os.environ["SHARETUNE_TEST_FAULT_HOOKS"] = "1"  # the build crash's hook (tests only, and this)
        os.environ.setdefault("TVM_NUM_THREADS", "1")
        os.environ.setdefault("SHARETUNE_SEARCH_POPULATION", "128")

    from shared import store
    from shared.messages import FINAL_STATES
    from sharetune.client import Client

    t_begin = time.time()
    deadline = t_begin + budget_s
    gpus = [] if rehearse else find_gpus()
    if not rehearse and not gpus:
        print("no GPU: run with --rehearse on CPU", file=sys.stderr)
        return 2
    plan = fault_kit.plan_lanes([g.uuid for g in gpus], os.cpu_count() or 1)
    wanted = [s for s in SCENARIOS if s.name in {k.strip() for k in args.rows.split(",")}]
    makers = {s.name: getattr(fault_kit, s.cpu_maker if rehearse else s.gpu_maker) for s in wanted}
    result: dict = {"rehearsal": rehearse, "gpus": [g.name for g in gpus], "lanes": plan["lanes"], "rows": []}
    with local_stack(work, plan["lanes"]) as stack:
        result["stack_up_s"] = round(time.time() - t_begin, 1)
        client = Client(stack.redis_url)
        r = client.redis
        a_target = "llvm" if rehearse else "cuda"
        job_a = client.submit("tiny", target=a_target, share=None if rehearse else 25, trials=trials,
                              trials_per_iter=4 if rehearse else 8, seed=0)
        bystander = (job_a if rehearse and plan["bystander"] == plan["faulted"] else
                     client.submit("tiny", target="llvm", trials=bystander_trials, trials_per_iter=4 if rehearse else 8,
                                   seed=1))
        jobs = list({j.job_id: j for j in (job_a, bystander)}.values())
        wait_for(lambda: job_a.state().get("state") in ("tuning", "done", "failed"), deadline - time.time())
        for i, sc in enumerate(wanted):
            # each row its part of what is left, keeping 20 s for the jobs to finish
            share = sc.weight / sum(s.weight for s in wanted[i:])
            row_deadline = time.time() + max(0.0, deadline - 20 - time.time()) * share
            result["rows"].append(run_row(sc, makers[sc.name], stack, client, plan, row_deadline, rehearse))
        wait_for(lambda: all(j.state().get("state") in FINAL_STATES for j in jobs), deadline - time.time(), 0.5)
        states = {j.job_id: j.state() for j in jobs}
        accounting = {j.job_id: store.trial_accounting(r, j.job_id) for j in jobs}
        quarantined = [q.model_dump() for q in store.quarantined_all(r)]
        by_batches = store.lane_batches(r, bystander.job_id)
        for row in result["rows"]:
            fault_kit.row_figures(row, quarantined, stack.recoveries, plan["faulted_gpu8"])
            row["jobs_completed"] = sum(1 for s in states.values() if s.get("state") == "done")
            row["lost_candidates"] = sum(a["lost"] for a in accounting.values())  # both jobs, whole run
            # the bystander's trials measured while the row ran: it must not stall
            row.update(fault_kit.bystander_figures(by_batches, row["started_at"], row["ended_at"]))
        result["jobs"] = {j: {"state": s.get("state"), "error": s.get("error"), "gpu_error": s.get("gpu_error"),
                              **accounting[j]} for j, s in states.items()}
        result["job_a"] = fault_kit.job_figures(r, job_a, trials)
        result["supervisor"] = [{k: v for k, v in e.items() if k != "faults"} for e in stack.recoveries]
        result["total_s"] = round(time.time() - t_begin, 1)
        name = "gpu_fault_rehearsal.json" if rehearse else "gpu_fault_h200.json"
        # written before the stack stops, in case stopping outlasts the call's time limit
        write_results(result, out / name, "bench.gpu_fault", argv)
    result["total_s"] = round(time.time() - t_begin, 1)
    print((write_results(result, out / name, "bench.gpu_fault", argv)).read_text(), flush=True)
    print(fault_kit.gpu_fault_table(result["rows"]))
    return 0 if all(s.get("state") == "done" for s in states.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Tuned-at x served-at latency matrix on the GPU machine (run there: `bash bench/device_run.sh matrix`).

    python -m bench.share_matrix                      # both models, one after another
    python -m bench.share_matrix --models resnet18 --gpu-index 0 --out-json /tmp/x.json   # one model, by hand
    python -m bench.share_matrix --rehearse           # the same flow on this CPU: tiny, lanes of 1 and 2 cores
    python -m bench.share_matrix --models resnet18,regnety-stage --shares 25,50,100 --trials 1024 --tunings 3
        --resume --serve-when-complete --deadline-s 1080       # (one line) replicates, a session's part

Each model: every task tuned at each share (`--tunings N`: N isolated jobs, seeds 0..N-1) on min(4, 100 // share)
MPS lanes of that share, in one stack; then each tuned model served at every share in a fresh process, `--rounds`
interleaved rounds a cell. The per-share trials are what fits the deadline (at most the model's default); a share
that cannot be tuned in time is skipped and recorded; the JSON under $OUT is rewritten after every job and every
serving process. Separate runs (one call per model) are joined with `--merge A B`.
A run over several sessions keeps each finished tuning (--kept) and is started again with --resume. Protocol,
timings and results: docs/share-matrix.md.
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from bench.harness.common import out_dir
from bench.harness.jobs import gpus
from sharetune.experiments.share_matrix import merge_matrices


def log(msg: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {msg}", flush=True)


def write_and_print(reports: list, out_json: Path, png: Path | None, tables: bool = True) -> None:
    """The matrices' JSON and heatmap written, their tables printed (`tables`)."""
    from sharetune.experiments.share_matrix import write_outputs

    drawn = write_outputs(reports, out_json, png)
    for r in reports if tables else []:
        print(r.table(), flush=True)
    log(f"wrote {out_json}" + (f" and {drawn}" if drawn else " (no heatmap: matplotlib missing)"))


def run_models(args, models: list[str], deadline: float) -> list:
    """All `models` on one GPU, one stack, one after another; the time left is split evenly."""
    from shared import store
    from sharetune.client import Client
    from services.measurer.agent import BuilderSpec
    from bench.panel import PANEL, build
    from sharetune.experiments.share_matrix import (COMPILE_S, SERVE_S, STACK_S, WHY_S, MatrixStack, Placement,
                                                    Replicates, Serving, beyond_noise, earlier_reports, model_tasks,
                                                    per_model, plan_budget, run_matrix, write_outputs)
    from sharetune.experiments.share_tunings import KeptTunings, tuning_key, tuning_plan
    from shared.settings import StackSettings

    if args.device == "cpu":  # a rehearsal of this flow on a CPU host (lanes of whole cores)
        placement = Placement("cpu")
        gpu = None
    else:
        gpu = next(g for g in gpus() if g.index == args.gpu_index)
        placement = Placement("gpu", gpu_uuid=gpu.uuid)
    built = {m: build(m) if m in PANEL else (m, None) for m in models}  # a panel model: torch module and inputs
    all_tasks = {m: model_tasks(built[m][0], args.device, built[m][1]) for m in models}
    chosen = {m: (all_tasks[m][:args.tasks] if args.tasks else None) for m in models}
    per_model_s = (deadline - time.time() - STACK_S) / len(models)
    plans = {m: plan_budget(args.shares, args.cores, args.device, args.trials, per_model(args.tunings, m),
                            args.per_iter, len(chosen[m] or all_tasks[m]), per_model_s) for m in models}
    shares = sorted({p for m in models for p in plans[m][0]})
    log(f"{args.device} {gpu.label if gpu else ''}; models {models}; shares {shares}; "
        + "; ".join(f"{m}: {len(chosen[m] or all_tasks[m])} of {len(all_tasks[m])} tasks, {plans[m][1]} trials a share"
                    for m in models))
    reports: dict[str, object] = {}
    out_json = Path(args.out_json)
    earlier = earlier_reports(out_json) if args.resume else {}

    def save(report) -> None:
        reports[report.model] = report
        write_outputs(list(reports.values()), out_json)

    work = Path(args.work_dir) / (f"gpu{gpu.index}" if gpu else "cpu")
    t0 = time.time()
    cores = int(os.environ.get("SHARETUNE_MATRIX_CORES", os.cpu_count() or 1))
    # GPU: one set of builders serves every share's lanes (4 cores left to the tuner clients), instead of a
    # build pool beside each lane of each share, idle while other shares tune
    builders = max(1, cores - 4) if args.device == "gpu" else 0
    with MatrixStack(work / "stack", lanes=placement.lanes(shares), log_level="INFO",
                     builders=BuilderSpec(builders, None),
                     settings=StackSettings()) as stack:
        log(f"stack up in {time.time() - t0:.0f} s: lanes {sorted(set(stack.lanes))}")
        placement.mps_env = stack.mps.environment() if stack.mps is not None else {}
        client = Client(stack.redis_url)

        def stop_tuning(job) -> None:
            # a job past its time keeps tuning on the GPU: cancel it (so no reaper resumes its shards),
            # then stop the tuners so serving is measured quietly, and start fresh ones for what follows
            log(f"job {job.job_id} overran: cancelling it and restarting the tuner clients")
            store.set_state(client.redis, job.job_id, "cancelled", error="overran the matrix deadline")
            for proc in [n for n in list(stack.procs) if n.startswith("tuner")]:
                stack.stop_process(proc, timeout_s=10)
                stack.start_tuner(proc)

        for i, model in enumerate(models):
            my_shares, trials = plans[model]
            tunings = per_model(args.tunings, model)
            done = earlier[model].rederived() if model in earlier else None  # by this code's statistics
            if (done is not None and done.complete and done.shares == my_shares and done.trials_per_share == trials
                    and min(n for row in done.tunings or [[1]] for n in row) >= tunings):
                if done.why or not beyond_noise(done):
                    log(f"[matrix {model}] complete in an earlier run: kept")
                    save(done)
                    continue
                log(f"[matrix {model}] complete in an earlier run, differences beyond noise unexplained: "
                    "its tunings served again and explained")
            # the time left, split over the models still to run (resumed: in turn, the first model's tunings
            # first, so that it is served the soonest); serving reserve ~15 s per share
            my_deadline = time.time() + (deadline - time.time()) / (1 if args.resume else len(models) - i)
            replicates = Replicates(tunings, 0, Path(args.kept or Path(args.work_dir) / "tunings"), args.resume)
            keys = [tuning_key(model, p, seed, trials) for p, seed in tuning_plan(my_shares, replicates.seeds)]
            gone = KeptTunings(replicates.kept_dir).modules_gone(keys, chosen[model]) if args.resume else 0
            report = run_matrix(client, built[model][0], my_shares, placement, work / model, trials=trials,
                                trials_per_iter=args.per_iter, only_tasks=chosen[model], n_tasks=len(all_tasks[model]),
                                replicates=replicates, example_inputs=built[model][1], name=model, deadline=my_deadline,
                                serve_reserve_s=SERVE_S * len(my_shares) + 10 + WHY_S + COMPILE_S * -(-gone // 4),
                                log=log, on_partial=save,
                                serving=Serving(args.rounds, 120, stack.stop_lanes if i == len(models) - 1 else None,
                                                only_complete=args.serve_when_complete),
                                on_job_timeout=stop_tuning)
            report.info.update({"gpu": gpu.name if gpu else None, "gpu_uuid8": gpu.uuid8 if gpu else None,
                                "task_names": chosen[model] or all_tasks[model],
                                "lanes": sorted(set(stack.lanes)), "host_cores": os.cpu_count()})
            save(report)
            print(report.table(), flush=True)
    return list(reports.values())


def launch(args) -> None:
    """Every model here, one after another on GPU `--gpu-index` (or this CPU), one stack; the files under $OUT."""
    models = args.models.split(",")
    t0 = time.time()
    stem = "share_matrix_h200" if args.device == "gpu" else "share_matrix_cpu"
    stem += f"_{models[0]}" if len(models) == 1 else ""
    stem = "share_matrix_rehearsal" if args.rehearse else stem  # the result files' names under $OUT
    final_json = out_dir() / f"{stem}.json"
    args.out_json = str(final_json)
    reports = run_models(args, models, t0 + args.deadline_s)  # prints each table as it is done
    for r in reports:
        r.info["wall_s"] = round(time.time() - t0, 1)
    write_and_print(reports, final_json, final_json.with_suffix(".png"), tables=False)
    log(f"{time.time() - t0:.0f} s in all")


def rehearsal(args, ap) -> None:
    """--rehearse: the defaults of a CPU rehearsal wherever the command line left an option at its default."""
    default = ap.parse_args([])
    tiny = {"device": "cpu", "cores": "1,2", "models": "tiny", "trials": 8, "per_iter": 4, "rounds": 10, "tunings": 2}
    for key, value in tiny.items():
        if getattr(args, key) == getattr(default, key):
            setattr(args, key, value)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="resnet18,transformer")
    ap.add_argument("--shares", default="auto", help="percentages, or auto: 25,50,100 (+10 when it fits the time)")
    ap.add_argument("--cores", default=None, help="--device cpu: core counts of the lanes instead of --shares, e.g. 1,2")
    ap.add_argument("--trials", type=int, default=None,
                    help="per share (default: what fits the deadline, at most 32 a task and at least 256)")
    ap.add_argument("--per-iter", type=int, default=64, help="candidates a search round (MetaSchedule's default)")
    ap.add_argument("--tasks", type=int, default=None, help="tune each model's k heaviest tasks (default: all)")
    ap.add_argument("--rounds", type=int, default=30, help="timing rounds per cell: median and bootstrap 95 %% CI")
    ap.add_argument("--deadline-s", type=float, default=530, help="all done (files written) within this")
    ap.add_argument("--device", choices=["gpu", "cpu"], default="gpu", help="cpu: rehearse the flow on this host")
    ap.add_argument("--gpu-index", type=int, default=None, help="run on this GPU, to --out-json")
    ap.add_argument("--work-dir", default="/tmp/share_matrix")
    ap.add_argument("--out-json", default=None)
    ap.add_argument("--merge", nargs="*", help="join these JSON files into --out-json (+ PNG), each matrix derived "
                                               "again from its rounds (a model in a later file wins), and stop")
    ap.add_argument("--tunings", default="3", help="tunings a share, seeds 0..N-1 (intervals cover them); by model: "
                                                   "resnet18=4,5 (4 for resnet18, 5 for the others)")
    ap.add_argument("--kept", default=None, help="finished tunings, by model, share, seed, trials (WORK_DIR/tunings); "
                                                 "with --merge: their kernels' launch facts added")
    ap.add_argument("--resume", action="store_true",
                    help="tune only what --kept lacks; keep complete models of the result JSON")
    ap.add_argument("--serve-when-complete", action="store_true",
                    help="serve a model only once all its tunings are kept (a run split across sessions)")
    ap.add_argument("--rehearse", action="store_true",
                    help="this flow on this CPU: --device cpu, lanes of 1 and 2 cores, tiny, 8 trials, 4 a round, "
                         "10 rounds, 2 tunings, unless given; results under $OUT (default /tmp/out)")
    args = ap.parse_args(argv)
    if args.rehearse:
        rehearsal(args, ap)
    if args.merge:  # separate runs' JSON joined (a model in a later file replaces it), derived again, a heatmap
        out_json = Path(args.out_json or "bench/results/share_matrix_h200.json")
        merged = merge_matrices(args.merge, args.kept)
        write_and_print(merged, out_json, out_json.with_suffix(".png"))
        return
    if args.cores and args.device != "cpu":
        ap.error("--cores is for --device cpu")
    if args.gpu_index is not None:  # a single run by hand
        args.out_json = args.out_json or str(out_dir() / "share_matrix.json")
        run_models(args, args.models.split(","), time.time() + args.deadline_s)
        return
    args.gpu_index = 0
    launch(args)


if __name__ == "__main__":
    main()

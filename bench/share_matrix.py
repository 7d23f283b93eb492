"""Tuned-at x served-at latency matrix on the GPU machine (run there: `bash bench/device_run.sh matrix`).

    python bench/share_matrix.py                      # both models; one per GPU when the host has two
    python bench/share_matrix.py --models resnet18 --gpu-index 0 --out-json /tmp/x.json   # one child

Each model: its k heaviest tasks (FLOPs x weight, as bench/gpu_tuning.py) tuned at each share on
min(4, 100 // share) MPS lanes of that share, one share after another, in one stack; then each tuned
model served at every share in a fresh process under that MPS percentage. Everything must fit one
10-minute device call, so the script keeps a deadline: a share it cannot tune in time is skipped and
recorded, a failed cell is recorded, and the JSON under $OUT is rewritten after every job and every
serving process.

Budget (H200, 16 cores per model; bench/gpu_tuning.py measured ~16 s of evolutionary search per round
whatever its size, compile ~22 s, stack start ~25 s with 4 lanes, more with 7): per share ~10 s plan
+ 3 rounds x ~20 s + ~22 s compile = ~95 s; serving ~15 s per share.
- Two GPUs (nvidia-h200-x2), one model each, 48 trials in rounds of 16, 3 shares: ~45 + 3 x 95 + 45
  = ~375 s, both models in parallel. The default; one call.
- One GPU, both models: 24 trials in rounds of 8, ~45 + 6 x 80 + 90 = ~615 s: does not fit, the deadline
  skips what is left (recorded). On one GPU make one call per model (`--models resnet18`, then
  `--models transformer`, each ~375 s) and join them with `--merge A.json B.json`.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

OUT = Path(os.environ.get("OUT", "/tmp/out"))


def log(msg: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {msg}", flush=True)


def run_models(args, models: list[str], deadline: float) -> list:
    """All `models` on one GPU, one stack, one after another; the time left is split evenly."""
    from services.measurer.observers import make_observer
    from shared import store
    from sharetune.client import Client
    from sharetune.matrix import MatrixStack, Placement, heaviest_tasks, run_matrix, write_outputs
    from sharetune.share_matrix import parse_shares

    if args.device == "cpu":  # a rehearsal of this flow on a CPU host (lanes of whole cores)
        placement = Placement("cpu")
        gpu = None
    else:
        gpu = next(g for g in make_observer().inventory() if g.index == args.gpu_index)
        placement = Placement("gpu", gpu_uuid=gpu.uuid)
    shares = parse_shares(args.shares, args.device, placement.host_cores)
    tasks = {m: heaviest_tasks(m, args.tasks, args.device) for m in models}
    log(f"{args.device} {gpu.label if gpu else ''}; models {models}; shares {shares}; tasks {tasks}")
    reports: dict[str, object] = {}
    out_json = Path(args.out_json)

    def save(report) -> None:
        reports[report.model] = report
        write_outputs(list(reports.values()), out_json)

    work = Path(args.work_dir) / (f"gpu{gpu.index}" if gpu else "cpu")
    t0 = time.time()
    with MatrixStack(work / "stack", lanes=placement.lanes(shares), log_level="INFO") as stack:
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
            # the time left, split over the models still to run; serving reserve ~15 s per share
            my_deadline = time.time() + (deadline - time.time()) / (len(models) - i)
            report = run_matrix(client, model, shares, placement, work / model, trials=args.trials,
                                trials_per_iter=args.per_iter, only_tasks=tasks[model], seed=0, name=model,
                                deadline=my_deadline, serve_reserve_s=15 * len(shares) + 10, rounds=args.rounds,
                                serve_timeout_s=120, log=log, on_partial=save, on_job_timeout=stop_tuning,
                                before_serving=stack.stop_lanes if i == len(models) - 1 else None)
            report.info.update({"gpu": gpu.name if gpu else None, "gpu_uuid8": gpu.uuid8 if gpu else None,
                                "tasks": tasks[model],
                                "lanes": sorted(set(stack.lanes)), "host_cores": os.cpu_count()})
            save(report)
            print(report.table(), flush=True)
    return list(reports.values())


def gpus() -> list:
    from services.measurer.observers import make_observer

    return make_observer().inventory()


def launch(args) -> None:
    """One child per model on its own GPU when there are enough GPUs, else all models here on GPU 0."""
    from sharetune.matrix import write_outputs
    from sharetune.share_matrix import ShareMatrix

    models = args.models.split(",")
    found = gpus() if args.device == "gpu" else []
    OUT.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    deadline = t0 + args.deadline_s
    stem = ("share_matrix_h200" if args.device == "gpu" else "share_matrix_cpu") + (f"_{models[0]}" if len(models) == 1 else "")
    final_json, final_png = OUT / f"{stem}.json", OUT / f"{stem}.png"
    if len(found) >= len(models) > 1:
        log(f"{len(found)} GPUs: one model per GPU, in parallel")
        children = []
        cores = (os.cpu_count() or 1) // len(models)
        for gpu, model in zip(found, models):
            part = OUT / f"share_matrix_{model}.json"
            # the child's stack starts its own MPS daemon; with only this GPU visible it controls only it
            env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpu.uuid, "SHARETUNE_MATRIX_CORES": str(cores)}
            argv = [sys.executable, __file__, "--models", model, "--gpu-index", str(gpu.index), "--shares", args.shares,
                    "--trials", str(args.trials), "--per-iter", str(args.per_iter), "--tasks", str(args.tasks),
                    "--rounds", str(args.rounds), "--deadline-s", str(args.deadline_s - 5),
                    "--work-dir", args.work_dir, "--out-json", str(part)]
            logf = open(OUT / f"share_matrix_{model}.log", "w")
            children.append((model, part, subprocess.Popen(argv, env=env, stdout=logf, stderr=subprocess.STDOUT)))
        for model, part, proc in children:
            try:
                proc.wait(timeout=max(1.0, deadline + 30 - time.time()))
            except subprocess.TimeoutExpired:
                proc.terminate()  # the child's stack stops what it started on SIGTERM
                proc.wait(timeout=30)
            log(f"{model}: child exited {proc.returncode}")
        reports = []
        for model, part, _ in children:
            if part.exists():
                body = json.loads(part.read_text())
                reports += [ShareMatrix.model_validate(m) for m in body.get("matrices", [body])]
            else:
                log(f"{model}: no result; see {OUT / f'share_matrix_{model}.log'}")
    else:
        if len(models) > 1:
            where = f"GPU {args.gpu_index}" if args.device == "gpu" else "this CPU"
            log(f"{len(found)} GPU(s): the models one after another on {where}")
        args.out_json = str(final_json)
        reports = run_models(args, models, deadline)
    for r in reports:
        r.info["wall_s"] = round(time.time() - t0, 1)
        r.info["parallel_gpus"] = len(found) >= len(models) > 1
    png = write_outputs(reports, final_json, final_png)
    for r in reports:
        print(r.table(), flush=True)
    log(f"wrote {final_json}" + (f" and {png}" if png else " (no heatmap: matplotlib missing)")
        + f"; {time.time() - t0:.0f} s in all")


def merge(paths: list[str], out_json: Path) -> None:
    """Join the JSON of separate runs (e.g. one call per model on a one-GPU machine) into one file +
    heatmap."""
    from sharetune.matrix import write_outputs
    from sharetune.share_matrix import ShareMatrix

    reports = []
    for p in paths:
        body = json.loads(Path(p).read_text())
        reports += [ShareMatrix.model_validate(m) for m in body.get("matrices", [body])]
    png = write_outputs(reports, out_json, out_json.with_suffix(".png"))
    for r in reports:
        print(r.table())
    print(f"wrote {out_json}" + (f" and {png}" if png else " (no heatmap: matplotlib missing)"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="resnet18,transformer")
    ap.add_argument("--shares", default="25,50,100")
    ap.add_argument("--trials", type=int, default=None,
                    help="per share (default 48 when each model has a GPU to itself, else 24)")
    ap.add_argument("--per-iter", type=int, default=None,
                    help="trials per search round (default 16; 8 when the models share one GPU)")
    ap.add_argument("--tasks", type=int, default=3, help="tune each model's k heaviest tasks")
    ap.add_argument("--rounds", type=int, default=10, help="timing rounds per cell, median")
    ap.add_argument("--deadline-s", type=float, default=530, help="all done (files written) within this")
    ap.add_argument("--device", choices=["gpu", "cpu"], default="gpu", help="cpu: rehearse the flow on this host")
    ap.add_argument("--gpu-index", type=int, default=None, help="run here on this GPU (a child, or by hand)")
    ap.add_argument("--work-dir", default="/tmp/share_matrix")
    ap.add_argument("--out-json", default=None)
    ap.add_argument("--merge", nargs="*", help="join these JSON files into --out-json (+ PNG) and stop")
    args = ap.parse_args()
    if args.merge:
        merge(args.merge, Path(args.out_json or "bench/results/share_matrix_h200.json"))
        return
    # an evolutionary search round costs ~15 s whatever its size: few large rounds fit the call best
    roomy = args.device == "gpu" and len(gpus()) >= len(args.models.split(","))
    args.trials = args.trials or (48 if roomy else 24)
    args.per_iter = args.per_iter or (16 if roomy else 8)
    if args.gpu_index is not None:  # a child (or a single run by hand)
        args.out_json = args.out_json or str(OUT / "share_matrix.json")
        run_models(args, args.models.split(","), time.time() + args.deadline_s)
        return
    args.gpu_index = 0
    launch(args)


if __name__ == "__main__":
    main()

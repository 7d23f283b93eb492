"""Stock MetaSchedule as the benchmarks run it (DESIGN.md section 4), each run in a fresh process of its own so
that nothing of this service's set-up is loaded there (its logs are read by sharetune.experiments.throughput).

    python -m bench.harness.stock tasks ...   # tune_tasks on every task, until stopped or at its budget
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from bench.harness.common import child_env, module_command

STOCK_BUILDER_TIMEOUT_S = 120.0


def make_target(rehearse: bool):
    """The lanes' target: an H200's, or one CPU core's when rehearsing."""
    from services.measurer.metaschedule.targets import cpu_target, gpu_target

    return cpu_target(1) if rehearse else gpu_target()


def _tune_tasks(args) -> int:
    """The child: stock tune_tasks on every task of args.model (a zoo or panel model), until its parent ends it
    or at its budget; tasks.json names each task's workload (its structural hash) and weight."""
    from tvm.s_tir import meta_schedule as ms

    from bench.panel import relax
    from services.tuner.metaschedule.extract import fuse, tvm_ffi_structural_hash

    work = Path(args.stock_work)
    extracted = ms.relax_integration.extract_tasks(fuse(relax(args.model)), make_target(args.rehearse))
    (work / "tasks.json").write_text(json.dumps([
        {"name": t.task_name, "weight": int(t.weight), "shash": str(tvm_ffi_structural_hash(t.dispatched[0]))}
        for t in extracted]))
    contexts, weights = ms.relax_integration.extracted_tasks_to_tune_contexts(extracted, str(work), seed=0)
    tune_tasks(contexts, weights, str(work), args.stock_max_trials, args.per_iter, len(os.sched_getaffinity(0)))
    return 0


def tune_tasks(contexts, weights, work: str, trials: int, per_iter: int, workers: int):
    """Stock tune_tasks as DESIGN.md section 4 runs it: LocalBuilder on `workers` cores, LocalRunner."""
    from tvm.s_tir import meta_schedule as ms

    return ms.tune_tasks(tasks=contexts, task_weights=weights, work_dir=work, max_trials_global=trials,
                         num_trials_per_iter=per_iter,
                         builder=ms.builder.LocalBuilder(max_workers=workers, timeout_sec=STOCK_BUILDER_TIMEOUT_S),
                         runner=ms.runner.LocalRunner(timeout_sec=60), database=ms.database.JSONDatabase(work_dir=work))


def spawn_tune_tasks(model: str, work: Path, per_iter: int, max_trials: int, cores: str | None,
                     gpu_uuid: str | None, rehearse: bool, log_path: Path) -> subprocess.Popen:
    """The tune_tasks child on `cores` (None: this process's) and the GPU `gpu_uuid` (None: every GPU this
    process sees), in a process group of its own."""
    env = child_env(CUDA_VISIBLE_DEVICES=gpu_uuid) if gpu_uuid else child_env()
    cmd = (["taskset", "-c", cores] if cores else []) + module_command(
        "bench.harness.stock", "tasks", "--model", model, "--stock-work", work, "--per-iter", per_iter,
        "--stock-max-trials", max_trials) + (["--rehearse"] if rehearse else [])
    with open(log_path, "w") as log:
        return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def kill_group(proc: subprocess.Popen) -> None:
    """The child and its builder pool: one process group."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(30)


def stock_records(work: Path) -> list[str]:
    path = work / "database_tuning_record.json"
    return path.read_text().splitlines() if path.exists() else []


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("how", choices=["tasks"])
    ap.add_argument("--model", required=True)
    ap.add_argument("--per-iter", type=int, required=True)
    ap.add_argument("--stock-work", required=True, help="its work dir and JSON database")
    ap.add_argument("--stock-max-trials", type=int, default=100000)
    ap.add_argument("--rehearse", action="store_true", help="one CPU core's target instead of the GPU's")
    return _tune_tasks(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

"""Tuned models compiled and timed: a JSON database (cut to its first N trials) compiled into the model in a
child process, the modules timed together in a fresh process (sharetune.experiments.model_timing) at a GPU share
or on one core; a job's records exported as stock's JSON database.

    python -m bench.harness.serving [--db DIR --first N] --cut-dir DIR --out-module LIB --model M [--rehearse]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
from pathlib import Path

from bench.harness.common import child_env, last_json_line, module_command
from bench.harness.stock import make_target


def compile_from_records(args) -> int:
    """In its own process: the model (zoo or panel) compiled with a JSON database cut to its first --first trials
    (0: all of them; no --db: untuned, as the service compiles its baseline)."""
    from bench.panel import relax
    from services.tuner.metaschedule.compile import compile_tuned, compile_untuned

    if not args.db:
        compile_untuned(relax(args.model), make_target(args.rehearse), args.out_module)
        return 0
    db_dir, cut = Path(args.db), Path(args.cut_dir)
    cut.mkdir(parents=True, exist_ok=True)
    (cut / "database_workload.json").write_text((db_dir / "database_workload.json").read_text())
    lines = (db_dir / "database_tuning_record.json").read_text().splitlines()
    valid = db_dir / "trial_valid.json"  # ours: N trials hold this many valid records; stock's file holds all
    if args.first:
        lines = lines[: sum(json.loads(valid.read_text())[: args.first]) if valid.exists() else args.first]
    (cut / "database_tuning_record.json").write_text("\n".join(lines) + ("\n" if lines else ""))
    compile_tuned(relax(args.model), make_target(args.rehearse), str(cut), args.out_module)
    print(json.dumps({"module": args.out_module, "records": len(lines)}), flush=True)
    return 0


def compile_command(model: str, db, module: Path, first: int, rehearse: bool) -> list[str]:
    return module_command("bench.harness.serving", "--db", db or "", "--first", first, "--cut-dir", f"{module}.db",
                          "--out-module", module, "--model", model) + (["--rehearse"] if rehearse else [])


def spawn_compile(db: Path, first: int, module: Path, cores: str, gpu_uuid: str | None, model: str,
                  rehearse: bool) -> subprocess.Popen:
    """The model compiled from the first `first` trials of the database `db` into `module`, in a child on
    `cores`; its log beside the module."""
    env = child_env(TVM_NUM_THREADS="1", **({"CUDA_VISIBLE_DEVICES": gpu_uuid} if gpu_uuid else {}))
    with open(f"{module}.log", "w") as log:
        return subprocess.Popen(["taskset", "-c", cores] + compile_command(model, db, module, first, rehearse),
                                env=env, stdout=log, stderr=subprocess.STDOUT)


def serve(modules: dict[str, str], model: str, work: Path, rounds: int, gpu_uuid: str | None = None,
          share: int | None = None, mps_env: dict | None = None, check: bool = False, timeout_s: float = 300,
          gpu: bool = False, kernels: dict | None = None) -> dict:
    """Time the modules in one fresh process, interleaved: on the GPU `gpu_uuid` (at `share` % under the MPS
    daemon of `mps_env`), on the GPUs this process sees with `gpu`, else on core 0; with `check`, each output
    against PyTorch's. `model`: a zoo or panel model."""
    import numpy as np

    from bench.panel import build
    from sharetune.intake import reference_output

    module, example = build(model)
    work.mkdir(parents=True, exist_ok=True)
    inputs = work / f"inputs-{model}.npz"
    np.savez(inputs, **{f"arg{i}": t.detach().numpy() for i, t in enumerate(example)})
    cmd = module_command("sharetune.experiments.model_timing", "--inputs", inputs, "--rounds", rounds)
    if check:
        np.save(work / f"reference-{model}.npy", reference_output(module, example))
        cmd += ["--reference", str(work / f"reference-{model}.npy")]
    env = child_env(TVM_NUM_THREADS="1")
    if gpu_uuid:
        env.update(mps_env or {}, CUDA_VISIBLE_DEVICES=gpu_uuid)
        if share is not None:
            env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(share)
    if gpu_uuid or gpu:
        cmd += ["--device", "gpu"]
    else:
        cmd += ["--device", "cpu", "--cores", "0"]
    for label, path in modules.items():
        cmd += ["--module", f"{label}={path}"]
    for label, folder in (kernels or {}).items():  # each task's kernel too (task_timing.build_kernels folders)
        cmd += ["--kernels", f"{label}={folder}"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    answer = last_json_line(out, "serve")
    return answer if "serve" not in answer else {"latency_us": {}, "errors": answer}


@contextlib.contextmanager
def serving_mps(directory: Path, needed: bool):
    """An MPS daemon to serve at a share below 100 % (each stack stopped its own); yields its environment."""
    if not needed:
        yield {}
        return
    from services.measurer.gpu import MpsDaemon

    mps = MpsDaemon(directory / "pipe", directory / "log")
    mps.start()
    try:
        yield mps.environment()
    finally:
        mps.stop()


def export_job_records(redis_url: str, job_id: str, out: Path) -> int:
    """The job's records in the order they were measured, as a stock JSON database of the valid ones,
    with trial_valid.json saying which trials were valid (so a cut at N trials counts failures too, as
    stock's trial count does); returns the trials."""
    from tvm.s_tir import meta_schedule as ms

    from shared import store
    from services.tuner.metaschedule.ir_codec import load_ir
    from services.tuner.metaschedule.records import tvm_record

    r = store.connect(redis_url)
    out.mkdir(parents=True, exist_ok=True)
    for name in ("database_workload.json", "database_tuning_record.json"):
        (out / name).unlink(missing_ok=True)
    db = ms.database.JSONDatabase(work_dir=str(out), module_equality="structural")
    recs, names = [], {}  # names: which workload is which task's (time_to_quality.workload_names)
    for task in store.job_tasks(r, job_id):
        wl = db.commit_workload(load_ir(store.workload(r, task.wkey).mod))
        names[task.name] = str(wl.as_json()[0])
        recs += [(rec, wl) for rec in store.records(r, task.wkey) if rec.job_id == job_id]
    recs.sort(key=lambda x: x[0].measured_at)
    # a screened-out candidate's brief figure is a trial but, as in the service's own export, not a record
    # the model is compiled from
    valid = [bool(rec.run_secs) and not rec.error and rec.timing == "full" for rec, _ in recs]
    for (rec, wl), ok in zip(recs, valid):
        if ok:
            db.commit_tuning_record(tvm_record(rec, wl))
    (out / "trial_valid.json").write_text(json.dumps(valid))
    (out / "workload_tasks.json").write_text(json.dumps(names))
    return len(recs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--db", default="", help="none: untuned")
    ap.add_argument("--first", type=int, default=0, help="0: every record")
    ap.add_argument("--cut-dir", required=True)
    ap.add_argument("--out-module", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--rehearse", action="store_true")
    return compile_from_records(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

"""Duplicate CUDA sources among a tuning job's builds: different traces can lower to the same kernel (an unroll
annotation on a loop it does not change, an equivalent split), and each such build pays NVRTC again. Every record
of each job is lowered again here (no GPU), its CUDA source hashed; each distinct source is compiled once with
NVRTC, so a duplicate costs what its first build cost. Jobs: the H200 scale run's (an archive of their records
databases, which hold only the fully timed trials: screened-out and failed ones are not kept) and, as complete
jobs, stock MetaSchedule's time-to-quality databases (kept in the repo; every trial, failures included).

    python -m bench.build_duplicates --archive .dev/scale1_records.tgz   # ~20 min on 2 cores
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import tarfile
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from bench.build_tail import _compile_cpu, lowered, nvrtc_setup
from bench.harness.common import kept_in_repo, results_path, write_results
from sharetune.experiments.throughput import duplicate_source_figures

BUILDERS = 16  # builder processes per family in the scale run: each takes a job's next candidate from one queue
ROUND = 64  # trials_per_iter: a task's round of candidates


def job_rows(db_dir: str) -> list[dict]:
    """Each record in trial order: its trial number, task, source hash, lowering CPU and its source's NVRTC CPU."""
    import tvm_ffi
    from tvm.s_tir import meta_schedule as ms

    target, cc, build = nvrtc_setup()
    valid = Path(db_dir) / "trial_valid.json"  # ours: which of the job's trials the database kept
    trials = ([i for i, ok in enumerate(json.loads(valid.read_text())) if ok] if valid.exists() else None)
    db = ms.database.JSONDatabase(work_dir=db_dir, module_equality="structural")
    rows, nvrtc_of = [], {}
    for i, rec in enumerate(db.get_all_tuning_records()):
        try:
            source, lower = lowered(rec, target, build, count_trace=True)
        except Exception:  # noqa: BLE001 - a trial whose build failed: no source to share
            continue
        key = hashlib.sha256(source.encode()).hexdigest()[:16]
        if key not in nvrtc_of:
            c0 = time.process_time()
            with contextlib.suppress(RuntimeError):  # NVRTC refused it: the build still paid for trying
                _compile_cpu(cc, source, 0.0)
            nvrtc_of[key] = time.process_time() - c0
        rows.append({"trial": trials[i] if trials else i, "task": str(tvm_ffi.structural_hash(rec.workload.mod)),
                     "source": key, "lower_cpu_s": round(lower, 3), "nvrtc_cpu_s": round(nvrtc_of[key], 3)})
    return rows


def jobs(archive: str, work: Path) -> dict[str, str]:
    with tarfile.open(archive) as tar:
        tar.extractall(work, filter="data")
    ours = {f"{p.parts[-3]}/{p.parts[-2].split('-')[1]}": str(p) for p in sorted(work.glob("*/*/*/records_db"))}
    stock = kept_in_repo("time_to_quality_stock")
    return {**ours, **{f"{p.name}/stock": str(p) for p in sorted(stock.iterdir()) if p.is_dir()}}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--archive", default=".dev/scale1_records.tgz", help="the scale run's records databases")
    ap.add_argument("--workers", type=int, default=2, help="processes, a job each at a time")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as work, ProcessPoolExecutor(args.workers) as pool:
        found = jobs(args.archive, Path(work))
        rows = dict(zip(found, pool.map(job_rows, found.values())))
    per_job = {}
    for name, job in rows.items():  # sources the same model's other jobs built: what a builder kept across jobs
        others = {r["source"] for n, rs in rows.items() if n != name and n.split("/")[0] == name.split("/")[0]
                  and n.endswith("/stock") == name.endswith("/stock") for r in rs}
        per_job[name] = duplicate_source_figures(job, others, BUILDERS, ROUND)
    print(json.dumps(per_job, indent=1))
    write_results({"per_job": per_job, "rows": rows}, results_path("build_duplicates.json"),
                  "bench.build_duplicates", argv)


if __name__ == "__main__":
    main()

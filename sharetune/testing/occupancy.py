"""How much of the GPU a tuned kernel uses: each workload's best record in a MetaSchedule database, its FLOPs, time,
fp32 TFLOPS, and the thread blocks and threads a block it launches (read off the scheduled module's bindings).
No GPU. Results: docs/time_to_quality.md, "Split-K".

    mkdir -p /tmp/dbs && tar xJf bench/results/time_to_quality_dbs.tar.xz -C /tmp/dbs
    python -m sharetune.testing.occupancy /tmp/dbs/time_to_quality_runs/cold-wav2vec2-conv-h200-2026-12-07/database
"""
from __future__ import annotations

import argparse
import json
import math
import re

_BINDING = re.compile(r'T\.thread_binding\((?:T\.int64\()?(\d+)\)?, thread="([a-zA-Z.]+)"')


def bests(db) -> list:
    """(median seconds, record) of each workload's fastest record."""
    import tvm_ffi

    best: dict = {}
    for rec in db.get_all_tuning_records():
        if rec.run_secs:
            secs = sorted(float(s) for s in rec.run_secs)[len(rec.run_secs) // 2]
            key = tvm_ffi.structural_hash(rec.workload.mod)
            if key not in best or secs < best[key][0]:
                best[key] = (secs, rec)
    return sorted(best.values(), key=lambda b: -b[0])


def split_bests_us(database_dir: str | None) -> list[float] | None:
    """The microseconds of each workload's best record that splits its reduction across thread blocks (an RFactor
    in its trace: services/tuner/metaschedule/split_k.py), fastest first; None where the database cannot be read."""
    import os

    if not database_dir or not os.path.isdir(database_dir):
        return None
    try:
        from tvm.s_tir import meta_schedule as ms

        db = ms.database.JSONDatabase(work_dir=database_dir, allow_missing=False)
        found = [secs for secs, rec in bests(db) if any(i.kind.name == "RFactor" for i in rec.trace.insts)]
    except Exception:  # noqa: BLE001 -- a database this cannot read says nothing either way
        return None
    return sorted(round(secs * 1e6, 2) for secs in found)


def launch(rec) -> dict:
    """The record's schedule as launched: how many kernels (a blockIdx binding after a threadIdx one opens the
    next), and the first kernel's thread blocks (its blockIdx extents' product) and threads a block (the first extent
    bound to each threadIdx axis)."""
    from tvm.s_tir import Schedule

    sch = Schedule(rec.workload.mod)
    rec.trace.apply_to_schedule(sch, remove_postproc=False)
    kernels: list[dict] = []
    for ext, tag in _BINDING.findall(sch.mod.script()):
        if tag.startswith("blockIdx"):
            if not kernels or kernels[-1]["threads"]:
                kernels.append({"blocks": 1, "threads": {}})
            kernels[-1]["blocks"] *= int(ext)
        elif tag.startswith("threadIdx") and kernels:
            kernels[-1]["threads"].setdefault(tag, int(ext))
    first = kernels[0] if kernels else {"blocks": 1, "threads": {}}
    return {"blocks": first["blocks"], "threads_per_block": math.prod(first["threads"].values()),
            "kernels": len(kernels)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("databases", nargs="+", help="JSONDatabase folders")
    ap.add_argument("--min-us", type=float, default=6.0, help="leave out kernels faster than this")
    args = ap.parse_args(argv)
    import tvm
    from tvm.s_tir import meta_schedule as ms

    for path in args.databases:
        db = ms.database.JSONDatabase(work_dir=path, allow_missing=False)
        for secs, rec in bests(db):
            if secs * 1e6 < args.min_us:
                continue
            flops = float(tvm.s_tir.analysis.estimate_tir_flops(rec.workload.mod))
            print(json.dumps({"database": path, "us": round(secs * 1e6, 2), "gflop": round(flops / 1e9, 4),
                              "tflops": round(flops / secs / 1e12, 2), **launch(rec)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What a CUDA source size limit (LaneSettings.cuda_compile_source_limit_kb) would cut and save, on top of the
compile CPU limit, from the build tail's records (bench/results/build_tail.json: every record of stock
MetaSchedule's panel databases built again, its source size, its compile CPU with no limit and under each CPU
limit, its H200 time). A refused source costs its lowering only.

    python -m sharetune.experiments.build_limits [bench/results/build_tail.json] [--cpu-limit 4]
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict

SOURCE_LIMITS_KB = (200, 250, 300, 400, 600)


def compile_cpu(row: dict, cpu_limit: str) -> float:
    """A record's compile CPU under the CPU limit (its cut compile's seconds where the limit stopped it)."""
    cut = row["limited"].get(cpu_limit)
    return cut["cpu_s"] if cut and "cpu_s" in cut else row["nvrtc_cpu_s"]


def source_limit_effect(rows: list[dict], limit_kb: float, cpu_limit: str) -> dict:
    """Records refused at `limit_kb`, the build CPU saved against the CPU limit alone (overall and per model),
    and how close the refused ones came to their task's best on the H200."""
    best: dict[str, float] = defaultdict(lambda: float("inf"))
    for row in rows:
        best[row["workload"]] = min(best[row["workload"]], row["us"])

    def cost(rs, refuse: bool) -> float:
        return sum(r["lower_cpu_s"] + (0.0 if refuse and r["source_kb"] > limit_kb else compile_cpu(r, cpu_limit))
                   for r in rs)

    refused = [r for r in rows if r["source_kb"] > limit_kb]
    ratios = sorted(r["us"] / best[r["workload"]] for r in refused)
    per_model = {m: round(1 - cost(rs, True) / cost(rs, False), 3)
                 for m in sorted({r["model"] for r in rows}) for rs in [[r for r in rows if r["model"] == m]]}
    return {"source_limit_kb": limit_kb, "refused": len(refused), "refused_frac": round(len(refused) / len(rows), 4),
            "build_cpu_saved_frac": round(1 - cost(rows, True) / cost(rows, False), 3),
            "build_cpu_saved_frac_by_model": per_model,
            "task_bests_refused": sum(x == 1.0 for x in ratios),
            "refused_within_1_1x_of_task_best": sum(x < 1.1 for x in ratios),
            "closest_refused_vs_task_best": round(ratios[0], 3) if ratios else None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sharetune.experiments.build_limits")
    ap.add_argument("records", nargs="?", default="bench/results/build_tail.json")
    ap.add_argument("--cpu-limit", default="4.0", help="the compile CPU limit in force (one the records were cut at)")
    args = ap.parse_args(argv)
    with open(args.records) as f:
        rows = json.load(f)["rows"]
    print(f"{len(rows)} records; against the {args.cpu_limit} s compile CPU limit alone:")
    for kb in SOURCE_LIMITS_KB:
        print(json.dumps(source_limit_effect(rows, kb, args.cpu_limit)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

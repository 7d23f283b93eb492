"""One panel model's cold time-to-quality runs under a setting's values, alternating on one GPU (an A/B in one
lease): each run is `python -m bench.time_to_quality --phases cold` with the setting in its environment, its own
$OUT and work dir; after each run, the runs so far are merged into $OUT/time_to_quality_ab.json
(sharetune.experiments.time_to_quality.settings_ab: per run and the means per value).

    python -m sharetune.testing.settings_ab vit-s-encoder 2 SHARETUNE_PAD_AWKWARD=matmul,off --trials 384 --per-iter 64
    ... efficientnet-mbconv 1 SHARETUNE_PAD_AWKWARD=matmul,off --rehearse --trials 16 --per-iter 8   # CPU lanes
    python -m sharetune.testing.settings_ab --merge MODEL OUT.json VALUE=RUN.json ...                 # merge only

(A line of a plan, `bash bench/device_run.sh plan FILE`, runs it in the background on the GPU machine:
bench/plans/ttq_next.txt.)"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from sharetune.experiments.time_to_quality import settings_ab
from sharetune.testing.occupancy import split_bests_us


def merge(model: str, dest: Path, runs: list[str]) -> dict:
    pairs = [(value, json.loads(Path(path).read_text())) for value, path in (r.split("=", 1) for r in runs)]
    merged = settings_ab(pairs, model)
    dest.write_text(json.dumps(merged, indent=1))
    return merged


def with_split_bests(result: dict, model: str) -> dict:
    """The run's result with its cold run's `split_bests_us` (sharetune.testing.occupancy.split_bests_us, read from
    the run's exported database while it is still on this machine)."""
    cold = (result.get("models", {}).get(model) or {}).get("cold")
    if cold is not None:
        cold["split_bests_us"] = split_bests_us(cold.get("database_dir"))
    return result


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--merge"]:
        print(json.dumps(merge(argv[1], Path(argv[2]), argv[3:])["summary"], indent=1))
        return 0
    ap = argparse.ArgumentParser(prog="python -m sharetune.testing.settings_ab", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work-dir", default="/tmp/settings_ab", help="each run's work dir and $OUT go under here")
    ap.add_argument("model")
    ap.add_argument("repeats", type=int)
    ap.add_argument("setting", help="VAR=V1,V2: the environment variable and the values it takes in turn")
    args, rest = ap.parse_known_args(argv)
    var, _, values = args.setting.partition("=")
    out = Path(os.environ.get("OUT", args.work_dir))
    out.mkdir(parents=True, exist_ok=True)
    done: list[str] = []
    for i in range(1, args.repeats + 1):
        for value in values.split(","):
            run_out = Path(args.work_dir) / "out" / f"{value}-{i}"
            run_out.mkdir(parents=True, exist_ok=True)
            env = {**os.environ, var: value, "OUT": str(run_out)}
            lease = f"{time.strftime('%Y-%m-%d %H:%M', time.gmtime())} {var}={value} run {i}"
            rc = subprocess.call([sys.executable, "-m", "bench.time_to_quality", "--work-dir",
                                  str(Path(args.work_dir) / f"{value}-{i}"), "--models", args.model, "--phases", "cold",
                                  "--lease", lease, *rest], env=env)
            found = sorted(run_out.glob("time_to_quality_*.json"))
            if rc != 0 or not found:
                print(f"run {value}-{i} failed (exit {rc}); the others go on", flush=True)
                continue
            kept = out / f"ab_{value}-{i}.json"
            kept.write_text(json.dumps(with_split_bests(json.loads(found[0].read_text()), args.model)))
            done.append(f"{value}={kept}")
            print(json.dumps(merge(args.model, out / "time_to_quality_ab.json", done)["summary"]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

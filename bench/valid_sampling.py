"""What valid sampling saves in a cold CUDA round of 64 candidates, one thread, per task, three ways (MODES of
sharetune.testing.sampling_rounds; --evolution: an evolutionary round after a cold one): search CPU a valid candidate,
samples replayed, rejections; --builds: a cold round built now and before (sharetune.testing.build_cost); --ranked: a
warm first round ranking a 3x pool, VerifyGPUCode on every draw against on the picks only. No GPU.
Results: docs/time_to_quality.md (Valid first rounds), docs/benchmarks.md (What a build costs).

    python -m bench.valid_sampling     # bench/results/valid_sampling_cpu.json
    python -m bench.valid_sampling --evolution --tasks efficientnet-mbconv:conv2d1 --out /tmp/evolution.json
    python -m bench.valid_sampling --builds --candidates 16 --out bench/results/build_cost_cpu.json
    python -m bench.valid_sampling --ranked --out bench/results/ranked_round_cpu.json
"""
from __future__ import annotations

import argparse
import sys

from bench.harness.common import write_results
from bench.panel import PANEL, build

DEFAULT_TASKS = ("resnet18:conv2d1,resnet18:conv2d9,transformer:fused_matmul_add,"
                 "efficientnet-mbconv:conv2d1,efficientnet-mbconv:fused_conv2d3_add1_tir_sigmoid3_multiply3,"
                 "efficientnet-mbconv:conv2d,regnety-stage:conv2d1,regnety-stage:conv2d6,"
                 "regnety-stage:fused_conv2d8_add1_tir_sigmoid_multiply,wav2vec2-conv:conv1d1,"
                 "wav2vec2-conv:conv1d2,vit-s-encoder:fused_matmul_add,vit-s-encoder:matmul2")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tasks", default=DEFAULT_TASKS, help="comma-separated model:task")
    ap.add_argument("--candidates", type=int, default=64)
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--out", default="bench/results/valid_sampling_cpu.json")
    ap.add_argument("--evolution", action="store_true", help="an evolutionary round, three ways, instead")
    ap.add_argument("--builds", action="store_true", help="a cold round's builds, now against before, instead")
    ap.add_argument("--ranked", action="store_true", help="a ranked (warm) first round, two ways, instead")
    args = ap.parse_args(argv)
    from services.measurer.metaschedule.targets import family_target
    from services.tuner.metaschedule.extract import extract
    from services.tuner.metaschedule.intrinsics import load_tensor_intrinsics
    from sharetune.intake import to_relax
    from sharetune.testing import build_cost, sampling_rounds as rounds

    load_tensor_intrinsics("cuda")  # as a CUDA tuner does before its first TuneContext
    target = family_target(f"cuda.{args.arch}")
    modes, one_round = ((build_cost.BUILD_MODES, build_cost.build_round) if args.builds else (
        rounds.RANKED_MODES, rounds.ranked_round) if args.ranked else (rounds.EVOLUTION_MODES,
                        rounds.evolution_round) if args.evolution else (rounds.MODES, rounds.cold_round))
    models: dict = {}
    rows = []
    for spec in args.tasks.split(","):
        model, _, name = spec.partition(":")
        if model not in models:
            relax_model = to_relax(*build(model)) if model in PANEL else to_relax(model)
            models[model] = {t.name: t for t in extract(relax_model.mod, target)}
        for mode in modes:
            rows.append({"model": model, "task": name, **one_round(models[model][name], target, mode, args.candidates)})
            print(spec, {k: v for k, v in rows[-1].items() if k not in ("model", "task")}, flush=True)
    print("wrote", write_results({"target": str(target), "candidates": args.candidates, "threads": 1, "modes": list(
        modes), "rows": rows, **({"summary": build_cost.summary(rows)} if args.builds else {})}, args.out,
        "bench.valid_sampling", argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())

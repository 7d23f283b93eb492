"""Whether a build's own GPU-limits check (services/measurer/metaschedule/gpu_limits.py) says what MetaSchedule's
VerifyGPUCode says, on raw random samples of a task's design spaces (decisions drawn as stock replay-trace draws
them, the postprocessors before VerifyGPUCode run, many samples over a limit): per sample the postprocessor's verdict
and the build's (its lowering stopped right after the check). `disagree` lists the samples where they differ;
`fail_to_build_anyway` those VerifyGPUCode passes whose build raises in a later pass (no kernel either way). Needs
no GPU; tests/test_validity.py asserts with it.

    python -m sharetune.testing.gpu_limits --tasks resnet18:conv2d1,vit-s-encoder:fused_matmul_add --samples 100
    (--rounds: also the search CPU a valid candidate of a cold and an evolutionary round, the check in the search
    against in the builds)
"""
from __future__ import annotations

import argparse
import json
import time


_STOP = "stopped after the GPU-limits check"


class _Stop(Exception):
    """Raised after the check passed: the rest of the build is not needed here."""


def _build_verdict(mod, target, instruments: list) -> tuple[bool, str]:
    """(whether the build's lowering reached the stop after its check, else the error it raised)."""
    import tvm

    try:
        with target, tvm.transform.PassContext(instruments=instruments):
            tvm.build(mod, target=target)
        return True, ""  # not reached: the stop ends every build that passed
    except Exception as err:  # noqa: BLE001 -- TVM wraps what an instrument raises
        if _STOP in str(err):
            return True, ""
        return False, str(err).strip().splitlines()[-1][:300]  # over a limit, or a pass raised: no kernel either way


def verdicts(task, target, samples: int, seed: int = 1) -> dict:
    """{'samples', 'postproc_rejects', 'build_rejects', 'disagree', 'fail_to_build_anyway', 'postproc_cpu_s',
    'check_cpu_s'} over raw samples of `task` that the other postprocessors let through (`check_cpu_s`: the build's
    lowering up to and with the check)."""
    import random

    import tvm
    from tvm.s_tir import meta_schedule as ms
    from tvm.s_tir.schedule import Schedule, Trace

    from services.measurer.metaschedule.gpu_limits import AFTER_PASS, CheckGPULimits
    from services.tuner.metaschedule.validity import cuda_postprocs

    ctx = ms.TuneContext(mod=task.mod, target=target, task_name=task.name, num_threads=1,
                         space_generator=ms.space_generator.PostOrderApply(postprocs=cuda_postprocs(target)),
                         search_strategy=ms.search_strategy.ReplayTrace())
    spaces = ctx.generate_design_space()
    posts = [p for p in ctx.space_generator.postprocs if type(p).__name__ not in ("GPUPrecheck", "VerifyGPUCode")]
    verify = next(p for p in ctx.space_generator.postprocs if type(p).__name__ == "VerifyGPUCode")

    @tvm.instrument.pass_instrument
    class StopAfterCheck:
        def run_after_pass(self, mod, info):
            if info.name == AFTER_PASS:
                raise _Stop(_STOP)

    rng = random.Random(seed)
    out = {"samples": 0, "postproc_rejects": 0, "build_rejects": 0, "disagree": [], "fail_to_build_anyway": [],
           "postproc_cpu_s": 0.0,
           "check_cpu_s": 0.0}
    tries = 0
    while out["samples"] < samples and tries < 20 * samples:
        tries += 1
        space = spaces[rng.randrange(len(spaces))]
        sch = Schedule(task.mod, seed=rng.getrandbits(31) + 1, debug_mask=0, error_render_level="none")
        try:
            Trace(space.trace.insts, {}).apply_to_schedule(sch, remove_postproc=True)
            sch.enter_postproc()
            if not all(p.apply(sch) for p in posts):
                continue
        except Exception:  # noqa: BLE001 -- a sample TVM cannot schedule says nothing of the check
            continue
        c0 = time.process_time()
        ok_post = bool(verify.apply(sch.copy()))
        c1 = time.process_time()
        ok_build, why = _build_verdict(sch.mod, target, [CheckGPULimits(target), StopAfterCheck()])
        out["check_cpu_s"] += time.process_time() - c1
        out["postproc_cpu_s"] += c1 - c0
        out["samples"] += 1
        out["postproc_rejects"] += not ok_post
        out["build_rejects"] += not ok_build
        if ok_post and not ok_build and "breaks the GPU's limits" not in why:
            out["fail_to_build_anyway"].append(why)  # a later pass of the build raised: no kernel either way
        elif ok_post != ok_build:
            out["disagree"].append({"postproc": ok_post, "build": ok_build, "build_error": why})
    out["postproc_cpu_s"], out["check_cpu_s"] = round(out["postproc_cpu_s"], 2), round(out["check_cpu_s"], 2)
    return out


ROUND_MODES = (("cold", "tile draws"), ("cold", "tile draws, verified in build"), ("evolution", "ValidEvolution"),
               ("evolution", "ValidEvolution, verified in build"))


def rounds(task, target, candidates: int = 64) -> list[dict]:
    """A cold round and an evolutionary round of `task`, each with the proposals checked by VerifyGPUCode in the
    search and left to the builders: search CPU a valid candidate (sharetune.testing.sampling_rounds, one thread)."""
    from sharetune.testing import sampling_rounds

    out = []
    for kind, mode in ROUND_MODES:
        one = sampling_rounds.cold_round if kind == "cold" else sampling_rounds.evolution_round
        row = one(task, target, mode, candidates)
        out.append({"round": kind, "mode": mode, "valid": row["valid"], "cpu_s_per_valid": row["cpu_s_per_valid"]})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sharetune.testing.gpu_limits")
    ap.add_argument("--tasks", default="resnet18:conv2d1,vit-s-encoder:fused_matmul_add")
    ap.add_argument("--samples", type=int, default=100)
    ap.add_argument("--out", default="")
    ap.add_argument("--rounds", action="store_true", help="also a cold and an evolutionary round each way: search CPU")
    args = ap.parse_args(argv)
    from bench.panel import PANEL, build
    from services.measurer.metaschedule.targets import family_target
    from services.tuner.metaschedule.extract import extract
    from services.tuner.metaschedule.intrinsics import load_tensor_intrinsics
    from sharetune.intake import to_relax

    load_tensor_intrinsics("cuda")
    target = family_target("cuda.sm_90")
    rows, models = [], {}
    for spec in args.tasks.split(","):
        model, _, name = spec.partition(":")
        if model not in models:
            models[model] = {t.name: t for t in extract((to_relax(*build(model)) if model in PANEL
                                                         else to_relax(model)).mod, target)}
        task = models[model][name]
        rows.append({"model": model, "task": name, **verdicts(task, target, args.samples),
                     **({"rounds": rounds(task, target)} if args.rounds else {})})
        print(json.dumps(rows[-1]), flush=True)
    if args.out:
        from bench.harness.common import write_results

        write_results({"target": str(target), "rows": rows}, args.out, "sharetune.testing.gpu_limits", argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

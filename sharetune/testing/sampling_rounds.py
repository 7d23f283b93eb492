"""One search round of a CUDA task on the CPU, counted: what the tile limits and the precheck save in a cold round
(MODES: TVM's replay-trace with its postprocessors alone, with the precheck first, and tile draws within the
limits, what a cold round runs), an evolutionary round after a cold one (EVOLUTION_MODES) and a warm first round
ranked by a trained model (RANKED_MODES). Each row: the
candidates, the samples replayed, which postprocessor rejected them, search CPU seconds per valid candidate. Needs
no GPU. bench/valid_sampling.py runs it over tasks; tests/test_validity.py asserts with it."""
from __future__ import annotations

import contextlib
import time

MODES = ("off", "precheck", "tile draws", "tile draws, verified in build")


def counting(postprocs, skip: tuple = ()):
    """The postprocessors, each wrapped to count its calls and rejections (so samples drawn = calls of
    the first, rejected by X = X's rejections); those named in `skip` left as they are."""
    from tvm.ir.utils import derived_object
    from tvm.s_tir.meta_schedule.postproc import PyPostproc

    @derived_object
    class Counted(PyPostproc):
        def __init__(self, inner, name):
            super().__init__()
            self.inner, self.name, self.calls, self.rejects = inner, name, 0, 0

        def _initialize_with_tune_context(self, context):
            self.inner._initialize_with_tune_context(context)  # noqa: SLF001

        def apply(self, sch):
            self.calls += 1
            ok = bool(self.inner.apply(sch))
            self.rejects += not ok
            return ok

        def clone(self):
            return self

    return [p if type(p).__name__ in skip else Counted(p, type(p).__name__) for p in postprocs]


def cold_round(task, target, mode: str, candidates: int) -> dict:
    from tvm.s_tir import meta_schedule as ms

    from services.tuner.metaschedule import validity
    from services.tuner.metaschedule.sampling import ValidReplay

    precheck = mode != "off"
    base = validity.cuda_postprocs(target) if precheck else ms.postproc.Postproc.create(validity.rule_kind(target))
    in_build = mode == "tile draws, verified in build"  # the search must see VerifyGPUCode as itself to leave it out
    wrapped = counting(base, skip=("VerifyGPUCode",) if in_build else ())
    strategy = ValidReplay(seed=1, threads=1, verify_in_build=in_build) if mode.startswith("tile draws") \
        else "replay-trace"
    # the same space generator context.py builds, with every postprocessor counted
    ctx = ms.TuneContext(mod=task.mod, target=target,
                         space_generator=ms.space_generator.PostOrderApply(postprocs=wrapped),
                         search_strategy=strategy, task_name=task.name, rand_state=1, num_threads=1)
    ctx.pre_tuning(candidates, candidates, ctx.generate_design_space(), ms.database.MemoryDatabase(),
                   ms.cost_model.RandomModel())
    t0, c0 = time.perf_counter(), time.process_time()
    cands = ctx.generate_measure_candidates() or []
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    drawn = wrapped[0].calls
    rejected = {w.name: w.rejects for w in wrapped if getattr(w, "rejects", 0)}
    return {"mode": mode, "precheck": precheck, "valid": len(cands), "drawn": drawn,
            "tile_draws": strategy.draws.drawn if mode.startswith("tile draws") else None,
            "search_cpu_s": round(cpu, 2),
            "search_wall_s": round(wall, 2), "cpu_s_per_valid": round(cpu / max(1, len(cands)), 3),
            "rejected": rejected,
            "frac_rejected_precheck": round(rejected.get("GPUPrecheck", 0) / max(1, drawn), 3),
            "frac_rejected_verify_gpu": round(rejected.get("VerifyGPUCode", 0) / max(1, drawn), 3)}


# ValidEvolution as it runs (VerifyGPUCode on the proposals only), and with VerifyGPUCode on every mutant it scores
EVOLUTION_MODES = ("EvolutionarySearch", "ValidEvolution, all verified", "ValidEvolution",
                   "ValidEvolution, verified in build")


@contextlib.contextmanager
def nothing_deferred(on: bool):
    """With `on`, searches set up inside keep VerifyGPUCode in the chain they replay every schedule with (no check is
    deferred to the proposals: sampling.deferred_check), as before that change; the figure it is compared with."""
    from services.tuner.metaschedule import sampling

    verifies = sampling.verifies
    if on:
        sampling.verifies = lambda _p: False
    try:
        yield
    finally:
        sampling.verifies = verifies


def evolution_round(task, target, mode: str, candidates: int, population: int = 128) -> dict:
    import random

    from tvm.s_tir import meta_schedule as ms
    from tvm.s_tir.meta_schedule.runner import RunnerResult

    from services.tuner.metaschedule import validity
    from services.tuner.metaschedule.evolution import ValidEvolution
    from services.tuner.metaschedule.sampling import ValidReplay

    db, model = ms.database.MemoryDatabase(), ms.cost_model.XGBModel(num_warmup_samples=0)
    rng = random.Random(0)

    def context(strategy, postprocs):
        ctx = ms.TuneContext(mod=task.mod, target=target, search_strategy=strategy, task_name=task.name,
                             rand_state=1, num_threads=1,
                             space_generator=ms.space_generator.PostOrderApply(postprocs=postprocs))
        ctx.pre_tuning(1 << 20, candidates, ctx.generate_design_space(), db, model)
        return ctx

    ctx = context(ValidReplay(seed=1, threads=1), validity.cuda_postprocs(target))
    first = ctx.generate_measure_candidates() or []
    results = [RunnerResult([rng.uniform(1e-5, 1e-4)], None) for _ in first]
    workload = db.commit_workload(task.mod)
    for c, r in zip(first, results):
        db.commit_tuning_record(ms.database.TuningRecord(c.sch.trace, workload, r.run_secs, target, c.args_info))
    model.update(ctx, first, results)
    # ValidEvolution must see VerifyGPUCode as itself (it checks only what it proposes): its rejections are its own
    lazy = mode in ("ValidEvolution", "ValidEvolution, verified in build")
    wrapped = counting(validity.cuda_postprocs(target), skip=("VerifyGPUCode",) if lazy else ())
    strategy = (ms.search_strategy.EvolutionarySearch(population_size=population, init_min_unmeasured=16)
                if mode == "EvolutionarySearch" else ValidEvolution(
                    seed=1, threads=1, population=population // 2, verify_in_build=mode.endswith("in build")))
    with nothing_deferred(mode == "ValidEvolution, all verified"):
        ctx = context(strategy, wrapped)
        c0 = time.process_time()
        cands = ctx.generate_measure_candidates() or []
        cpu = time.process_time() - c0
    return {"mode": mode, "valid": len(cands), "drawn": wrapped[0].calls, "search_cpu_s": round(cpu, 2),
            "cpu_s_per_valid": round(cpu / max(1, len(cands)), 3),
            "rejected": {**{w.name: w.rejects for w in wrapped if getattr(w, "rejects", 0)},
                         **({"VerifyGPUCode": strategy.verify_rejected} if lazy else {})}}


# a warm first round (ValidReplay ranking a 3x pool with a trained model) with VerifyGPUCode on every draw of the pool,
# and as it runs: the pool replayed without it, the check run on the round's picks only
RANKED_MODES = ("ranked, all verified", "ranked")


def scripted_model(trained: bool = True):
    """A cost model that says whether it is trained and scores candidates at random, in the order it is asked, each
    (structural hash, score) kept in `scored` (what is counted or tested is the search's own work, not a model's)."""
    import numpy as np
    import tvm_ffi
    from tvm.ir.utils import derived_object
    from tvm.s_tir.meta_schedule.cost_model import PyCostModel

    @derived_object
    class Scripted(PyCostModel):
        def __init__(self):
            super().__init__()
            self.scored: list = []
            self.ranked_rounds = 0  # as the tuner's model: the job's split counts ranked rounds from it

        def load(self, path):
            pass

        def save(self, path):
            pass

        def update(self, context, candidates, results):
            pass

        def trained(self):
            return trained

        def predict(self, context, candidates):
            scores = np.random.default_rng(len(self.scored)).uniform(size=len(candidates))
            self.scored += [(tvm_ffi.structural_hash(c.sch.mod), float(x)) for c, x in zip(candidates, scores)]
            return scores

    return Scripted()


def ranked_round(task, target, mode: str, candidates: int, pool: int = 3) -> dict:
    from tvm.s_tir import meta_schedule as ms

    from services.tuner.metaschedule import sampling, validity

    model = scripted_model()
    strategy = sampling.ValidReplay(seed=1, threads=1, pool=pool, model=model)
    with nothing_deferred(mode == "ranked, all verified"):
        ctx = ms.TuneContext(mod=task.mod, target=target, search_strategy=strategy, task_name=task.name, rand_state=1,
                             num_threads=1, space_generator=ms.space_generator.PostOrderApply(
                                 postprocs=validity.cuda_postprocs(target)))
        ctx.pre_tuning(candidates, candidates, ctx.generate_design_space(), ms.database.MemoryDatabase(), model)
        c0 = time.process_time()
        cands = ctx.generate_measure_candidates() or []
        cpu = time.process_time() - c0
    return {"mode": mode, "valid": len(cands), "pool": pool, "replayed": strategy.replayed,
            "search_cpu_s": round(cpu, 2), "cpu_s_per_valid": round(cpu / max(1, len(cands)), 3),
            "rejected": {"VerifyGPUCode": strategy.verify_rejected}}


def sampled(task, target, candidates: int, seed: int = 1) -> list:
    """A cold round's candidates of `task` as a tuner sends them (tile draws within the limits, the CUDA
    postprocessors), as scheduled modules."""
    from tvm.s_tir import meta_schedule as ms

    from services.tuner.metaschedule import validity
    from services.tuner.metaschedule.sampling import ValidReplay

    ctx = ms.TuneContext(mod=task.mod, target=target, search_strategy=ValidReplay(seed=seed, threads=1),
                         space_generator=ms.space_generator.PostOrderApply(postprocs=validity.cuda_postprocs(target)),
                         task_name=task.name, rand_state=seed, num_threads=1)
    ctx.pre_tuning(candidates, candidates, ctx.generate_design_space(), ms.database.MemoryDatabase(),
                   ms.cost_model.RandomModel())
    return [c.sch.mod for c in ctx.generate_measure_candidates() or []]

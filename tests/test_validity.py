"""The CUDA precheck (services/tuner/metaschedule/validity.py) on random samples of real design spaces:
it only rejects what TVM's own postprocessors reject, and it rejects most of those. CPU only."""
from __future__ import annotations

import logging

import pytest

pytest.importorskip("tvm")

import tvm  # noqa: E402
from tvm.s_tir import meta_schedule as ms  # noqa: E402
from tvm.s_tir.schedule import Schedule, Trace  # noqa: E402

from services.measurer.metaschedule.targets import family_target  # noqa: E402
from services.tuner.metaschedule import validity  # noqa: E402
from services.tuner.metaschedule.context import tune_context  # noqa: E402
from services.tuner.metaschedule.extract import extract  # noqa: E402
from sharetune.intake import to_relax  # noqa: E402

TASKS = {"resnet18": ("conv2d1", "conv2d9"), "transformer": ("fused_matmul_add",)}
SAMPLES = 150


@pytest.fixture(scope="module")
def target():
    from services.tuner.metaschedule.intrinsics import load_tensor_intrinsics

    load_tensor_intrinsics("cuda")  # as a CUDA tuner does before its first TuneContext
    return family_target("cuda.sm_90")


@pytest.fixture(scope="module")
def tasks(target):
    out = {}
    for model, names in TASKS.items():
        by_name = {t.name: t for t in extract(to_relax(model).mod, target)}
        out.update({name: by_name[name] for name in names})
    out["grouped_conv"] = _grouped_conv(target)
    out["depthwise_conv"] = _grouped_conv(target, channels=96, groups=96, size=56)
    return out


def _grouped_conv(target, channels: int = 104, groups: int = 13, size: int = 28):
    """A RegNet-style grouped 3x3 conv (group width 8): its input's channel index is `ff // 8 * 8 + rc`; with
    groups == channels, a MobileNet-style depthwise conv."""
    from tvm import relax

    x = relax.Var("x", relax.TensorType((1, channels, size, size), "float32"))
    w = relax.Var("w", relax.TensorType((channels, channels // groups, 3, 3), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, w]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.nn.conv2d(x, w, padding=1, groups=groups))
        bb.emit_func_output(out)
    (task,) = extract(bb.get(), target)
    return task


def _sample(task, spaces, seed: int):
    """One random sample of the task's design space, replayed as ReplayTrace does, before postprocs."""
    return _replay(task, spaces[seed % len(spaces)].trace, {}, seed)


def _replay(task, trace, decisions: dict, seed: int):
    """The trace replayed with these decisions (the rest drawn at random), ready for the postprocessors."""
    sch = Schedule(task.mod, seed=seed, debug_mask=0)
    Trace(trace.insts, decisions).apply_to_schedule(sch, remove_postproc=True)
    sch.enter_postproc()
    return sch


def _tvm_accepts(sch, postprocs) -> bool:
    for p in postprocs:
        try:
            if not p.apply(sch):
                return False
        except Exception:  # noqa: BLE001 -- as ThreadedTraceApply: an exception rejects
            return False
    return True


@pytest.mark.parametrize("name", [n for names in TASKS.values() for n in names])
def test_precheck_rejects_only_what_tvm_rejects(tasks, target, name):
    limits = (int(target.attrs["max_threads_per_block"]), int(target.attrs["max_shared_memory_per_block"]),
              int(target.attrs["thread_warp_size"]))
    task = tasks[name]
    ctx = tune_context(task.mod, target, task.name, cold=True, population=64, rand_state=1, num_threads=1,
                       valid_sampling=False)
    spaces, postprocs = ctx.generate_design_space(), list(ctx.space_generator.postprocs)
    rejected = tvm_rejected = 0
    for seed in range(1, SAMPLES + 1):
        sch = _sample(task, spaces, seed)
        why = validity.violation(sch.mod, *limits)
        tvm_ok = _tvm_accepts(sch, postprocs)  # TVM's default chain, VerifyGPUCode last but one
        assert not (why and tvm_ok), f"{name} seed {seed}: precheck rejected ({why}) what TVM accepts"
        rejected += why is not None
        tvm_rejected += not tvm_ok
    # most random samples break the limits, and the precheck sees most of those (measured: 85-98 %)
    assert tvm_rejected >= SAMPLES // 2
    assert rejected >= 0.7 * tvm_rejected, (name, rejected, tvm_rejected)


def test_setting_picks_the_postprocs(tasks, target):
    task = tasks["conv2d1"]
    names = lambda ctx: [type(p).__name__ for p in ctx.space_generator.postprocs]  # noqa: E731
    stock = [type(p).__name__ for p in ms.postproc.Postproc.create("cuda-tensorcore")]
    off = tune_context(task.mod, target, task.name, cold=True, population=64, num_threads=1, valid_sampling=False)
    on = tune_context(task.mod, target, task.name, cold=True, population=64, num_threads=1)
    assert names(off) == stock and "VerifyGPUCode" in stock
    assert names(on) == ["_PyPostproc", *stock]  # the precheck (a Python postproc), then TVM's
    llvm = tvm.target.Target({"kind": "llvm", "num-cores": 2})
    cpu = tune_context(task.mod, llvm, task.name, cold=True, population=64, num_threads=1)
    assert "_PyPostproc" not in names(cpu)


@pytest.mark.parametrize("name", ["conv2d1", "grouped_conv", "fused_matmul_add"])
def test_tile_draws_reject_only_what_tvm_rejects(tasks, target, name):
    """Decision vectors the tile limits refuse (thread extents, shared memory; before any replay) are ones TVM's
    postprocessors refuse too, and random tilings are mostly refused."""
    import random

    from services.tuner.metaschedule.sampling import TileLimits, perfect_tile

    task = tasks[name]
    ctx = tune_context(task.mod, target, task.name, cold=True, population=64, rand_state=1, num_threads=1,
                       valid_sampling=False)
    spaces, postprocs = ctx.generate_design_space(), list(ctx.space_generator.postprocs)
    rng = random.Random(7)
    refused = 0
    for seed in range(1, 121):
        trace = spaces[seed % len(spaces)].trace
        limits = TileLimits.of(trace, task.mod, int(target.attrs["max_shared_memory_per_block"]))
        assert limits.bounds, "MultiLevelTiling's thread-extent bounds were not found in the trace"
        assert name == "fused_matmul_add" or limits.shared, "the conv's shared-memory footprints were not found"
        tiling = [perfect_tile(rng, t.extent, t.n, t.max_innermost) for t in limits.tiles]
        if limits.fits(tiling):
            continue
        refused += 1
        ok = _tvm_accepts(_replay(task, trace, {t.inst: tiling[i] for i, t in enumerate(limits.tiles)}, seed),
                          postprocs)
        assert not ok, f"{name} seed {seed}: tile draw refused ({tiling}) though TVM accepts it"
    assert refused >= 20, refused  # random tilings mostly break the thread limits: the check must see it


@pytest.mark.parametrize("name", ["conv2d1", "grouped_conv", "depthwise_conv", "fused_matmul_add"])
def test_tile_draws_within_the_limits_are_ones_tvm_accepts(tasks, target, name):
    """The limits are tight as well as safe: with a software pipeline's copies of its shared buffers counted and
    its loop's extent kept above 1, what they accept TVM's chain accepts (half the convs' draws failed without)."""
    import random

    from services.tuner.metaschedule.sampling import SpaceDraws, TileLimits

    task = tasks[name]
    ctx = tune_context(task.mod, target, task.name, cold=True, population=64, rand_state=1, num_threads=1,
                       valid_sampling=False)
    spaces, postprocs = ctx.generate_design_space(), list(ctx.space_generator.postprocs)
    draws = SpaceDraws([TileLimits.of(sp.trace, task.mod, int(target.attrs["max_shared_memory_per_block"]))
                        for sp in spaces])
    assert any(limits.pipelined for limits in draws.limits), "no software-pipelined space found (sm_90 has them)"
    rng = random.Random(11)
    accepted = 0
    for seed in range(1, 41):
        s, tiling = draws.draw(rng)
        accepted += _tvm_accepts(_replay(task, spaces[s].trace, {t.inst: tiling[i] for i, t in
                                                                 enumerate(draws.limits[s].tiles)}, seed), postprocs)
    assert accepted >= 38, accepted


def test_a_space_without_a_tiling_within_its_limits_is_left_out_of_later_draws():
    import random

    from services.tuner.metaschedule.sampling import SpaceDraws, TileLimits, _Tile

    tile = _Tile(inst=None, extent=64, n=2, max_innermost=0)
    open_ = TileLimits(tiles=[tile])
    shut = TileLimits(tiles=[tile], bounds=[(128, 1024, [(0, 0), (0, 1)])])  # 64 threads at most: never
    draws = SpaceDraws([shut, open_, shut])
    rng = random.Random(5)
    got = [draws.draw(rng) for _ in range(20)]
    assert all(s == 1 for s, _ in got) and draws.dry == {0, 2}
    assert SpaceDraws([shut]).draw(rng) is None
    assert SpaceDraws([TileLimits()]).draw(rng) == (0, [])  # a space with no tiling to draw is never dry


def test_valid_replay_proposes_only_schedules_tvm_accepts(tasks, target):
    """A cold CUDA round with valid sampling: every candidate passes TVM's own chain, none twice, and far fewer
    replays than replay-trace needs for as many valid schedules."""
    import tvm_ffi

    from services.tuner.metaschedule.sampling import ValidReplay

    task = tasks["conv2d1"]
    assert type(tune_context(task.mod, target, task.name, cold=True, population=64).search_strategy).__name__ \
        == "_PySearchStrategy"  # the setting's default on CUDA: ValidReplay (a Python strategy)
    strategy = ValidReplay(seed=3, threads=2)
    ctx = ms.TuneContext(mod=task.mod, target=target, search_strategy=strategy, task_name=task.name, rand_state=3,
                         num_threads=2, space_generator=ms.space_generator.PostOrderApply(
                             postprocs=validity.cuda_postprocs(target)))
    ctx.pre_tuning(1 << 20, 8, ctx.generate_design_space(), ms.database.MemoryDatabase(),
                   ms.cost_model.RandomModel())
    cands = ctx.generate_measure_candidates()
    assert cands and len(cands) >= 6
    stock = ms.postproc.Postproc.create(validity.rule_kind(target))
    for p in stock:
        p._initialize_with_tune_context(ctx)  # noqa: SLF001 -- TVM's chain, as the context would set it up
    for c in cands:
        assert _tvm_accepts(_replay(task, c.sch.trace, dict(c.sch.trace.decisions), 1), stock)
    assert len({tvm_ffi.structural_hash(c.sch.mod) for c in cands}) == len(cands)
    # replay-trace replays ~23 samples a valid one on this task; what is left here breaks shared memory
    assert strategy.replayed < 16 * len(cands), (strategy.replayed, len(cands))
    off = tune_context(task.mod, target, task.name, cold=True, population=64, num_threads=1, valid_sampling=False)
    assert type(off.search_strategy).__name__ == "ReplayTrace"


@pytest.mark.parametrize("trained", [True, False])
def test_a_first_round_on_a_trained_model_measures_its_best_of_a_larger_pool(tasks, target, trained):
    """Three times the round drawn within the limits, the model's best proposed but for a quarter drawn at random
    from the rest; an untrained model is never asked, and the round is drawn as before."""
    import tvm_ffi

    from services.tuner.metaschedule.sampling import RANKED_EXPLORE, ValidReplay

    from sharetune.testing.sampling_rounds import scripted_model

    task, model = tasks["conv2d1"], scripted_model(trained)
    strategy = ValidReplay(seed=5, threads=2, pool=3, model=model)
    ctx = ms.TuneContext(mod=task.mod, target=target, search_strategy=strategy, task_name=task.name, rand_state=5,
                         num_threads=2, space_generator=ms.space_generator.PostOrderApply(
                             postprocs=validity.cuda_postprocs(target)))
    ctx.pre_tuning(1 << 20, 8, ctx.generate_design_space(), ms.database.MemoryDatabase(), model)
    cands = ctx.generate_measure_candidates()
    proposed = {tvm_ffi.structural_hash(c.sch.mod) for c in cands}
    assert len(cands) == len(proposed) == 8
    if not trained:
        assert model.scored == [] and strategy.ranked_rounds == 0
        return
    assert strategy.ranked_rounds == model.ranked_rounds == 1
    # the pool is replayed without TVM's VerifyGPUCode, which runs on the round's picks only: each passes it
    assert [type(p).__name__ for p in strategy.check.verifiers] == ["VerifyGPUCode"]
    assert "VerifyGPUCode" not in [type(p).__name__ for p in strategy.scoring]
    assert all(strategy.check.verifiers[0].apply(c.sch) for c in cands)
    assert len(model.scored) > 16  # a pool of up to 24 distinct schedules
    pool = dict(model.scored)
    assert proposed <= set(pool)
    best = sorted(pool, key=lambda k: -pool[k])[: 8 - int(8 * RANKED_EXPLORE)]
    assert set(best) <= proposed
    again = ctx.generate_measure_candidates()  # the next round proposes none of the first's
    assert not proposed & {tvm_ffi.structural_hash(c.sch.mod) for c in again}


@pytest.mark.parametrize("screen", [False, True])
def test_valid_evolution_breeds_within_the_limits_from_the_measured_best(tasks, target, screen):
    """An evolutionary CUDA round with valid sampling, its mutants screened or not: every candidate passes TVM's own
    chain, none repeats a measured schedule or an earlier round's, and the round breeds from the measured
    best (some candidates are one mutation away from a stored schedule)."""
    from services.tuner.metaschedule.evolution import ValidEvolution, genome_of

    task = tasks["conv2d1"]
    assert type(tune_context(task.mod, target, task.name, cold=False, population=64).search_strategy).__name__ \
        == "_PySearchStrategy"  # the setting's default on CUDA: ValidEvolution (a Python strategy)
    off = tune_context(task.mod, target, task.name, cold=False, population=64, num_threads=1, valid_sampling=False)
    assert type(off.search_strategy).__name__ == "EvolutionarySearch"

    db, measured = _measured_round(task, target)
    strategy = ValidEvolution(seed=3, threads=1, population=16, screen=screen)
    ctx = _search_context(task, target, strategy, 8, db)
    stock = ms.postproc.Postproc.create(validity.rule_kind(target))
    for p in stock:
        p._initialize_with_tune_context(ctx)  # noqa: SLF001 -- TVM's chain, as the context would set it up
    stored = {genome_of(c.sch.trace) for c in measured}
    seen: set = set()
    near = 0
    for _ in range(2):
        cands = ctx.generate_measure_candidates()
        assert cands and len(cands) >= 6
        for c in cands:
            genome = genome_of(c.sch.trace)
            assert genome not in stored and genome not in seen
            seen.add(genome)
            assert _tvm_accepts(_replay(task, c.sch.trace, dict(c.sch.trace.decisions), 1), stock)
            near += any(sum(a != b for a, b in zip(genome, s)) == 1 for s in stored)
    assert near >= 1, "no candidate is a mutant of a measured schedule"
    # no tensor-core block here: VerifyGPUCode leaves the replays' chain and checks only the proposals
    assert [type(p).__name__ for p in strategy.check.verifiers] == ["VerifyGPUCode"]
    assert "VerifyGPUCode" not in [type(p).__name__ for p in strategy.postprocs]


def _search_context(task, target, strategy, per_iter: int, db):
    ctx = ms.TuneContext(mod=task.mod, target=target, search_strategy=strategy, task_name=task.name, rand_state=3,
                         num_threads=1, space_generator=ms.space_generator.PostOrderApply(
                             postprocs=validity.cuda_postprocs(target)))
    ctx.pre_tuning(1 << 20, per_iter, ctx.generate_design_space(), db, ms.cost_model.RandomModel(seed=7))
    return ctx


def _measured_round(task, target):
    """(a database holding one cold round of 8 of the task, with made-up timings, as the store holds them; the
    round's candidates)."""
    from services.tuner.metaschedule.records import record_json, tuning_record
    from services.tuner.metaschedule.sampling import ValidReplay

    db = ms.database.MemoryDatabase()
    measured = _search_context(task, target, ValidReplay(seed=5, threads=1), 8, db).generate_measure_candidates()
    workload = db.commit_workload(task.mod)
    for i, c in enumerate(measured):  # JSON and back
        rec = ms.database.TuningRecord(c.sch.trace, workload, [1e-5 * (i + 1)], target, c.args_info)
        db.commit_tuning_record(tuning_record(record_json(rec), workload))
    return db, measured


def test_a_small_evolutionary_round_breeds_a_population_its_size(tasks, target):
    """A round that proposes 4 candidates breeds MIN_POPULATION, not the setting's 64: it scores a few times what
    it proposes (a light task's round of 8 in a job scored as much as a round of 64)."""
    from services.tuner.metaschedule import evolution
    from services.tuner.metaschedule.evolution import ValidEvolution

    task = tasks["conv2d1"]
    db, _ = _measured_round(task, target)
    scored = {}
    for per_iter in (4, 64):
        strategy = ValidEvolution(seed=3, threads=1, population=64)
        counted = []
        strategy._score = lambda pool, keys, inner=strategy._score, counted=counted: (  # noqa: SLF001
            counted.append(len(keys)), inner(pool, keys))
        cands = _search_context(task, target, strategy, per_iter, db).generate_measure_candidates()
        assert cands and len(cands) <= per_iter
        scored[per_iter] = counted
    assert max(scored[4]) <= evolution.MIN_POPULATION
    assert sum(scored[4]) <= (evolution.GENERATIONS + 1) * evolution.MIN_POPULATION
    assert sum(scored[64]) > 2 * sum(scored[4]), scored


def test_a_screened_generation_scores_half_its_population_and_the_model_picks_them(tasks, target):
    """With screening, a generation breeds twice its population and replays and scores half the population's size:
    the mutants a linear model of the decisions, fit on what the round scored, ranks best."""
    from services.tuner.metaschedule import evolution
    from services.tuner.metaschedule.evolution import ValidEvolution, decision_vector, screened

    task = tasks["conv2d1"]
    db, _ = _measured_round(task, target)
    strategy = ValidEvolution(seed=3, threads=1, population=64, screen=True)
    counted = []
    inner = strategy._score  # noqa: SLF001
    strategy._score = lambda pool, keys: (counted.append(len(keys)), inner(pool, keys))
    assert _search_context(task, target, strategy, 64, db).generate_measure_candidates()
    assert len(counted) == evolution.GENERATIONS + 1 and max(counted[1:]) <= 32, counted

    # a pool whose scores follow one decision exactly: the screen keeps the mutants that decision favours
    space, keys = strategy.spaces[0], [k for k in strategy.replays if k[0] == 0 and strategy.replays[k] is not None]
    assert len(keys) > 40

    def truth(key):
        return sum(decision_vector(space, key[1])[1:4])
    pool = {k: (None, truth(k)) for k in keys[:30]}
    rest = keys[30:]
    picked = screened(strategy.spaces, pool, rest, 5)
    assert sorted(map(truth, picked), reverse=True) == sorted(map(truth, rest), reverse=True)[:5]


def test_a_cold_round_of_tile_draws_replays_little_more_than_it_proposes(tasks, target):
    """What bench/valid_sampling.py measures, on a conv whose design spaces include software pipelines: a cold
    round of 32 proposes 32, and TVM's VerifyGPUCode turns down few of the schedules replayed for them (a
    pipeline's copies uncounted, it turned down half)."""
    from sharetune.testing.sampling_rounds import cold_round

    row = cold_round(tasks["conv2d1"], target, "tile draws", 32)
    assert row["valid"] == 32
    assert row["rejected"].get("VerifyGPUCode", 0) <= 3 and row["drawn"] <= 36, row


def test_a_space_that_gave_a_tiling_stays_in_after_an_unlucky_draw():
    import random

    from services.tuner.metaschedule.sampling import SpaceDraws, TileLimits, _Tile

    class Unlucky(TileLimits):
        """Gives a tiling, then comes back empty once, then gives again."""

        def __init__(self):
            super().__init__(tiles=[_Tile(inst=None, extent=4, n=2, max_innermost=0)])
            self.answers = [True, False, True]

        def draw(self, rng):
            return ([[2, 2]] if self.answers.pop(0) else None), 5

    draws = SpaceDraws([Unlucky()])
    rng = random.Random(1)
    assert draws.draw(rng) == (0, [[2, 2]])
    assert draws.draw(rng) == (0, [[2, 2]]) and draws.dry == set() and draws.drawn == 15


@pytest.mark.parametrize("name", ["conv2d1", "depthwise_conv"])
def test_a_batch_of_draws_is_judged_as_one_by_one(tasks, target, name):
    """Tile draws are made a batch at a time as arrays: each is a perfect tiling, and the batch's verdicts are
    `fits`'s, draw by draw."""
    import numpy as np

    from services.tuner.metaschedule.sampling import TileLimits, _perfect_tiles

    task = tasks[name]
    ctx = tune_context(task.mod, target, task.name, cold=True, population=64, rand_state=1, num_threads=1)
    for s, space in enumerate(ctx.generate_design_space()):
        limits = TileLimits.of(space.trace, task.mod, int(target.attrs["max_shared_memory_per_block"]))
        tilings = [_perfect_tiles(np.random.default_rng(s), t, 3000) for t in limits.tiles]
        assert all((tiles.prod(axis=1) == t.extent).all() for tiles, t in zip(tilings, limits.tiles))
        assert all((tiles[:, -1] <= t.max_innermost).all() for tiles, t in zip(tilings, limits.tiles)
                   if t.max_innermost > 0)
        verdicts = limits.fitting(tilings)
        assert verdicts.tolist() == [limits.fits([tiles[j].tolist() for tiles in tilings]) for j in range(3000)]
        assert not verdicts.all()  # random tilings break the limits


def test_a_ranked_pick_that_fails_the_deferred_check_gives_its_slot_to_the_best_scored_one_left():
    from types import SimpleNamespace

    from services.tuner.metaschedule.sampling import ProposalCheck, ValidReplay

    class RejectsBad:  # stands in for TVM's VerifyGPUCode
        def apply(self, sch):
            return sch != "bad"

    strategy = ValidReplay(seed=1, threads=2)
    strategy.check = ProposalCheck([RejectsBad()])
    picks = [SimpleNamespace(sch=s) for s in ("a", "bad", "b")]
    rest = iter(SimpleNamespace(sch=s) for s in ("bad", "d", "e"))  # the pool's others, best scored first
    assert [c.sch for c in strategy._checked(picks, rest, 3)] == ["a", "b", "d"]
    assert strategy.verify_rejected == 2


def test_an_evolutionary_round_that_proposes_nothing_says_why(tasks, target, caplog):
    """Every schedule turned down by the verifiers: the round proposes nothing (the task then samples) and the log
    says what the round scored and how many the verifiers turned down."""
    from types import SimpleNamespace

    from services.tuner.metaschedule.evolution import ValidEvolution
    from services.tuner.metaschedule.sampling import ProposalCheck

    task = tasks["conv2d1"]
    db, _ = _measured_round(task, target)
    strategy = ValidEvolution(seed=3, threads=1, population=16)
    ctx = _search_context(task, target, strategy, 8, db)
    strategy.check = ProposalCheck([SimpleNamespace(apply=lambda sch: False)])
    with caplog.at_level(logging.WARNING, logger="sharetune.tuner.evolution"):
        assert not ctx.generate_measure_candidates()
    said = [r.getMessage() for r in caplog.records if "proposed nothing" in r.getMessage()]
    assert len(said) == 1 and "8 measured of them" in said[0] and strategy.verify_rejected > 0
    assert f"{strategy.verify_rejected} turned down by the verifiers" in said[0]


@pytest.mark.parametrize("name", ["conv2d1", "fused_matmul_add"])
def test_a_builds_gpu_limits_check_rejects_what_verify_gpu_code_rejects(tasks, target, name):
    """Raw random samples (many over a limit): the builders' check on the module they lower says what MetaSchedule's
    VerifyGPUCode says of the schedule, sample by sample."""
    from sharetune.testing.gpu_limits import verdicts

    row = verdicts(tasks[name], target, 24)
    assert row["samples"] == 24 and row["disagree"] == [], row
    if name == "conv2d1":
        assert row["postproc_rejects"] > 0, row  # both sides exercised


def test_a_build_over_the_gpus_limits_fails_with_an_error_that_names_them(tasks, target):
    import random

    from tvm.s_tir import meta_schedule as ms
    from tvm.s_tir.schedule import Schedule, Trace

    from services.measurer.metaschedule.build import build

    task = tasks["conv2d1"]
    ctx = ms.TuneContext(mod=task.mod, target=target, task_name=task.name, num_threads=1,
                         space_generator=ms.space_generator.PostOrderApply(), search_strategy=ms.search_strategy.ReplayTrace())
    space = ctx.generate_design_space()[0]
    verify = ms.postproc.VerifyGPUCode()
    verify._initialize_with_tune_context(ctx)  # noqa: SLF001
    rng = random.Random(3)
    for _ in range(200):  # a raw sample VerifyGPUCode turns down
        sch = Schedule(task.mod, seed=rng.getrandbits(31) + 1, debug_mask=0, error_render_level="none")
        Trace(space.trace.insts, {}).apply_to_schedule(sch, remove_postproc=True)
        if not verify.apply(sch.copy()):
            break
    else:
        pytest.fail("no sample over the limits in 200")
    with pytest.raises(Exception, match="breaks the GPU's limits on sm_90"):
        build(sch.mod, target)


def test_a_search_whose_builders_check_stops_checking_after_a_clean_probe():
    from services.tuner.metaschedule.sampling import ProposalCheck

    class Verifier:
        def __init__(self, answers):
            self.answers, self.calls = iter(answers), 0

        def apply(self, sch):
            self.calls += 1
            return next(self.answers)

    clean = Verifier([True] * 100)
    check = ProposalCheck([clean], in_build=True)
    assert all(check.passes(None) for _ in range(40)) and clean.calls == ProposalCheck.PROBE and not check.active
    rejecting = Verifier([True, False] + [True] * 100)
    check = ProposalCheck([rejecting], in_build=True)
    [check.passes(None) for _ in range(40)]
    assert rejecting.calls == 40 and check.active  # one turned down: it keeps checking
    itself = Verifier([True] * 100)
    check = ProposalCheck([itself], in_build=False)
    [check.passes(None) for _ in range(40)]
    assert itself.calls == 40
    assert not ProposalCheck([], in_build=False).active  # nothing deferred (tensor-core spaces): nothing to run


def _bf16_matmul(target):
    from tvm import relax

    from services.tuner.metaschedule.extract import extract

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((256, 256), "bfloat16"))
    w = relax.Var("w", relax.TensorType((256, 512), "bfloat16"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.matmul(x, w, out_dtype="bfloat16"))
        bb.emit_func_output(out)
    (task,) = extract(bb.get(), target)
    return task


@pytest.mark.parametrize("evolve", [False, True])
def test_a_search_whose_builders_check_probes_its_proposals_first(tasks, target, evolve):
    """A float32 conv's proposals pass the probe and the search stops lowering them; a bfloat16 matmul's do not
    (a third over a limit), and its rounds stay full of proposals that pass."""
    from services.tuner.metaschedule.evolution import ValidEvolution
    from services.tuner.metaschedule.sampling import ProposalCheck, ValidReplay

    def one_round(task):
        db = _measured_round(task, target)[0] if evolve else ms.database.MemoryDatabase()  # evolution's parents
        strategy = (ValidEvolution(seed=1, threads=1, population=32, verify_in_build=True) if evolve
                    else ValidReplay(seed=1, threads=1, verify_in_build=True))
        ctx = _search_context(task, target, strategy, 32, db)
        return strategy, ctx.generate_measure_candidates() or []

    strategy, cands = one_round(tasks["conv2d1"])
    assert len(cands) == 32 and strategy.check.checked == ProposalCheck.PROBE and not strategy.check.active
    strategy, cands = one_round(_bf16_matmul(target))
    assert strategy.check.rejected > 0 and strategy.check.active
    assert len(cands) == 32 and strategy.check.checked >= 32  # every proposal checked, the round full

"""A reduction over a non-innermost axis (a channel-axis layer norm) gets a CUDA design space of one coalesced kernel
(services/tuner/metaschedule/column_reduction.py); design spaces and CUDA source need no GPU."""
from __future__ import annotations

import re

import pytest

pytest.importorskip("tvm")

import tvm  # noqa: E402
from tvm import relax  # noqa: E402
from tvm.s_tir import meta_schedule as ms  # noqa: E402
from tvm.s_tir.schedule import Trace  # noqa: E402

from services.measurer.metaschedule.targets import family_target  # noqa: E402
from services.tuner.metaschedule.context import tune_context  # noqa: E402
from services.tuner.metaschedule.extract import extract  # noqa: E402

CUDA = family_target("cuda.sm_90")


def _layer(channels=8, steps=39):
    """wav2vec 2.0's feature-encoder layer as PyTorch writes it: transpose, last-axis layer norm, transpose, GELU."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, channels, steps), "float32"))
    gamma = relax.Var("gamma", relax.TensorType((channels,), "float32"))
    beta = relax.Var("beta", relax.TensorType((channels,), "float32"))
    with bb.function("main", [x, gamma, beta]):
        with bb.dataflow():
            t = bb.emit(relax.op.permute_dims(x, [0, 2, 1]))
            norm = bb.emit(relax.op.nn.layer_norm(t, gamma, beta, axes=[-1]))
            back = bb.emit(relax.op.permute_dims(norm, [0, 2, 1]))
            out = bb.emit_output(relax.op.nn.gelu(back))
        bb.emit_func_output(out)
    return bb.get()


def _norm_task(fold: bool):
    tasks = [t for t in extract(_layer(), CUDA, fold_norms=fold) if "layer_norm" in t.name]
    assert len(tasks) == 1
    return tasks[0]


def _spaces(task, mode: str):
    ctx = tune_context(task.mod, CUDA, task.name, cold=True, population=16, rand_state=1, num_threads=1,
                       column_reductions=mode)
    return ctx, ctx.space_generator.generate_design_space(task.mod)


def _coalesced(spaces) -> list:
    return [s for s in spaces if '"schedule_rule"' in str(s.trace)]


def test_a_channel_axis_norm_gets_one_more_space_only_when_the_setting_is_on():
    task = _norm_task(fold=True)
    _, off = _spaces(task, "off")
    _, on = _spaces(task, "on")
    assert len(on) == len(off) + 1
    assert not _coalesced(off) and len(_coalesced(on)) == 1


def test_a_last_axis_norm_gets_no_coalesced_space():
    for mode in ("on", "wide"):
        _, spaces = _spaces(_norm_task(fold=False), mode)
        assert spaces and not _coalesced(spaces)


def _matmul_add(transposed: bool):
    """A dense layer as a transformer writes it (x @ W + b), W as stored (k, n) or its transpose read as (k, m)."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((64, 32) if transposed else (32, 64), "float32"))
    w = relax.Var("w", relax.TensorType((64, 48), "float32"))
    b = relax.Var("b", relax.TensorType((48,), "float32"))
    with bb.function("main", [x, w, b]):
        with bb.dataflow():
            lhs = bb.emit(relax.op.permute_dims(x, [1, 0])) if transposed else x
            out = bb.emit_output(relax.op.add(relax.op.matmul(lhs, w), b))
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize("transposed", [False, True])
def test_a_matmul_is_a_contraction_not_a_column_reduction(transposed):
    """W[k, n] is read down a column, but a matmul's output needs both operands: the coalesced kernel would be a
    naive one (on an H100, `wide` left ViT's dense layers 7-13x slower than untuned)."""
    tasks = [t for t in extract(_matmul_add(transposed), CUDA) if "matmul" in t.name]
    assert tasks
    for task in tasks:
        for mode in ("on", "wide"):
            _, spaces = _spaces(task, mode)
            assert spaces and not _coalesced(spaces)


def test_the_wide_variant_makes_the_coalesced_state_the_norms_only_one():
    _, spaces = _spaces(_norm_task(fold=True), "wide")
    assert len(spaces) == len(_coalesced(spaces)) == 1


@pytest.mark.parametrize("mode", ["on", "wide"])
def test_every_draw_of_the_coalesced_space_passes_tvms_checks_and_is_one_kernel_reading_along_a_warp(mode):
    task = _norm_task(fold=True)
    ctx, spaces = _spaces(task, mode)
    space = _coalesced(spaces)[0]
    decisions, passed, valid = set(), 0, None
    for seed in range(1, 25):
        sch = tvm.s_tir.Schedule(task.mod, seed=seed)
        Trace(space.trace.insts, {}).apply_to_schedule(sch, remove_postproc=True)
        ok = all(p.apply(sch) for p in ctx.space_generator.postprocs)  # GPUPrecheck and VerifyGPUCode among them
        extents = _thread_extents(sch.mod)
        assert ok == (extents["threadIdx.x"] * extents["threadIdx.y"] <= 1024)
        passed += ok
        valid = sch if ok else valid
        decisions.add(tuple(int(v) for v in sch.trace.decisions.values()))
    assert len(decisions) > 5 and passed > 12  # the thread extents are sampled, not fixed
    with CUDA:
        source = tvm.compile(valid.mod, target=CUDA).mod.imports[0].inspect_source()
    assert source.count("__global__ void") == 2  # one kernel: its declaration and its definition
    assert "threadIdx.y" in source and "__shared__" in source
    # the reduced sums stay in each thread (local scope): stored to shared memory by the threadIdx.y == 0 threads
    # they were read by the others with no barrier between (TVM's ThreadSync takes the same index for the same
    # thread), and every module tuned with that kernel served NaN on an H100
    assert "threadIdx.y) == 0)" not in source


def _thread_extents(mod) -> dict:
    """The largest extent bound to each threadIdx axis in `mod`'s script."""
    extents = {"threadIdx.x": 1, "threadIdx.y": 1}
    for n, tag in re.findall(r'thread_binding\((?:T\.int64\()?(\d+)\)?, thread="(threadIdx\.[xy])"', mod.script()):
        extents[tag] = max(extents[tag], int(n))
    return extents


@pytest.mark.parametrize("mode", ["on", "wide"])
def test_the_search_proposes_coalesced_candidates_in_cold_and_evolutionary_rounds(mode):
    task = _norm_task(fold=True)
    for cold in (True, False):
        ctx = tune_context(task.mod, CUDA, task.name, cold=cold, population=32, rand_state=3, num_threads=1,
                           column_reductions=mode)
        ctx.search_strategy.pre_tuning(64, 32, ctx.space_generator.generate_design_space(task.mod),
                                       ms.database.MemoryDatabase(), None)
        proposed = ctx.search_strategy.generate_measure_candidates()
        coalesced = ['"schedule_rule"' in str(c.sch.trace) for c in proposed]
        assert all(coalesced) if mode == "wide" else any(coalesced)

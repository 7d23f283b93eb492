"""Padded einsums in a CUDA design space (services/tuner/metaschedule/padding.py): which blocks get a padded
state, that a padded schedule computes what the unpadded one does, and that a cold CUDA round draws, checks and
lowers padded candidates. CPU only."""
from __future__ import annotations

import pytest

pytest.importorskip("tvm")

import numpy as np  # noqa: E402
import tvm  # noqa: E402
from tvm import relax  # noqa: E402
from tvm.s_tir import meta_schedule as ms  # noqa: E402

from services.measurer.metaschedule.targets import family_target  # noqa: E402
from services.tuner.metaschedule import padding  # noqa: E402
from services.tuner.metaschedule.context import tune_context  # noqa: E402
from services.tuner.metaschedule.extract import extract  # noqa: E402


def _task(build, target):
    bb = relax.BlockBuilder()
    build(bb)
    tasks = extract(bb.get(), target)
    assert len(tasks) == 1, [t.name for t in tasks]
    return tasks[0]


def _linear(rows: int, inner: int, cols: int):
    """x @ w + b over `rows` tokens: a ViT-style dense layer (197 tokens) with its bias fused."""
    def build(bb):
        x = relax.Var("x", relax.TensorType((rows, inner), "float32"))
        w = relax.Var("w", relax.TensorType((inner, cols), "float32"))
        b = relax.Var("b", relax.TensorType((cols,), "float32"))
        with bb.function("main", [x, w, b]):
            with bb.dataflow():
                out = bb.emit_output(relax.op.add(relax.op.matmul(x, w), b))
            bb.emit_func_output(out)
    return build


def _batched(rows: int, inner: int, cols: int):
    """An attention-style batched matmul whose output is the function's own (nothing to inline it into)."""
    def build(bb):
        a = relax.Var("a", relax.TensorType((2, rows, inner), "float32"))
        v = relax.Var("v", relax.TensorType((2, inner, cols), "float32"))
        with bb.function("main", [a, v]):
            with bb.dataflow():
                out = bb.emit_output(relax.op.matmul(a, v))
            bb.emit_func_output(out)
    return build


def _conv1d(bb):
    x = relax.Var("x", relax.TensorType((1, 16, 199), "float32"))
    w = relax.Var("w", relax.TensorType((16, 16, 3), "float32"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.nn.conv1d(x, w, strides=2))
        bb.emit_func_output(out)


@pytest.fixture(scope="module")
def cuda():
    from services.tuner.metaschedule.intrinsics import load_tensor_intrinsics

    load_tensor_intrinsics("cuda")
    return family_target("cuda.sm_90")


def _spaces(task, target, pad: bool = True):
    ctx = tune_context(task.mod, target, task.name, cold=True, population=16, rand_state=1, num_threads=1,
                       pad_awkward=pad)
    return ctx, ctx.generate_design_space()


def _pads(space) -> list:
    """The paddings a design space (or a schedule) applies."""
    return [list(map(int, inst.attrs[0])) for inst in space.trace.insts if inst.kind.name == "PadEinsum"]


def test_awkward_extents():
    assert [n for n in (16, 17, 24, 64, 77, 197, 200, 384, 799) if padding.awkward(n)] == [17, 77, 197, 799]


def test_a_cuda_space_holds_a_matmul_over_197_rows_padded_and_as_it_is(cuda):
    task = _task(_linear(197, 96, 64), cuda)
    _, spaces = _spaces(task, cuda)
    pads = [_pads(s) for s in spaces]
    assert [] in pads, "the unpadded spaces stay"
    assert [[16, 1, 1]] in pads, pads  # rows padded to 208; 64 columns and 96 inner are tiled as they are
    _, plain = _spaces(task, cuda, pad=False)
    assert not any(_pads(s) for s in plain) and len(plain) < len(spaces)


def test_a_matmul_writing_the_output_pads_only_its_reduction(cuda):
    """Padded rows would need a copy kernel to drop them; a padded reduction reads zeros and needs none."""
    _, spaces = _spaces(_task(_batched(197, 197, 64), cuda), cuda)
    assert [[1, 1, 1, 16]] in [_pads(s) for s in spaces]
    _, spaces = _spaces(_task(_batched(197, 64, 197), cuda), cuda)
    assert not any(_pads(s) for s in spaces)  # nothing awkward it may pad


def test_blocks_that_are_not_tiled_einsums_stay_as_they_are(cuda):
    def layer_norm(bb):
        x = relax.Var("x", relax.TensorType((197, 384), "float32"))
        g, b = (relax.Var(n, relax.TensorType((384,), "float32")) for n in "gb")
        with bb.function("main", [x, g, b]):
            with bb.dataflow():
                out = bb.emit_output(relax.op.nn.layer_norm(x, g, b, axes=[-1]))
            bb.emit_func_output(out)

    for build in (_conv1d, layer_norm, _linear(192, 96, 64)):
        _, spaces = _spaces(_task(build, cuda), cuda)
        assert not any(_pads(s) for s in spaces)


def test_a_padded_schedule_computes_what_the_unpadded_one_does():
    """The padded state's schedule, tiled by the CPU rules and built for the host, against numpy."""
    target = tvm.target.Target({"kind": "llvm", "num-cores": 1})
    task = _task(_linear(37, 19, 8), target)
    sch = tvm.s_tir.Schedule(task.mod)
    padded = padding.padded_state(sch, sch.get_sblock("matmul"))
    assert padded is not None
    space = ms.space_generator.PostOrderApply(sch_rules=[padding.PadAwkwardEinsum(),
                                                         *ms.schedule_rule.ScheduleRule.create("llvm")])
    ctx = ms.TuneContext(mod=task.mod, target=target, space_generator=space, task_name=task.name, rand_state=3,
                         num_threads=1)
    tiled = [s for s in ctx.generate_design_space() if _pads(s)]
    assert tiled
    rng = np.random.default_rng(0)
    x, w, b = (rng.standard_normal(s).astype("float32") for s in ((37, 19), (19, 8), (8,)))
    for mod in (padded.mod, tiled[0].mod):
        lib = tvm.tirx.build(mod, target=target)
        dev = tvm.cpu()
        out = tvm.runtime.tensor(np.zeros((37, 8), "float32"), dev)
        lib(*(tvm.runtime.tensor(a, dev) for a in (x, w, b)), out)
        np.testing.assert_allclose(out.numpy(), x @ w + b, rtol=1e-5, atol=1e-5)


def test_a_cold_cuda_round_draws_checks_and_lowers_padded_candidates(cuda):
    from sharetune.testing.build_cost import _lowered

    task = _task(_linear(197, 96, 64), cuda)
    ctx, spaces = _spaces(task, cuda)
    ctx.pre_tuning(32, 32, spaces, ms.database.MemoryDatabase(), ms.cost_model.RandomModel())
    cands = ctx.generate_measure_candidates()
    padded = [c for c in cands if _pads(c.sch)]
    assert len(cands) >= 24 and padded, (len(cands), len(padded))
    for c in padded[:3]:
        source, _ = _lowered(c.sch.mod, cuda)
        assert source is not None and "__global__" in source
        # the trace a record keeps applies to the workload again, to the same schedule
        again = tvm.s_tir.Schedule(task.mod)
        c.sch.trace.apply_to_schedule(again, remove_postproc=False)
        tvm.ir.assert_structural_equal(again.mod, c.sch.mod)


def test_the_padded_spaces_are_off_unless_the_setting_turns_them_on(monkeypatch):
    from shared.settings import TunerSettings

    monkeypatch.delenv("SHARETUNE_PAD_AWKWARD", raising=False)
    assert TunerSettings().pad_awkward is False
    monkeypatch.setenv("SHARETUNE_PAD_AWKWARD", "1")
    assert TunerSettings().pad_awkward is True

"""Padded einsums in a CUDA design space (services/tuner/metaschedule/padding.py): which blocks get a padded
state, that a padded schedule computes what the unpadded one does, and that a cold CUDA round draws, checks and
lowers padded candidates. CPU only."""
from __future__ import annotations

import pytest

pytest.importorskip("tvm")

import re  # noqa: E402

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


def _spaces(task, target, pad: str = "all"):
    ctx = tune_context(task.mod, target, task.name, cold=True, population=16, rand_state=1, num_threads=1,
                       pad_awkward=pad)
    return ctx, ctx.generate_design_space()


def _pads(space) -> list:
    """The paddings a design space (or a schedule) applies."""
    return [list(map(int, inst.attrs[0])) for inst in space.trace.insts if inst.kind.name == "PadEinsum"]


def test_awkward_extents():
    assert [n for n in (16, 17, 24, 28, 64, 77, 98, 197, 200, 384, 799) if padding.awkward(n)] == [17, 77, 98, 197, 799]


def test_a_cuda_space_holds_a_matmul_over_197_rows_padded_and_as_it_is(cuda):
    task = _task(_linear(197, 96, 64), cuda)
    _, spaces = _spaces(task, cuda)
    pads = [_pads(s) for s in spaces]
    assert [] in pads, "the unpadded spaces stay"
    assert [[16, 1, 1]] in pads, pads  # rows padded to 208; 64 columns and 96 inner are tiled as they are
    _, plain = _spaces(task, cuda, pad="off")
    assert not any(_pads(s) for s in plain) and len(plain) < len(spaces)


def _kernels(space) -> int:
    return len(re.findall(r'thread="blockIdx', space.mod.script()))


def _unbound_nests(space) -> int:
    """Loop nests left at the function's root, not yet bound to a kernel (postprocessing would make each one)."""
    return len(re.findall(r"^        for ", space.mod.script(), re.M))


def test_a_block_writing_the_output_is_padded_whole_and_stays_one_kernel(cuda):
    """The copy that drops the padded rows is folded into the tiled block's write cache: a predicated store,
    not a kernel of its own."""
    _, spaces = _spaces(_task(_batched(197, 197, 64), cuda), cuda)
    padded = [s for s in spaces if _pads(s)]
    assert padded and all(_pads(s) == [[1, 16, 1, 16]] for s in padded)
    assert all(_kernels(s) == 1 and _unbound_nests(s) == 0 for s in spaces)
    assert all("T.where" in s.mod.script() for s in padded)


def test_a_convolution_is_reindexed_then_padded(cuda):
    """wav2vec 2.0's shape of convolution (its output 99 = 9 x 11 columns): the input, read at `yy * 2 + ry`,
    becomes an einsum operand; the columns are padded to 112 and the output written through a predicate."""
    _, spaces = _spaces(_task(_conv1d, cuda), cuda)
    padded = [s for s in spaces if _pads(s)]
    assert padded and all(_pads(s) == [[1, 1, 16, 1, 1]] for s in padded)
    assert all(_kernels(s) == 1 and _unbound_nests(s) == 0 for s in spaces)
    assert all({"ReIndex", "ReverseComputeInline"} <= {i.kind.name for i in s.trace.insts} for s in padded)
    # the bounds check is made where the input is fetched into shared memory, not once per multiply-add
    for s in padded:
        checks = [line for line in s.mod.script().splitlines() if "if_then_else" in line]
        assert checks and all("_shared[" in line.split("=")[0] for line in checks), checks


def test_blocks_that_are_not_tiled_einsums_stay_as_they_are(cuda):
    def layer_norm(bb):
        x = relax.Var("x", relax.TensorType((197, 384), "float32"))
        g, b = (relax.Var(n, relax.TensorType((384,), "float32")) for n in "gb")
        with bb.function("main", [x, g, b]):
            with bb.dataflow():
                out = bb.emit_output(relax.op.nn.layer_norm(x, g, b, axes=[-1]))
            bb.emit_func_output(out)

    for build in (layer_norm, _linear(192, 96, 64)):
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


def test_a_padded_convolution_writing_the_output_through_a_predicate_computes_the_convolution():
    """The convolution reindexed and padded, given a write cache as a GPU's tiling gives it, the copy that drops
    the padded columns folded into that cache (FinishPadding: a predicated store), built for the host,
    against numpy."""
    target = tvm.target.Target({"kind": "llvm", "num-cores": 1})
    task = _task(_conv1d, target)
    sch = tvm.s_tir.Schedule(task.mod)
    block = sch.get_sblock("conv1d_ncw")
    padded = padding.padded_state(sch, block)
    assert padded is not None
    padded.cache_write(block, 0, "global")
    (folded,) = padding.FinishPadding().apply(padded, block)
    assert "T.where" in folded.mod.script() and "ReverseComputeInline" in [i.kind.name for i in folded.trace.insts]
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((1, 16, 199)).astype("float32"), rng.standard_normal((16, 16, 3)).astype("float32")
    expected = np.stack([sum(w[:, :, k] @ x[0, :, k:k + 197:2] for k in range(3))])
    lib = tvm.tirx.build(folded.mod, target=target)
    dev = tvm.cpu()
    out = tvm.runtime.tensor(np.zeros((1, 16, 99), "float32"), dev)
    lib(tvm.runtime.tensor(x, dev), tvm.runtime.tensor(w, dev), out)
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-4, atol=1e-4)


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


def test_the_padded_spaces_default_to_matmuls_and_the_setting_chooses(monkeypatch):
    from shared.settings import TunerSettings

    monkeypatch.delenv("SHARETUNE_PAD_AWKWARD", raising=False)
    assert TunerSettings().pad_awkward == "matmul"
    for given, mode in (("1", "all"), ("true", "all"), ("0", "off"), ("off", "off"), ("Matmul", "matmul"), ("all", "all")):
        monkeypatch.setenv("SHARETUNE_PAD_AWKWARD", given)
        assert TunerSettings().pad_awkward == mode, given
    monkeypatch.setenv("SHARETUNE_PAD_AWKWARD", "convs")
    with pytest.raises(ValueError, match="pad_awkward"):
        TunerSettings()


def test_matmul_mode_pads_matmuls_and_leaves_convolutions_as_they_are(cuda):
    """The padded convolutions' draws were slower than their unpadded ones on an H100 and the matmuls' faster:
    `matmul` offers the padded spaces to einsums read at plain indices only."""
    _, spaces = _spaces(_task(_linear(197, 96, 64), cuda), cuda, pad="matmul")
    assert [[16, 1, 1]] in [_pads(s) for s in spaces]
    _, spaces = _spaces(_task(_conv1d, cuda), cuda, pad="matmul")
    assert spaces and not any(_pads(s) for s in spaces)
    _, spaces = _spaces(_task(_conv1d, cuda), cuda, pad="all")
    assert any(_pads(s) for s in spaces)

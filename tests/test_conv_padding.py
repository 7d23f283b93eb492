"""Convolutions with awkward output extents computed over padded ones (services/tuner/metaschedule/conv_padding.py):
which convolutions are rewritten, that the rewritten model computes what the model did, that a job's tasks are
the padded convolutions, and that a compile finds the form its records were tuned on. CPU only."""
from __future__ import annotations

import pytest

pytest.importorskip("tvm")

import numpy as np  # noqa: E402
import tvm  # noqa: E402
from tvm import relax  # noqa: E402
from tvm.s_tir import meta_schedule as ms  # noqa: E402

from services.tuner.metaschedule.compile import compile_tuned  # noqa: E402
from services.tuner.metaschedule.conv_padding import pad_convolutions  # noqa: E402
from services.tuner.metaschedule.graph_forms import for_database  # noqa: E402
from services.tuner.metaschedule.extract import extract  # noqa: E402

LLVM = tvm.target.Target({"kind": "llvm", "num-cores": 1})


def _model(shape, weight, conv, **attrs):
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(shape, "float32"))
    w = relax.Var("w", relax.TensorType(weight, "float32"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.nn.gelu(conv(x, w, **attrs)))
        bb.emit_func_output(out)
    return bb.get()


def _wav2vec2_like():
    """A stride-2, 3-tap 1-D convolution writing 99 columns (wav2vec 2.0's write 799 and 399)."""
    return _model((1, 8, 199), (8, 8, 3), relax.op.nn.conv1d, strides=2)


def _run(ex_or_lib, inputs) -> np.ndarray:
    vm = relax.VirtualMachine(ex_or_lib, tvm.cpu())
    return vm["main"](*[tvm.runtime.tensor(a) for a in inputs]).numpy()


def _inputs(mod):
    rng = np.random.default_rng(0)
    return [rng.standard_normal([int(d) for d in p.ty.shape]).astype("float32") for p in mod["main"].params]


def _output_extents(mod) -> list[list[int]]:
    """The output shapes of the module's convolutions."""
    found = []

    def visit(expr):
        if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and expr.op.name.startswith("relax.nn.conv"):
            found.append([int(d) for d in expr.ty.shape])
    relax.analysis.post_order_visit(mod["main"], visit)
    return found


@pytest.mark.parametrize("make,padded", [
    (_wav2vec2_like, [[1, 8, 112]]),
    (lambda: _model((1, 4, 39, 30), (8, 4, 3, 3), relax.op.nn.conv2d), [[1, 8, 48, 28]]),  # 37 rows, 28 columns
])
def test_an_awkward_convolution_is_computed_over_its_padded_extent_and_gives_the_same_output(make, padded):
    mod = make()
    new, rewritten = pad_convolutions(mod)
    assert rewritten == 1 and _output_extents(new) == padded
    assert new["main"].ret_ty.shape[-1] == mod["main"].ret_ty.shape[-1]  # the model's own output is kept
    inputs = _inputs(mod)
    before, after = (_run(tvm.compile(m, target=LLVM), inputs) for m in (mod, new))
    assert before.shape == after.shape
    np.testing.assert_allclose(after, before, rtol=1e-5, atol=1e-5)


def test_a_convolution_that_tiles_is_left_as_it_is():
    mod = _model((1, 4, 30, 30), (8, 4, 3, 3), relax.op.nn.conv2d)  # 28 x 28: divisible by 4
    assert pad_convolutions(mod) == (mod, 0)
    nhwc = _model((1, 39, 39, 4), (8, 3, 3, 4), relax.op.nn.conv2d, data_layout="NHWC", kernel_layout="OHWI")
    assert pad_convolutions(nhwc)[1] == 0  # channels-last layouts are not rewritten


def test_a_job_tunes_the_padded_convolution_and_the_compile_finds_that_form_from_the_records(tmp_path):
    mod = _wav2vec2_like()
    plain = extract(mod, LLVM)
    padded = extract(mod, LLVM, pad_convolutions=True)
    conv = [t for t in padded if "conv1d" in t.name]
    assert len(conv) == 1 and "strided_slice" in conv[0].name  # the slice rides in the convolution's kernel
    assert len(padded) == len(plain)  # no kernel more

    (tmp_path / "db").mkdir()
    db = ms.database.JSONDatabase(work_dir=str(tmp_path / "db"), module_equality="structural")
    assert for_database(mod, LLVM, db) is mod  # stock's records, or none: the model as it is
    db.commit_workload(conv[0].mod)
    chosen = for_database(mod, LLVM, db)
    assert chosen is not mod and _output_extents(chosen) == [[1, 8, 112]]

    lib = compile_tuned(mod, LLVM, str(tmp_path / "db"), str(tmp_path / "tuned.so"))
    inputs = _inputs(mod)
    np.testing.assert_allclose(_run(tvm.runtime.load_module(lib), inputs),
                               _run(tvm.compile(mod, target=LLVM), inputs), rtol=1e-5, atol=1e-5)

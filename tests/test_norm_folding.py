"""Layer norms over the channel axis folded out of their transposes (services/tuner/metaschedule/norm_folding.py):
which patterns are folded, that the folded model computes what the model did, that a job's tasks lose the
transposes, and that a compile finds the form its records were tuned on (graph_forms.for_database). CPU only."""
from __future__ import annotations

import pytest

pytest.importorskip("tvm")

import numpy as np  # noqa: E402
import tvm  # noqa: E402
from tvm import relax  # noqa: E402
from tvm.s_tir import meta_schedule as ms  # noqa: E402

from services.tuner.metaschedule.compile import compile_tuned  # noqa: E402
from services.tuner.metaschedule.extract import extract  # noqa: E402
from services.tuner.metaschedule.graph_forms import for_database  # noqa: E402
from services.tuner.metaschedule.norm_folding import fold_norm_transposes  # noqa: E402

LLVM = tvm.target.Target({"kind": "llvm", "num-cores": 1})


def _block(first=(0, 2, 1), second=(0, 2, 1), axes=(-1,)):
    """wav2vec 2.0's feature-encoder layer: conv1d, transpose, layer norm, transpose, GELU (8 channels)."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 4, 41), "float32"))
    w = relax.Var("w", relax.TensorType((8, 4, 3), "float32"))
    width = 8 if list(axes) == [-1] and list(first) == [0, 2, 1] else 39
    gamma = relax.Var("gamma", relax.TensorType((width,), "float32"))
    beta = relax.Var("beta", relax.TensorType((width,), "float32"))
    with bb.function("main", [x, w, gamma, beta]):
        with bb.dataflow():
            conv = bb.emit(relax.op.nn.conv1d(x, w))
            t = bb.emit(relax.op.permute_dims(conv, list(first)))
            norm = bb.emit(relax.op.nn.layer_norm(t, gamma, beta, axes=list(axes)))
            back = bb.emit(relax.op.permute_dims(norm, list(second)))
            out = bb.emit_output(relax.op.nn.gelu(back))
        bb.emit_func_output(out)
    return bb.get()


def _inputs(mod):
    rng = np.random.default_rng(0)
    return [rng.standard_normal([int(d) for d in p.ty.shape]).astype("float32") for p in mod["main"].params]


def _run(ex_or_lib, inputs) -> np.ndarray:
    vm = relax.VirtualMachine(ex_or_lib, tvm.cpu())
    return vm["main"](*[tvm.runtime.tensor(a) for a in inputs]).numpy()


def _ops(mod) -> list[str]:
    found = []
    relax.analysis.post_order_visit(mod["main"], lambda e: found.append(e.op.name) if isinstance(
        e, relax.Call) and isinstance(e.op, tvm.ir.Op) else None)
    return found


def test_the_transposes_around_a_last_axis_layer_norm_fold_into_a_channel_norm_with_the_same_output():
    mod = _block()
    folded, n = fold_norm_transposes(mod)
    assert n == 1
    assert "relax.permute_dims" not in _ops(folded) and _ops(folded).count("relax.nn.layer_norm") == 1
    inputs = _inputs(mod)
    before, after = (_run(tvm.compile(m, target=LLVM), inputs) for m in (mod, folded))
    assert before.shape == after.shape == (1, 8, 39)
    np.testing.assert_allclose(after, before, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("first,second,axes", [
    ((1, 0, 2), (1, 0, 2), (-1,)),  # a swap of the outer axes: the norm's axis is not the channel axis
    ((0, 2, 1), (0, 1, 2), (-1,)),  # no transpose back: the layout changes
])
def test_other_transposes_and_norms_are_left_as_they_are(first, second, axes):
    mod = _block(first, second, axes)
    assert fold_norm_transposes(mod) == (mod, 0)


def test_a_job_tunes_the_norm_and_its_activation_as_one_task_and_the_compile_finds_that_form(tmp_path):
    mod = _block()
    plain, folded = extract(mod, LLVM), extract(mod, LLVM, fold_norms=True)
    assert any("transpose" in t.name for t in plain)
    assert not any("transpose" in t.name for t in folded) and len(folded) < len(plain)
    norm = [t for t in folded if "layer_norm" in t.name]
    assert len(norm) == 1 and "gelu" in norm[0].name  # the activation rides in the layer norm's kernel

    (tmp_path / "db").mkdir()
    db = ms.database.JSONDatabase(work_dir=str(tmp_path / "db"), module_equality="structural")
    assert for_database(mod, LLVM, db) is mod  # stock's records, or none: the model as it is
    db.commit_workload(norm[0].mod)
    chosen = for_database(mod, LLVM, db)
    assert chosen is not mod and "relax.permute_dims" not in _ops(chosen)

    lib = compile_tuned(mod, LLVM, str(tmp_path / "db"), str(tmp_path / "tuned.so"))
    inputs = _inputs(mod)
    np.testing.assert_allclose(_run(tvm.runtime.load_module(lib), inputs),
                               _run(tvm.compile(mod, target=LLVM), inputs), rtol=1e-5, atol=1e-5)


def test_wav2vec2s_feature_encoder_loses_its_six_transpose_kernels_on_cuda():
    pytest.importorskip("transformers")
    from bench.panel import build
    from services.measurer.metaschedule.targets import family_target
    from sharetune.intake import to_relax

    mod = to_relax(*build("wav2vec2-conv")).mod
    assert fold_norm_transposes(mod)[1] == 3
    cuda = family_target("cuda.sm_90")
    plain, folded = extract(mod, cuda), extract(mod, cuda, fold_norms=True)
    assert (len(plain), len(folded)) == (12, 6)  # its input's expand_dims is a view, no task
    assert sorted(t.name for t in folded if "layer_norm" in t.name) == [
        "fused_layer_norm1_gelu1", "fused_layer_norm2_gelu2", "fused_layer_norm_gelu"]

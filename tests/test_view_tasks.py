"""A fused function that only reshapes is a view in the served model, so it is not a tuning task
(services/tuner/metaschedule/extract.py tuning_tasks); the kernels a build launches are exactly the tasks."""
from __future__ import annotations

import re

import pytest

pytest.importorskip("tvm")

import tvm  # noqa: E402
from tvm import relax  # noqa: E402

from services.measurer.metaschedule.targets import family_target  # noqa: E402
from services.tuner.metaschedule.extract import extract  # noqa: E402


def _model():
    """wav2vec 2.0's first steps (its input expanded by a dimension, a convolution) and a ViT's flattening reshape
    of that result before a softmax: the reshapes fuse with nothing."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 64), "float32"))
    w = relax.Var("w", relax.TensorType((4, 1, 4), "float32"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            grown = bb.emit(relax.op.expand_dims(x, axis=[1]))
            conv = bb.emit(relax.op.nn.conv1d(grown, w, strides=[4]))
            flat = bb.emit(relax.op.reshape(conv, (4, 16)))
            out = bb.emit_output(relax.op.nn.softmax(flat))
        bb.emit_func_output(out)
    return bb.get()


def _launched(mod, target) -> set[str]:
    text = tvm.compile(mod, target=target).as_text()
    return {name for name in re.findall(r"call\s+(\S+)", text) if not name.startswith("vm.builtin")}


def test_a_reshape_only_function_is_not_tuned_and_every_launched_kernel_is():
    mod, target = _model(), family_target("cuda.sm_90")
    names = {t.name for t in extract(mod, target)}
    assert names == {"conv1d", "softmax"}, names
    # the build (no GPU needed) launches exactly those kernels; the reshapes are views of their inputs
    assert _launched(mod, target) == names
    assert {t.name for t in extract(mod, tvm.target.Target("llvm"))} == names

"""Zoo and intake against real TVM: conversion, compilation of the tiny model, and the errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from shared.errors import ModelError
from sharetune import intake, zoo

ROOT = Path(__file__).resolve().parents[1]
EXPECTED_SHAPES = {
    "resnet18": (1, 3, 224, 224),
    "mobilenetv2": (1, 3, 224, 224),
    "transformer": (1, 64, 256),
    "tiny": (1, 3, 16, 16),
    "small_cnn": (1, 3, 32, 32),
}


def _cpu_target():
    import tvm

    return tvm.target.Target({"kind": "llvm", "num-cores": 1})


def _run_relax(mod, *arrays) -> np.ndarray:
    import tvm
    from tvm import relax

    ex = tvm.compile(mod, target=_cpu_target())
    vm = relax.VirtualMachine(ex, tvm.cpu())
    out = vm["main"](*(tvm.runtime.tensor(a) for a in arrays))
    if not hasattr(out, "numpy"):  # a tuple/array of outputs
        out = out[0]
    return out.numpy()


def _main_param_shapes(mod):
    shapes = []
    for p in mod["main"].params:
        ann = getattr(p, "ty", None) or getattr(p, "struct_info")
        shapes.append(tuple(int(d) for d in ann.shape.values))
    return shapes


# ---------------------------------------------------------------------------------------------
# zoo
# ---------------------------------------------------------------------------------------------


def test_zoo_has_the_promised_models():
    assert set(zoo.ZOO) == set(EXPECTED_SHAPES)
    for name, entry in zoo.ZOO.items():
        assert entry.name == name and entry.description
        assert zoo.get(name) is entry


def test_zoo_is_deterministic_and_in_eval_mode():
    m1, x1 = zoo.get("small_cnn").build()
    m2, x2 = zoo.get("small_cnn").build()
    assert not m1.training and not m2.training
    assert all(a.equal(b) for a, b in zip(x1, x2))
    for p1, p2 in zip(m1.state_dict().values(), m2.state_dict().values()):
        assert p1.equal(p2)


def test_unknown_zoo_name_lists_known_models():
    with pytest.raises(ModelError) as err:
        zoo.get("resnet9000")
    assert "resnet9000" in str(err.value) and "tiny" in str(err.value)
    with pytest.raises(ModelError, match="resnet9000"):
        intake.to_relax("resnet9000")


def test_a_path_that_is_not_a_model_file_says_so(tmp_path):
    with pytest.raises(ModelError, match="is a directory, not a model file"):
        intake.to_relax(str(tmp_path))
    with pytest.raises(ModelError, match="does not exist"):
        intake.to_relax(str(tmp_path / "nowhere" / "model"))


@pytest.mark.parametrize("name", sorted(EXPECTED_SHAPES))
def test_every_zoo_model_converts_to_relax(name):
    rm = intake.to_relax(name)
    assert rm.source == "torch"
    assert rm.inputs == [(EXPECTED_SHAPES[name], "float32")]
    # weights are embedded as constants: main takes just the data input
    assert _main_param_shapes(rm.mod) == [EXPECTED_SHAPES[name]]


# ---------------------------------------------------------------------------------------------
# torch
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_relax():
    model, inputs = zoo.get("tiny").build()
    return model, inputs, intake.to_relax(model, inputs)


def test_tiny_compiles_and_matches_pytorch(tiny_relax):
    model, inputs, rm = tiny_relax
    expected = intake.reference_output(model, inputs)
    assert expected.shape == (1, 10)
    got = _run_relax(rm.mod, inputs[0].numpy())
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


def test_relax_module_is_taken_as_is(tiny_relax):
    _, _, rm = tiny_relax
    again = intake.to_relax(rm.mod)
    assert again.source == "relax" and again.mod is rm.mod
    assert again.inputs == [((1, 3, 16, 16), "float32")]


def test_relax_module_without_main():
    from tvm import relax

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((2, 2), "float32"))
    with bb.function("not_main", [x]):
        bb.emit_func_output(x)
    with pytest.raises(ModelError, match="main"):
        intake.to_relax(bb.get())


def test_torch_module_without_example_inputs():
    model, _ = zoo.get("tiny").build()
    with pytest.raises(ModelError, match="example inputs"):
        intake.to_relax(model)


def test_untraceable_torch_module():
    import torch

    class DataDependent(torch.nn.Module):
        def forward(self, x):
            if x.sum() > 0:  # data-dependent control flow: torch.export cannot trace it
                return x * 2
            return x - 1

    with pytest.raises(ModelError, match="torch.export could not trace"):
        intake.to_relax(DataDependent(), (torch.ones(2, 2),))


def test_unsupported_object_type():
    with pytest.raises(ModelError, match="int"):
        intake.to_relax(42)


# ---------------------------------------------------------------------------------------------
# ONNX
# ---------------------------------------------------------------------------------------------


def _onnx_matmul_relu(op_type: str = "Relu", domain: str = ""):
    from onnx import TensorProto, helper, numpy_helper

    w = np.random.default_rng(0).standard_normal((8, 4)).astype("float32")
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w"], ["y"]),
            helper.make_node(op_type, ["y"], ["z"], domain=domain),
        ],
        "matmul_relu",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, [2, 4])],
        initializer=[numpy_helper.from_array(w, "w")],
    )
    opsets = [helper.make_opsetid("", 17)]
    if domain:
        opsets.append(helper.make_opsetid(domain, 1))
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 8
    return model, w


def test_onnx_model_converts_from_proto_bytes_and_file(tmp_path):
    model, w = _onnx_matmul_relu()
    path = tmp_path / "mm.onnx"
    path.write_bytes(model.SerializeToString())
    for given in (model, model.SerializeToString(), path, str(path)):
        rm = intake.to_relax(given)
        assert rm.source == "onnx"
        assert rm.inputs == [((2, 8), "float32")]
        assert _main_param_shapes(rm.mod) == [(2, 8)]

    x = np.random.default_rng(1).standard_normal((2, 8)).astype("float32")
    np.testing.assert_allclose(
        _run_relax(rm.mod, x), np.maximum(x @ w, 0), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("data", [b"\x00\x01garbage\xff\xfe not onnx", b"", b"\x08\x07" * 40])
def test_corrupt_onnx_bytes(data):
    with pytest.raises(ModelError, match="ONNX"):
        intake.to_relax(data)


def test_garbage_onnx_file(tmp_path):
    path = tmp_path / "broken.onnx"
    path.write_bytes(b"this is definitely not a protobuf \xff\xff\xff")
    with pytest.raises(ModelError, match="ONNX") as err:
        intake.to_relax(str(path))
    assert "broken.onnx" in str(err.value) and "not a valid ONNX model" in str(err.value)


def test_missing_onnx_file(tmp_path):
    with pytest.raises(ModelError, match="nope.onnx"):
        intake.to_relax(tmp_path / "nope.onnx")


@pytest.mark.parametrize("domain", ["", "com.example.custom"])
def test_unknown_onnx_operator_is_named(domain):
    model, _ = _onnx_matmul_relu("FooBarOp", domain)
    with pytest.raises(ModelError, match="FooBarOp") as err:
        intake.to_relax(model)
    assert "MatMul" not in str(err.value)  # only the unsupported op is named


# ---------------------------------------------------------------------------------------------
# import hygiene
# ---------------------------------------------------------------------------------------------


def test_intake_imports_without_torch_or_onnx():
    code = (
        "import sys, sharetune.intake, sharetune.zoo; "
        "bad = [m for m in ('torch', 'onnx') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)

"""Model intake: turn whatever the user hands in into a Relax IRModule with static input shapes.

Accepted:

* a ``torch.nn.Module`` plus example inputs (``torch.export`` → Relax, weights as constants);
* an ONNX model: a path (``str``/``Path`` ending ``.onnx``), raw ``bytes``, or an ``onnx.ModelProto``;
* a ``tvm.IRModule`` whose ``main`` is a Relax function;
* the name of a model in :mod:`sharetune.zoo`.

Every failure is a :class:`shared.errors.ModelError` whose message names the problem.  torch, onnx
and tvm are imported only inside functions, so importing this module costs nothing.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shared.errors import ModelError

if TYPE_CHECKING:  # pragma: no cover
    import numpy
    import tvm

_MAX_DETAIL = 600  # characters of an underlying error quoted in a ModelError


@dataclass
class RelaxModel:
    mod: "tvm.IRModule"
    inputs: list[tuple[tuple[int, ...], str]] = field(default_factory=list)  # (shape, dtype)
    source: str = "relax"  # 'torch' | 'onnx' | 'relax'


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def _detail(exc: BaseException) -> str:
    """A short, one-paragraph rendering of an underlying error for a ModelError message."""
    text = str(exc).strip() or type(exc).__name__
    # TVM errors carry a long C++ traceback; keep the part a user can act on.
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if len(lines) > 6:
        lines = lines[-6:] if any("Error" in ln for ln in lines[-6:]) else lines[:6]
    text = " ".join(ln.strip() for ln in lines)
    if len(text) > _MAX_DETAIL:
        text = text[: _MAX_DETAIL - 3] + "..."
    return f"{type(exc).__name__}: {text}"


def _is_instance_of(obj: Any, module: str, dotted: str) -> bool:
    """isinstance(obj, module.dotted) without importing ``module`` if nobody has yet."""
    mod = sys.modules.get(module)
    if mod is None:
        return False
    cls: Any = mod
    for part in dotted.split("."):
        cls = getattr(cls, part, None)
        if cls is None:
            return False
    return isinstance(obj, cls)


def _main_inputs(mod: "tvm.IRModule", what: str) -> list[tuple[tuple[int, ...], str]]:
    """(shape, dtype) of each input of ``mod['main']``; ModelError unless all are static tensors."""
    from tvm import relax

    names = sorted(g.name_hint for g in mod.get_global_vars())
    if "main" not in names:
        raise ModelError(
            f"{what} has no 'main' function (functions: {', '.join(names) or 'none'})"
        )
    func = mod["main"]
    if not isinstance(func, relax.Function):
        raise ModelError(f"{what}: 'main' is a {type(func).__name__}, not a Relax function")

    params = list(func.params)
    num_input = func.attrs.get("num_input") if func.attrs is not None else None
    if num_input is not None:
        params = params[: int(num_input)]

    # TVM 0.27 calls a Var's annotation ``ty`` (TensorType); older releases ``struct_info``.
    tensor_cls = getattr(relax, "TensorType", None) or getattr(relax, "TensorStructInfo")
    inputs: list[tuple[tuple[int, ...], str]] = []
    for p in params:
        pname = getattr(p, "name", None) or getattr(p, "name_hint", "?")
        ann = getattr(p, "ty", None)
        if ann is None:
            ann = getattr(p, "struct_info", None)
        if not isinstance(ann, tensor_cls):
            raise ModelError(
                f"{what}: input {pname!r} is a {type(ann).__name__}, not a tensor; "
                "only tensor inputs are supported"
            )
        shape = ann.shape
        if shape is None or not isinstance(shape, relax.ShapeExpr):
            raise ModelError(
                f"{what}: input {pname!r} has unknown shape; tuning needs static shapes"
            )
        dims = []
        for d in shape.values:
            if isinstance(d, int):
                dims.append(int(d))
            elif type(d).__name__ == "IntImm":
                dims.append(int(d.value))
            else:
                raise ModelError(
                    f"{what}: input {pname!r} has dynamic shape {list(shape.values)}; "
                    "tuning needs static shapes"
                )
        inputs.append((tuple(dims), str(ann.dtype)))
    return inputs


# --------------------------------------------------------------------------------------------
# torch
# --------------------------------------------------------------------------------------------


def _from_torch(model: Any, example_inputs: Any) -> RelaxModel:
    import torch

    name = type(model).__name__
    if example_inputs is None:
        raise ModelError(
            f"torch module {name} needs example inputs (a tuple of tensors) to be traced"
        )
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    elif isinstance(example_inputs, list):
        example_inputs = tuple(example_inputs)
    if not isinstance(example_inputs, tuple) or not all(
        isinstance(t, torch.Tensor) for t in example_inputs
    ):
        raise ModelError(
            f"example inputs for torch module {name} must be a tuple of tensors, "
            f"got {type(example_inputs).__name__}"
        )

    model.eval()
    try:
        with torch.no_grad(), _torch_deprecations_quiet():
            exported = torch.export.export(model, example_inputs)
    except Exception as exc:  # torch raises many kinds of errors here
        raise ModelError(f"torch.export could not trace torch module {name}: {_detail(exc)}") from exc

    from tvm.relax.frontend.torch import from_exported_program

    try:
        with _torch_deprecations_quiet():
            mod = from_exported_program(exported)
    except AssertionError as exc:
        m = re.search(r"Unsupported function types \[(.*?)\]", str(exc))
        if m:
            ops = ", ".join(sorted(s.strip(" '\"") for s in m.group(1).split(",") if s.strip()))
            raise ModelError(
                f"torch module {name} uses operator(s) not supported by TVM's PyTorch frontend: "
                f"{ops}"
            ) from exc
        raise ModelError(
            f"TVM's PyTorch frontend could not convert torch module {name}: {_detail(exc)}"
        ) from exc
    except Exception as exc:
        raise ModelError(
            f"TVM's PyTorch frontend could not convert torch module {name}: {_detail(exc)}"
        ) from exc
    return RelaxModel(mod, _main_inputs(mod, f"torch module {name}"), "torch")


@contextlib.contextmanager
def _torch_deprecations_quiet():
    """torch warns of its own deprecated LeafSpec check inside export and when the exported program is
    copied: nothing a user can act on, and it was printed on every job."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*LeafSpec.*", category=FutureWarning)
        yield


def reference_output(model: Any, example_inputs: Any) -> "numpy.ndarray":
    """The model's (first) output on ``example_inputs`` as numpy, in eval mode without grad."""
    import torch

    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    model.eval()
    with torch.no_grad():
        out = model(*example_inputs)
    while isinstance(out, (tuple, list, dict)):
        out = next(iter(out.values())) if isinstance(out, dict) else out[0]
    return out.detach().cpu().numpy()


# --------------------------------------------------------------------------------------------
# ONNX
# --------------------------------------------------------------------------------------------


def _load_onnx(model: Any) -> tuple[Any, str]:
    """An ``onnx.ModelProto`` and a description of where it came from."""
    import onnx

    if isinstance(model, onnx.ModelProto):
        proto, what = model, f"ONNX model {model.graph.name or '(unnamed)'!r}"
        if not proto.HasField("graph"):
            raise ModelError(f"{what} is not a valid ONNX model: it has no graph")
        _check_onnx_proto(proto, what)
        return proto, what

    if isinstance(model, (bytes, bytearray, memoryview)):
        data, what = bytes(model), f"the given data ({len(model)} bytes)"
    else:
        path = Path(model)
        what = f"ONNX file {str(path)!r}"
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise ModelError(f"cannot read {what}: {exc.strerror or exc}") from exc

    try:
        proto = onnx.load_model_from_string(data)
    except Exception as exc:  # protobuf DecodeError and friends
        raise ModelError(f"{what} is not a valid ONNX model: {_detail(exc)}") from exc
    # Protobuf is lenient: many garbage byte strings decode to a (nearly) empty message.
    if not proto.HasField("graph"):
        raise ModelError(f"{what} is not a valid ONNX model: it has no graph")
    _check_onnx_proto(proto, what)
    return proto, what


def _check_onnx_proto(proto: Any, what: str) -> None:
    if proto.ir_version < 3:
        raise ModelError(
            f"{what} is not a valid ONNX model: IR version {proto.ir_version} "
            "(TVM needs 3 or later)"
        )
    if not proto.graph.node:
        raise ModelError(f"{what} has no operators (its graph has no nodes)")
    if not proto.graph.output:
        raise ModelError(f"{what} is not a valid ONNX model: its graph has no outputs")


def _onnx_nodes(graph: Any):
    """Every node of ``graph``, including those in subgraphs (If/Loop/Scan bodies)."""
    import onnx

    for node in graph.node:
        yield node
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from _onnx_nodes(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for g in attr.graphs:
                    yield from _onnx_nodes(g)


def _onnx_opset(proto: Any) -> int:
    for imp in proto.opset_import:
        if imp.domain in ("", "ai.onnx"):
            return int(imp.version)
    return 1


def _check_onnx_ops(proto: Any, what: str) -> None:
    """ModelError naming every operator TVM's ONNX frontend has no converter for."""
    try:
        from tvm.relax.frontend.onnx.onnx_frontend import _get_convert_map

        convert_map = _get_convert_map()
    except Exception:  # private helper moved: fall back to the frontend's own error
        return
    handled_directly = {"If", "Constant"}
    opset = _onnx_opset(proto)
    missing: dict[str, str] = {}
    for node in _onnx_nodes(proto.graph):
        op = node.op_type
        label = op if node.domain in ("", "ai.onnx") else f"{op} (domain {node.domain!r})"
        if op in handled_directly:
            continue
        conv = convert_map.get(op)
        if conv is None:
            missing.setdefault(label, "")
            continue
        try:
            conv.get_converter(opset)
        except Exception:
            missing.setdefault(label, f" at opset {opset}")
    if missing:
        ops = ", ".join(f"{k}{v}" for k, v in sorted(missing.items()))
        raise ModelError(f"{what} uses operator(s) not supported by TVM's ONNX frontend: {ops}")


def _onnx_shape_dict(proto: Any, what: str, example_inputs: Any) -> dict[str, list[int]]:
    """Static shapes of the graph's real inputs (not initializers)."""
    initializers = {t.name for t in proto.graph.initializer}
    graph_inputs = [i for i in proto.graph.input if i.name not in initializers]
    given: list[tuple[int, ...]] | None = None
    if example_inputs is not None:
        if hasattr(example_inputs, "shape"):
            example_inputs = (example_inputs,)
        given = [tuple(int(d) for d in getattr(x, "shape", x)) for x in example_inputs]
        if len(given) != len(graph_inputs):
            raise ModelError(
                f"{what} has {len(graph_inputs)} input(s) but {len(given)} example input(s) "
                "were given"
            )
    shapes: dict[str, list[int]] = {}
    for k, inp in enumerate(graph_inputs):
        if given is not None:
            shapes[inp.name] = list(given[k])
            continue
        ttype = inp.type.tensor_type
        if not ttype.HasField("shape"):
            raise ModelError(
                f"{what}: input {inp.name!r} has unknown rank; pass example inputs to fix its shape"
            )
        dims = []
        for d in ttype.shape.dim:
            if d.HasField("dim_value") and d.dim_value > 0:
                dims.append(int(d.dim_value))
            else:
                raise ModelError(
                    f"{what}: input {inp.name!r} has a dynamic dimension "
                    f"{d.dim_param or '?'!r}; tuning needs static shapes, so pass example inputs"
                )
        shapes[inp.name] = dims
    return shapes


def _from_onnx(model: Any, example_inputs: Any = None) -> RelaxModel:
    proto, what = _load_onnx(model)
    _check_onnx_ops(proto, what)
    shape_dict = _onnx_shape_dict(proto, what, example_inputs)

    import tvm
    from tvm.relax.frontend.onnx import from_onnx

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # checker complaints and renamed-input notices
            mod = from_onnx(proto, shape_dict=shape_dict)
    except tvm.error.OpNotImplemented as exc:
        text = str(exc)
        m = re.search(r"not supported for frontend ONNX:\s*([^\n]*)", text)
        ops = m.group(1).strip() if m else _detail(exc)
        raise ModelError(
            f"{what} uses operator(s) not supported by TVM's ONNX frontend: {ops}"
        ) from exc
    except NotImplementedError as exc:
        m = re.search(r"Operator (\S+) not implemented", str(exc))
        if m:
            raise ModelError(
                f"{what} uses operator(s) not supported by TVM's ONNX frontend: {m.group(1)}"
            ) from exc
        raise ModelError(f"TVM's ONNX frontend could not convert {what}: {_detail(exc)}") from exc
    except Exception as exc:
        raise ModelError(f"TVM's ONNX frontend could not convert {what}: {_detail(exc)}") from exc
    return RelaxModel(mod, _main_inputs(mod, what), "onnx")


# --------------------------------------------------------------------------------------------
# entry point
# --------------------------------------------------------------------------------------------


def _looks_like_onnx_path(model: Any) -> bool:
    if isinstance(model, Path):
        return True
    if isinstance(model, str):
        return model.lower().endswith(".onnx") or (
            (os.sep in model or "/" in model) and os.path.isfile(model)
        )
    return False


def to_relax(model: Any, example_inputs: Any = None) -> RelaxModel:
    """Convert ``model`` (torch module, ONNX path/bytes/proto, Relax IRModule, zoo name) to Relax.

    ``example_inputs`` is required for a torch module; for ONNX it optionally fixes the input
    shapes (tensors/arrays or shape tuples, one per graph input); otherwise it is ignored.
    """
    if _is_instance_of(model, "torch", "nn.Module"):
        return _from_torch(model, example_inputs)
    if _is_instance_of(model, "onnx", "ModelProto") or isinstance(
        model, (bytes, bytearray, memoryview)
    ):
        return _from_onnx(model, example_inputs)
    if _looks_like_onnx_path(model):
        return _from_onnx(model, example_inputs)
    if isinstance(model, str):
        from sharetune import zoo

        if model not in zoo.ZOO and (os.sep in model or "/" in model):  # a path, not a zoo name
            what = "is a directory, not a model file" if os.path.isdir(model) else "does not exist"
            raise ModelError(f"{model!r} {what} (give an ONNX file, a zoo model name or a torch module)")
        entry = zoo.get(model)
        try:
            module, inputs = entry.build()
        except Exception as exc:
            raise ModelError(f"zoo model {model!r} failed to build: {_detail(exc)}") from exc
        return _from_torch(module, inputs)
    if type(model).__module__.split(".")[0] == "tvm":
        import tvm

        if isinstance(model, tvm.IRModule):
            return RelaxModel(model, _main_inputs(model, "Relax module"), "relax")
    raise ModelError(
        f"cannot take in a model of type {type(model).__module__}.{type(model).__qualname__}; "
        "expected a torch.nn.Module with example inputs, an ONNX file path/bytes/ModelProto, "
        "a tvm.IRModule with a Relax 'main', or a zoo name"
    )

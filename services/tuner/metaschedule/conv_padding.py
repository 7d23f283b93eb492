"""Convolutions with awkward output extents computed over a padded extent, at the graph level.

A convolution writing 799 = 17 x 47 columns (wav2vec 2.0's feature encoder) leaves MetaSchedule's perfect tilings
four choices for that loop. Padding it inside the design space (padding.PadAwkwardEinsum) needs an einsum, and the
reindex that makes a convolution one turns its shared-memory tile into an im2col (1.49x the floats at stride 2 and
3 taps). Here the graph is rewritten instead: the convolution's own padding grows on the far side so that it writes
a multiple of padding.PAD columns (800), and a strided slice keeps the columns the model had. FuseOps puts the
slice in the convolution's own kernel (`fused_conv1d1_strided_slice1`), where MultiLevelTiling's write cache
stores it with a predicate: still one kernel, its input padding fetched into shared memory as a raw window.

The rewritten model is another model to the database: graph_forms.for_database picks the form a database was tuned
on, so records of either form compile, and a database tuned on the original (stock's) keeps it.
"""
from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from services.tuner.metaschedule.padding import PAD, awkward

_CONVOLUTIONS = {"relax.nn.conv1d": "NCW", "relax.nn.conv2d": "NCHW"}


def _ints(values) -> list[int]:
    return [int(v) for v in values]


def _static_shape(expr) -> list[int] | None:
    # TVM 0.27 calls an expression's annotation `ty` (a TensorType)
    sinfo = getattr(expr, "ty", None)
    if not isinstance(sinfo, relax.TensorType) or sinfo.shape is None:
        return None
    try:
        return _ints(sinfo.shape.values)
    except (TypeError, AttributeError):
        return None


def padded_extents(call) -> tuple[list[int], list[int]] | None:
    """(the output's spatial extents, each padded up to a multiple of PAD where awkward), or None when the call is
    not a convolution in the channels-first layouts with static shapes, or none of its extents is awkward."""
    if not isinstance(call.op, tvm.ir.Op) or call.op.name not in _CONVOLUTIONS:
        return None
    layout = _CONVOLUTIONS[call.op.name]
    attrs = call.attrs
    if attrs.data_layout != layout or (attrs.out_layout or layout) != layout:
        return None
    out = _static_shape(call)
    if out is None:
        return None
    spatial = out[2:]
    if not any(awkward(e) for e in spatial):
        return None
    return spatial, [-(-e // PAD) * PAD if awkward(e) else e for e in spatial]


@mutator
class _PadConvolutions(PyExprMutator):
    def __init__(self, mod):
        super().__init__(mod)
        self.rewritten = 0

    def visit_call_(self, call):
        extents = padded_extents(call)  # the call as bound in the input (its shape known)
        visited = super().visit_call_(call)
        if extents is None:
            return visited
        spatial, wanted = extents
        attrs = call.attrs
        dims = len(spatial)
        padding = _ints(attrs.padding)  # before..., after...
        strides = _ints(attrs.strides)
        after = [padding[dims + i] + (wanted[i] - spatial[i]) * strides[i] for i in range(dims)]
        data, weight = visited.args
        make = relax.op.nn.conv1d if dims == 1 else relax.op.nn.conv2d
        conv = make(data, weight, strides=strides, padding=padding[:dims] + after, dilation=_ints(attrs.dilation),
                    groups=int(attrs.groups), data_layout=attrs.data_layout, kernel_layout=attrs.kernel_layout,
                    out_layout=attrs.out_layout, out_dtype=attrs.out_dtype or None)
        padded = self.builder_.emit(conv)
        self.rewritten += 1
        axes = list(range(2, 2 + dims))
        return relax.op.strided_slice(padded, axes=axes, begin=[0] * dims, end=spatial, assume_inbound=True)


def pad_convolutions(mod: tvm.IRModule) -> tuple[tvm.IRModule, int]:
    """(the module with every awkward convolution computed over its padded extent, how many were rewritten)."""
    from services.tuner.metaschedule.graph_forms import rewrite_functions

    rewriter = _PadConvolutions(mod)
    padded = rewrite_functions(mod, rewriter)
    return (padded, rewriter.rewritten) if rewriter.rewritten else (mod, 0)


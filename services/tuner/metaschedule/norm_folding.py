"""Layer norms over the channel axis, at the graph level: `permute_dims(layer_norm(permute_dims(x)))` folded.

A channels-first network that normalises over its channels with a channels-last LayerNorm (wav2vec 2.0's feature
encoder: conv1d, transpose, LayerNorm, transpose, GELU; PyTorch's LayerNorm only normalises trailing axes) is
imported as two transposes around a layer norm over the last axis. Each transpose is a kernel of its own that
reads and writes the whole activation, and the second keeps the GELU out of the layer norm's kernel: four kernels
a block where two do the same arithmetic. Here `permute_dims(layer_norm(permute_dims(x, p), axes=[-1]), p)`, p
swapping the last two axes, becomes `layer_norm(x, axes=[-2])`: the same reduction over the same elements (the
same output; bit for bit on a CPU), and FuseOps then puts the GELU into the layer norm's kernel: wav2vec2-conv's
13 CUDA tasks become 7.

The rewritten model is another model to the database, as with padded convolutions: graph_forms.for_database
picks the form a database was tuned on.
"""
from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator


def _op(expr, name: str) -> bool:
    return isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and expr.op.name == name


def _swaps_last_two(call, ndim: int) -> bool:
    axes = call.attrs.axes
    return axes is not None and [int(a) for a in axes] == [*range(ndim - 2), ndim - 1, ndim - 2]


def _ndim(expr) -> int | None:
    # TVM 0.27 calls an expression's annotation `ty` (a TensorType)
    ty = getattr(expr, "ty", None)
    return int(ty.ndim) if isinstance(ty, relax.TensorType) and ty.ndim >= 2 else None


@mutator
class _FoldNormTransposes(PyExprMutator):
    def __init__(self, mod):
        super().__init__(mod)
        self.folded = 0

    def _bound(self, expr):
        return self.lookup_binding(expr) if isinstance(expr, relax.Var) else expr

    def visit_call_(self, call):
        visited = super().visit_call_(call)
        if not _op(visited, "relax.permute_dims"):
            return visited
        norm = self._bound(visited.args[0])
        if not _op(norm, "relax.nn.layer_norm"):
            return visited
        inner = self._bound(norm.args[0])
        ndim = _ndim(inner.args[0]) if _op(inner, "relax.permute_dims") else None
        if ndim is None or not (_swaps_last_two(visited, ndim) and _swaps_last_two(inner, ndim)):
            return visited
        if [int(a) % ndim for a in norm.attrs.axes] != [ndim - 1]:
            return visited
        attrs = norm.attrs
        self.folded += 1
        return relax.op.nn.layer_norm(inner.args[0], norm.args[1], norm.args[2], axes=[ndim - 2],
                                      epsilon=float(attrs.epsilon), center=bool(attrs.center),
                                      scale=bool(attrs.scale))


def fold_norm_transposes(mod: tvm.IRModule) -> tuple[tvm.IRModule, int]:
    """(the module with every transposed last-axis layer norm folded into one over the channel axis, how many)."""
    from services.tuner.metaschedule.graph_forms import rewrite_functions

    folder = _FoldNormTransposes(mod)
    folded = rewrite_functions(mod, folder)  # the transposes folded away are dropped
    return (folded, folder.folded) if folder.folded else (mod, 0)

"""Which stored workloads are near a new task's (pure logic, no TVM): where the warm seeds of a task's first
round come from (services/tuner/metaschedule/seeds.py).

Two workloads are comparable when they are of the same operator kind (the task's anchor operator, the first of
its fused name, without the numbers TVM appends: `fused_conv2d2_add_tir_sigmoid2_multiply2` and
`fused_conv2d_add_relu_1` are both `conv2d`; whether one's trace applies to the other is for the replay to
say, and a trace that does not is skipped) on the same target kind, and their
PrimFuncs have the same buffer parameters: as many, of the same ranks and dtypes. Their distance is the sum over
the parameters' dimensions of |log(a / b)|: a shape twice as large in one dimension is as far as one half as
large, a dimension equal adds nothing, and every dimension weighs the same whether it is a batch, a channel or a
spatial extent. Ties go to the same exact target (same CPU/arch attributes), then the same share, then the
workload key (so the choice is deterministic).

A convolution of more spatial dimensions is near one of fewer (a store that tuned image models seeds an audio
model's 1-D convolutions): its buffers are compared folded to the task's rank, the leading spatial dimensions of
each (NC-first layouts, as Relax imports them) merged into one by their product (a 56x56 image is 3136 positions,
a 3x3 kernel 9 taps), at CROSS_RANK more distance than a workload of the task's own kind, so one of its own kind
is taken first and a folded one never counts as a workload the cost model knows (seeds.NEAR_DISTANCE)."""
from __future__ import annotations

import math
import re

from shared.messages import WorkloadShape

_NUMBERED = re.compile(r"(?<=[a-z])\d+$")  # conv2d2 -> conv2d, matmul4 -> matmul; conv2d stays
# spatial dimensions of each convolution kind
CONV_DIMS = {"conv1d": 1, "conv2d": 2, "conv3d": 3}
# the distance a folded workload (another convolution kind) adds to its shapes': more than seeds.NEAR_DISTANCE
CROSS_RANK = 2.0


def op_kind(task_name: str) -> str:
    """The operator kind of a task: the first operator of its (fused) name, without TVM's numbering."""
    tokens = [t for t in task_name.split("_") if t and not t.isdigit()]
    if tokens and tokens[0] == "fused":
        tokens = tokens[1:]
    if not tokens:
        return task_name
    head = _NUMBERED.sub("", tokens[0])
    return f"{head}_{_NUMBERED.sub('', tokens[1])}" if head in ("batch", "layer", "group", "tir") and len(tokens) > 1 else head


def source_kinds(op: str) -> list[str]:
    """The operator kinds whose workloads may seed a task of kind `op`: its own, then the convolutions of more
    spatial dimensions."""
    dims = CONV_DIMS.get(op)
    return [op] + ([k for k, d in sorted(CONV_DIMS.items(), key=lambda kd: kd[1]) if d > dims] if dims else [])


def folded_dims(task_op: str, source_op: str) -> int:
    """Spatial dimensions a `source_op` workload folds away to compare with a `task_op` one (0: the same kind;
    -1: not related)."""
    if task_op == source_op:
        return 0
    if task_op in CONV_DIMS and source_op in CONV_DIMS and CONV_DIMS[source_op] > CONV_DIMS[task_op]:
        return CONV_DIMS[source_op] - CONV_DIMS[task_op]
    return -1


def fold(dims: list[int], k: int, rank: int) -> list[int]:
    """A buffer's shape with its first k + 1 spatial dimensions (after N and C) merged into one, when the buffer
    has the convolution's rank (a bias broadcast over [1, C, 1, 1] folds too); another buffer as it is."""
    if k <= 0 or len(dims) != rank:
        return list(dims)
    return list(dims[:2]) + [math.prod(dims[2:3 + k])] + list(dims[3 + k:])


def _aligned(a: WorkloadShape, b: WorkloadShape) -> list[list[int]] | None:
    """b's parameter shapes as a's kind sees them (folded when b is a convolution of more dimensions), or None
    when the two are not comparable: another kind, another count of parameters, ranks or dtypes."""
    k = folded_dims(a.op, b.op)
    if k < 0 or len(a.params) != len(b.params) or a.dtypes != b.dtypes:
        return None
    rank = CONV_DIMS.get(b.op, 0) + 2
    params = [fold(p, k, rank) for p in b.params]
    return params if all(len(x) == len(y) for x, y in zip(a.params, params)) else None


def comparable(a: WorkloadShape, b: WorkloadShape) -> bool:
    return _aligned(a, b) is not None


def distance(a: WorkloadShape, b: WorkloadShape) -> float:
    """Sum of |log| shape ratios over every dimension of every buffer parameter (b folded to a's kind, plus
    CROSS_RANK, when it is a convolution of more dimensions); inf when not comparable (or a dimension is 0)."""
    params = _aligned(a, b)
    if params is None:
        return math.inf
    total = CROSS_RANK if a.op != b.op else 0.0
    for x, y in zip(a.params, params):
        for d, e in zip(x, y):
            if d <= 0 or e <= 0:
                return math.inf
            total += abs(math.log(d / e))
    return total


def nearest(task: WorkloadShape, stored: list[WorkloadShape], k: int = 3) -> list[tuple[float, WorkloadShape]]:
    """The k stored workloads nearest the task (its own workload key left out: those records reach the search
    through the database already), nearest first."""
    scored = [(distance(task, s), s) for s in stored if s.wkey != task.wkey]
    scored = [(d, s) for d, s in scored if d < math.inf]
    scored.sort(key=lambda ds: (ds[0], ds[1].target != task.target, ds[1].share != task.share, ds[1].wkey))
    return scored[:k]

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
workload key (so the choice is deterministic)."""
from __future__ import annotations

import math
import re

from shared.messages import WorkloadShape

_NUMBERED = re.compile(r"(?<=[a-z])\d+$")  # conv2d2 -> conv2d, matmul4 -> matmul; conv2d stays


def op_kind(task_name: str) -> str:
    """The operator kind of a task: the first operator of its (fused) name, without TVM's numbering."""
    tokens = [t for t in task_name.split("_") if t and not t.isdigit()]
    if tokens and tokens[0] == "fused":
        tokens = tokens[1:]
    if not tokens:
        return task_name
    head = _NUMBERED.sub("", tokens[0])
    return f"{head}_{_NUMBERED.sub('', tokens[1])}" if head in ("batch", "layer", "group", "tir") and len(tokens) > 1 else head


def comparable(a: WorkloadShape, b: WorkloadShape) -> bool:
    return (a.op == b.op and len(a.params) == len(b.params) and a.dtypes == b.dtypes
            and all(len(x) == len(y) for x, y in zip(a.params, b.params)))


def distance(a: WorkloadShape, b: WorkloadShape) -> float:
    """Sum of |log| shape ratios over every dimension of every buffer parameter; inf when not comparable (or a
    dimension is 0)."""
    if not comparable(a, b):
        return math.inf
    total = 0.0
    for x, y in zip(a.params, b.params):
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

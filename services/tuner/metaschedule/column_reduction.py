"""Reductions over a non-innermost axis as one coalesced kernel, in a CUDA design space beside the others.

A layer norm over the channel axis of a channels-first tensor (wav2vec 2.0's feature encoder once its transposes
are folded, norm_folding.py) reduces `x[c, t]` over `c` for every `t`. DLight binds the channels to the threads
of a block per time step, and MetaSchedule's CUDA rules do the same (CrossThreadReduction) or give each reduction
a kernel of its own (AutoBind): either way a warp reads 32 addresses a row apart, or three kernels read the tensor.
`ColumnReduction` adds a state where the function's injective blocks are inlined into its output, the output's
innermost axis is split across threadIdx.x (a warp reads 32 neighbouring floats), the reduced axis across
threadIdx.y, and each reduction is computed at the output's block loop, its in-thread partial sums then combined
across threadIdx.y: one kernel. Both thread extents are sampled (categorical decisions the
search mutates); the blocks it scheduled carry `schedule_rule: None`, so the target's rules leave them alone and
only the unrolling is added. A function it does not fit keeps the target's states alone.

Two variants (`TunerSettings.column_reductions`): `on` adds the state beside the target's, 16-64 threads across the
inner axis; `wide` makes it the function's only state (the default kernel still guards the export) with 8-32
threads across the inner axis and 8-64 across the reduced one, so a 399-column norm runs in 13-50 blocks, not 7-25.

Each reduction's result stays in every thread (local scope: each reads it from the cross-thread reduction's buffer
after its last barrier). Written to shared memory instead, the threadIdx.y == 0 threads stored it and the others read
it with no barrier between (TVM's ThreadSync takes an access at the same index for the same thread's), and on an H100
every wav2vec2-conv module tuned with that kernel served NaN (docs/time_to_quality.md, 2026-12-07). With local
scope it matches PyTorch on an H100 (5.2e-6) and `wide` is the default. A contraction is no column reduction: a
matmul's `W[k, n]` is read down a column too, and the one-kernel state alone made ViT's dense layers 7-13x slower
than untuned until `_reduces_a_column` asked for every output axis in each read of the reduced variable.
"""
from __future__ import annotations

import tvm
from tvm.ir.utils import derived_object
from tvm.s_tir.meta_schedule.schedule_rule import PyScheduleRule

from services.tuner.metaschedule.padding import root_blocks

# per variant: threads across the innermost axis (a warp's coalesced reads, 8 floats being one 32-byte sector) and
# across the reduced one (combined in shared memory)
THREADS = {"on": ((16, 32, 64), (1, 2, 4, 8, 16)), "wide": ((8, 16, 32), (8, 16, 32, 64))}
_REDUCE = 2  # IterVar.CommReduce


def _is_reduction(block) -> bool:
    return any(int(iv.iter_type) == _REDUCE for iv in block.iter_vars)


def _names(expr) -> set[str]:
    """The variables an index expression uses, by name (unique among a block's iteration variables)."""
    return {v.name for v in tvm.tirx.analysis.undefined_vars(expr)}


def _reduces_a_column(block) -> bool:
    """One reduced variable, never a buffer's last index, read at an earlier index of a buffer whose last index is
    spatial; and a reduction, not a contraction: every read that the reduced variable indexes also indexes every
    spatial variable (a matmul's operands each lack one of the output's axes: `W[k, n]` is read down a column, but
    a coalesced kernel of it is a naive matmul)."""
    reduced = [iv.var.name for iv in block.iter_vars if int(iv.iter_type) == _REDUCE]
    spatial = {iv.var.name for iv in block.iter_vars if int(iv.iter_type) != _REDUCE}
    if len(reduced) != 1:
        return False
    column = False
    for region in block.reads:
        index = [_names(r.min) for r in region.region]
        used = set().union(*index)
        if reduced[0] not in used:
            continue
        if not spatial <= used or reduced[0] in index[-1]:
            return False
        column = column or (len(index) >= 2 and any(n == {reduced[0]} for n in index[:-1])
                            and len(index[-1]) == 1 and index[-1] <= spatial)
    return column


def fits(sch, block) -> bool:
    """Whether `block` is the function's one output, the others being column reductions and injective blocks,
    with at least one column reduction."""
    root = sch.get_sblock("root")
    outputs = sch.get_output_blocks(root)
    if len(outputs) != 1 or sch.get(outputs[0]).name_hint != sch.get(block).name_hint:
        return False
    if _is_reduction(sch.get(block)) or len(sch.get_loops(block)) < 2:
        return False
    reductions = [b for b in root_blocks(sch) if _is_reduction(sch.get(b))]
    return bool(reductions) and all(_reduces_a_column(sch.get(b)) for b in reductions)


def coalesced_state(sch, block, variant: str = "on"):
    """A copy of `sch` scheduled as the module's doc says (the thread extents sampled from the variant's
    choices), or None where TVM refuses a step."""
    out = sch.copy()
    name = out.get(block).name_hint
    reductions, scheduled = [], [name]
    for b in root_blocks(out):
        blk = out.get(b)
        if blk.name_hint == name:
            continue
        if _is_reduction(blk):
            reductions.append(b)
            scheduled.append(blk.name_hint)
        else:
            out.compute_inline(b)
    block = out.get_sblock(name)
    inner, reduce = THREADS[variant]
    tx = out.sample_categorical(list(inner), [1 / len(inner)] * len(inner))
    ty = out.sample_categorical(list(reduce), [1 / len(reduce)] * len(reduce))
    *outer, c, t = out.get_loops(block)
    t_block, t_thread = out.split(t, [None, tx])
    c_serial, c_thread = out.split(c, [None, ty])
    out.reorder(*outer, t_block, c_thread, t_thread, c_serial)
    bx = out.fuse(*outer, t_block) if outer else t_block
    out.bind(bx, "blockIdx.x")
    out.bind(c_thread, "threadIdx.y")
    out.bind(t_thread, "threadIdx.x")
    for r in reversed(reductions):  # the last producer first: each lands before its consumers
        out.compute_at(r, bx, preserve_unit_loops=True)
    for r in reductions:
        out.set_scope(r, 0, "local")
        *_, t_local, k = out.get_loops(r)
        k_serial, k_thread = out.split(k, [None, ty])
        # cross-thread reduction wants every reduction loop innermost: the spatial thread loop goes outside
        out.reorder(t_local, k_thread, k_serial)
        out.bind(k_thread, "threadIdx.y")
        out.bind(t_local, "threadIdx.x")
    for n in scheduled:
        out.annotate(out.get_sblock(n), "schedule_rule", "None")
    return out


@derived_object
class ColumnReduction(PyScheduleRule):
    """The block as it is, and (see the module's doc) where the function is an output fed by column reductions,
    a state with one coalesced kernel: beside the block as it is (`on`) or instead of it (`wide`)."""

    def __init__(self, variant: str = "on") -> None:
        if variant not in THREADS:
            raise ValueError(f"column reduction variant {variant!r}: expected one of {sorted(THREADS)}")
        self.variant = variant

    def _initialize_with_tune_context(self, context) -> None:
        pass

    def apply(self, sch, block):
        try:
            state = coalesced_state(sch, block, self.variant) if fits(sch, block) else None
        except Exception:  # noqa: BLE001 -- a function this rule does not know: the target's states alone
            state = None
        if state is None:
            return [sch]
        return [state] if self.variant == "wide" else [sch, state]

    def clone(self):
        return ColumnReduction(self.variant)

"""Padded einsums in a CUDA design space, beside the unpadded ones.

MetaSchedule tiles a loop only by exact divisors of its extent (SamplePerfectTile; a decision whose product is
not the extent falls back to [1, ..., extent]). An awkward extent leaves it nothing to tile with: ViT's 197
tokens are prime, so every matmul over them puts all 197 rows at one tile level. On the H200 no tuned schedule
of ViT-S's MLP matmul (197x1536x384) came near the untuned module's (DLight pads and predicates): 106.9 us
after 64 trials against 66.7 us. `PadAwkwardEinsum` runs before the target's rules and, for an einsum block
with an awkward extent, adds a state where that extent is padded to a multiple of PAD (TVM's pad_einsum, the
padding blocks inlined: the inputs read as zero beyond their bounds, the padded rows never written out), so
the usual rules tile 208 = 16 x 13 rows as well as 197. The unpadded state stays: the search picks between
them. A block pad_einsum cannot pad (a convolution's composite indices), or whose padded output cannot be
inlined into a consumer (it would cost a copy kernel), is left as it is. Off by default
(TunerSettings.pad_awkward): docs/time_to_quality.md has what it gave on the H200.
"""
from __future__ import annotations

from tvm import tirx
from tvm.ir.utils import derived_object
from tvm.s_tir.meta_schedule.schedule_rule import PyScheduleRule

# an awkward extent is padded to a multiple of this
PAD = 16


def awkward(extent: int) -> bool:
    """An extent whose divisors tile badly: above PAD and not a multiple of 8 (197, 799; not 200 or 384)."""
    return extent > PAD and extent % 8 != 0


def _neighbours(sch, block) -> dict[str, object]:
    """The block's producers and consumers, by name."""
    return {sch.get(b).name_hint: b for b in [*sch.get_producers(block), *sch.get_consumers(block)]}


def _padded(sch, block, padding: list[int]):
    """A copy of `sch` with `block` padded and the padding blocks (the producers and consumer pad_einsum adds)
    inlined, or None where it cannot be."""
    before = set(_neighbours(sch, block))
    out = sch.copy()
    try:
        out.pad_einsum(block, padding)
        for name, added in sorted(_neighbours(out, block).items()):
            if name not in before:
                out.compute_inline(added)
    except Exception:  # noqa: BLE001 -- TVM's schedule errors: this padding does not apply
        return None
    return out


def _reused_reads(block) -> int:
    """How many buffers the block reads along fewer than all its spatial iterators (a matmul's two operands;
    none of a layer norm's): MultiLevelTiling tiles a block for such reuse. 0 where an index is not a bare
    iterator or a constant (not an einsum)."""
    spatial = {iv.var.name for iv in block.iter_vars if iv.iter_type != tirx.IterVar.CommReduce}
    written = {w.source.name for w in block.writes}
    out = 0
    for read in block.reads:
        if read.source.name in written:
            continue
        used = set()
        for r in read.region:
            if isinstance(r.min, tirx.Var):
                used.add(r.min.name)
            elif not isinstance(r.min, tirx.IntImm):
                return 0
        out += bool(spatial - used)
    return out


def padded_state(sch, block):
    """`sch` with `block`'s awkward extents padded, or None (no awkward extent, not a reduction over a product
    of two buffers, not an einsum). Where the padded output has no consumer to be inlined into (the block
    writes the function's output), only its reduction extents are padded, where one is awkward."""
    realized = sch.get(block)
    extents = []
    for iv in realized.iter_vars:
        if not isinstance(iv.dom.extent, tirx.IntImm):
            return None
        extents.append((int(iv.dom.extent), iv.iter_type == tirx.IterVar.CommReduce))
    if not any(reduce for _, reduce in extents) or _reused_reads(realized) < 2:
        return None
    full = [PAD if awkward(e) else 1 for e, _ in extents]
    reduction_only = [PAD if awkward(e) and reduce else 1 for e, reduce in extents]
    for padding in (full, reduction_only):
        if any(p > 1 for p in padding):
            state = _padded(sch, block, padding)
            if state is not None:
                return state
    return None


@derived_object
class PadAwkwardEinsum(PyScheduleRule):
    """The block as it is, and (see the module's doc) padded where it has an awkward extent."""

    def _initialize_with_tune_context(self, context) -> None:
        pass

    def apply(self, sch, block):
        try:
            state = padded_state(sch, block)
        except Exception:  # noqa: BLE001 -- a block this rule does not know: the unpadded state alone
            state = None
        return [sch] if state is None else [sch, state]

    def clone(self):
        return PadAwkwardEinsum()

"""Padded einsums in a CUDA design space, beside the unpadded ones.

MetaSchedule tiles a loop only by exact divisors of its extent (SamplePerfectTile; a decision whose product is
not the extent falls back to [1, ..., extent]). An awkward extent leaves it nothing to tile with: ViT's 197
tokens are prime, so every matmul over them puts all 197 rows at one tile level; wav2vec 2.0's convolutions
write 799 = 17 x 47 and 399 = 3 x 7 x 19 columns. `PadAwkwardEinsum` runs before the target's rules and, for a
block that reduces a product of two buffers with an awkward extent, adds a state where that extent is padded to
a multiple of PAD (TVM's pad_einsum, the padding blocks inlined: the inputs read as zero beyond their bounds),
so the usual rules tile 208 = 16 x 13 rows as well as 197. A convolution's input, read at composite indices
(`yy * 2 + ry`), is first reindexed into an einsum operand (and inlined again with the padding). The padded
rows are never written: a consumer takes the padded output inlined; where the block writes the function's own
output, `InlinePaddedOutput` (after the target's rules) folds the copy that drops the padded rows into the
tiled block's write cache, a predicated store instead of a kernel. The unpadded state stays: the search picks
between them. Off by default (TunerSettings.pad_awkward): docs/time_to_quality.md has what it gave on the H200.
"""
from __future__ import annotations

from tvm import tirx
from tvm.tirx import analysis
from tvm.ir.utils import derived_object
from tvm.s_tir.meta_schedule.schedule_rule import PyScheduleRule

# an awkward extent is padded to a multiple of this
PAD = 16


def awkward(extent: int) -> bool:
    """An extent whose divisors tile badly: above PAD and odd or twice odd (197, 799, 98; not 28, 200 or 384,
    which tile by 4 at least: padding 28 to 32 would compute 30 % more for little)."""
    return extent > PAD and extent % 4 != 0


# marks the block that copies a padded output into the function's own buffer, for InlinePaddedOutput
PADDED_OUTPUT = "sharetune.padded_output"


def _neighbours(sch, block) -> dict[str, object]:
    """The block's producers and consumers, by name."""
    return {sch.get(b).name_hint: b for b in [*sch.get_producers(block), *sch.get_consumers(block)]}


def _composite_reads(block) -> list[int]:
    """The reads indexed by more than a bare iterator or a constant (a convolution's `yy * 2 + ry`)."""
    written = {w.source.name for w in block.writes}
    return [i for i, read in enumerate(block.reads) if read.source.name not in written
            and any(not isinstance(r.min, (tirx.Var, tirx.IntImm)) for r in read.region)]


def _padded(sch, block, padding: list[int]):
    """A copy of `sch` with `block` padded (its composite reads reindexed first) and the blocks this adds
    inlined: the producers into `block`, the consumer into its own consumer, or, where it writes the function's
    output, marked for InlinePaddedOutput. None where it cannot be."""
    before = set(_neighbours(sch, block))
    out = sch.copy()
    try:
        # reindexing shifts no read's position: a read reindexed stays where it was, reading the new buffer
        for i in _composite_reads(out.get(block)):
            out.reindex(block, ("read", i))
        out.pad_einsum(block, padding)
        consumers = {out.get(b).name_hint for b in out.get_consumers(block)}
        for name, added in sorted(_neighbours(out, block).items()):
            if name in before:
                continue
            if name not in consumers:
                out.compute_inline(added)
            elif out.get_consumers(added):
                out.compute_inline(added)
            else:
                out.annotate(added, PADDED_OUTPUT, 1)
    except Exception:  # noqa: BLE001 -- TVM's schedule errors: this padding does not apply
        return None
    return out


def _reused_reads(block) -> int:
    """How many buffers the block reads along fewer than all its spatial iterators (a matmul's two operands;
    none of a layer norm's): MultiLevelTiling tiles a block for such reuse. A read at composite indices counts
    by the iterators it uses (a convolution's input: its channel, column and tap, not its filter)."""
    spatial = {iv.var.name for iv in block.iter_vars if iv.iter_type != tirx.IterVar.CommReduce}
    written = {w.source.name for w in block.writes}
    out = 0
    for read in block.reads:
        if read.source.name in written:
            continue
        used: set[str] = set()
        for r in read.region:
            used.update(v.name for v in analysis.undefined_vars(r.min))
        out += bool(spatial - used)
    return out


def padded_state(sch, block):
    """`sch` with `block`'s awkward extents padded, or None (no awkward extent, not a reduction over a product
    of two buffers, a padding TVM cannot apply). Where the whole block cannot be padded, its reduction extents
    alone, where one is awkward."""
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


def _write_cache_of(sch, block):
    """The block's single consumer where it is a complete block (MultiLevelTiling's write cache), or None."""
    consumers = sch.get_consumers(block)
    return consumers[0] if len(consumers) == 1 else None


@derived_object
class InlinePaddedOutput(PyScheduleRule):
    """After the target's rules: a tiled padded block whose write cache feeds the copy that drops its padded
    rows into the function's output gets that copy folded into the write cache (a predicated store), so the
    padded block stays one kernel. Any other block, or a fold TVM refuses, is left as it is."""

    def _initialize_with_tune_context(self, context) -> None:
        pass

    def apply(self, sch, block):
        try:
            cache = _write_cache_of(sch, block)
            copy = _write_cache_of(sch, cache) if cache is not None else None
            if copy is not None and PADDED_OUTPUT in sch.get(copy).annotations:
                out = sch.copy()
                out.reverse_compute_inline(copy)
                return [out]
        except Exception:  # noqa: BLE001 -- the root block, a block already gone, a fold TVM refuses
            pass
        return [sch]

    def clone(self):
        return InlinePaddedOutput()

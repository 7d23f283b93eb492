"""Padded einsums in a CUDA design space, beside the unpadded ones.

MetaSchedule tiles a loop only by exact divisors of its extent (SamplePerfectTile; a decision whose product is
not the extent falls back to [1, ..., extent]). An awkward extent leaves it nothing to tile with: ViT's 197
tokens are prime, so every matmul over them puts all 197 rows at one tile level; wav2vec 2.0's convolutions
write 799 = 17 x 47 and 399 = 3 x 7 x 19 columns. `PadAwkwardEinsum` runs before the target's rules and, for a
block that reduces a product of two buffers with an awkward extent, adds a state where that extent is padded to
a multiple of PAD (TVM's pad_einsum), so the usual rules tile 208 = 16 x 13 rows as well as 197. A convolution's
input, read at composite indices (`yy * 2 + ry`), is first reindexed into an einsum operand. `FinishPadding`
(after the target's rules) inlines the padding blocks into what reads them then, the shared-memory fetches (the
bounds check once per element fetched: inlined before the tiling it sat in the innermost loop, once per
multiply-add, and the padded convolutions' best draws were 1.8-2.5x slower than the unpadded ones'), and folds
the copy that drops a padded output's extra rows into the tiled block's write cache (a predicated store, not a
kernel). The unpadded state stays: the search picks between them. Matmuls only by default
(TunerSettings.pad_awkward: off, matmul, all; convolutions only with `all`, their padded draws measured slower
than the unpadded ones): docs/time_to_quality.md has what it gave on the H200 and an H100.
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


# marks the blocks pad_einsum adds, for FinishPadding: the producers that read the inputs as zero beyond their
# bounds, and the copy of a padded output into the function's own buffer
PADDED_INPUT = "sharetune.padded_input"
PADDED_OUTPUT = "sharetune.padded_output"


def root_blocks(sch) -> list:
    """The blocks directly under the function's root block."""
    return sch.get_child_blocks(sch.get_sblock("root", func_name="main"))


def _composite_reads(block) -> list[int]:
    """The reads indexed by more than a bare iterator or a constant (a convolution's `yy * 2 + ry`)."""
    written = {w.source.name for w in block.writes}
    return [i for i, read in enumerate(block.reads) if read.source.name not in written
            and any(not isinstance(r.min, (tirx.Var, tirx.IntImm)) for r in read.region)]


def _padded(sch, block, padding: list[int]):
    """A copy of `sch` with `block` padded (its composite reads reindexed first). The blocks this adds are left
    for after the tiling (FinishPadding): a producer inlined now would put its bounds check in the innermost
    loop, once per multiply-add; inlined after the tiling it lands in the shared-memory fetch. A consumer that
    has a consumer of its own is inlined now. None where it cannot be padded."""
    out = sch.copy()
    before = {out.get(b).name_hint for b in root_blocks(out)}
    try:
        # reindexing shifts no read's position: a read reindexed stays where it was, reading the new buffer
        for i in _composite_reads(out.get(block)):
            out.reindex(block, ("read", i))
        out.pad_einsum(block, padding)
        consumers = {out.get(b).name_hint for b in out.get_consumers(block)}
        for b in root_blocks(out):
            name = out.get(b).name_hint
            if name in before:
                continue
            if name not in consumers:  # a padding block, or the reindex one behind it
                out.annotate(b, PADDED_INPUT, 1)
            elif out.get_consumers(b):
                out.compute_inline(b)
            else:
                out.annotate(b, PADDED_OUTPUT, 1)
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


def padded_state(sch, block, convolutions: bool = True):
    """`sch` with `block`'s awkward extents padded, or None (no awkward extent, not a reduction over a product
    of two buffers, a convolution where `convolutions` is off, a padding TVM cannot apply). Where the whole block
    cannot be padded, its reduction extents alone, where one is awkward."""
    realized = sch.get(block)
    if not convolutions and _composite_reads(realized):
        return None
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


def is_padded(trace) -> bool:
    """Whether a schedule's trace pads a block (a candidate of a padded state)."""
    return any(inst.kind.name == "PadEinsum" for inst in trace.insts)


@derived_object
class PadAwkwardEinsum(PyScheduleRule):
    """The block as it is, and (see the module's doc) padded where it has an awkward extent; a convolution (a
    read at composite indices) only where `convolutions` is on."""

    def __init__(self, convolutions: bool = True):
        super().__init__()
        self.convolutions = convolutions

    def _initialize_with_tune_context(self, context) -> None:
        pass

    def apply(self, sch, block):
        try:
            state = padded_state(sch, block, self.convolutions)
        except Exception:  # noqa: BLE001 -- a block this rule does not know: the unpadded state alone
            state = None
        return [sch] if state is None else [sch, state]

    def clone(self):
        return PadAwkwardEinsum(self.convolutions)


def _marked(sch, key: str) -> list:
    return [b for b in root_blocks(sch) if key in sch.get(b).annotations]


@derived_object
class FinishPadding(PyScheduleRule):
    """After the target's rules, on a padded state (PadAwkwardEinsum): the padding producers inlined into what
    reads them now (the shared-memory fetches: the bounds check once per element fetched, not per multiply-add),
    and the copy that drops the padded rows into the function's output folded into the tiled block's write cache
    (a predicated store, not a kernel of its own). PostOrderApply applies a rule to every block before the next
    rule, so the first block this meets finds the tiling done and finishes the state; a state it cannot finish is
    dropped (it would launch extra kernels). A state with nothing marked is left as it is."""

    def _initialize_with_tune_context(self, context) -> None:
        pass

    def apply(self, sch, block):
        try:
            if not _marked(sch, PADDED_INPUT) and not _marked(sch, PADDED_OUTPUT):
                return [sch]
            out = sch.copy()
            while pending := _marked(out, PADDED_INPUT):
                # the one whose consumers are all unmarked first: a padding block before the reindex it reads
                ready = [b for b in pending
                         if not any(PADDED_INPUT in out.get(c).annotations for c in out.get_consumers(b))]
                out.compute_inline(ready[0])
            for copy in _marked(out, PADDED_OUTPUT):
                out.reverse_compute_inline(copy)
        except Exception:  # noqa: BLE001 -- TVM refuses: the padded state is dropped
            return []
        return [out]

    def clone(self):
        return FinishPadding()

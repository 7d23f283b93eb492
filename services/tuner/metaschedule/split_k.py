"""Long reductions into few outputs split across thread blocks (split-K), as extra states of a CUDA design space.

MultiLevelTiling spreads a reduction block over thread blocks by its spatial iterators only. The panel's heaviest
tasks reduce 768-1536 products into 0.1-0.3 M outputs, and their best schedules on an H200 or H100 run 76-544
thread blocks of 47-156 threads on 132 SMs at 6-9 fp32 TFLOPS (wav2vec2-conv's two 1-D convolutions, 26-35 us; ViT's
MLP matmuls, 25-35 us; docs/time_to_quality.md, "Split-K"): most of the GPU waits. `SplitK` runs just before
MultiLevelTiling and, for a block that reduces a product of at least two buffers over at least MIN_REDUCTION
elements into at most MAX_OUTPUTS outputs, adds for each count in SPLITS that divides its outermost reduction loop a
state where that loop is split in as many parts, the parts rfactored into a partial-sum block (one more spatial
axis, which MultiLevelTiling then tiles as it tiles any block: more thread blocks), and the partial sums added by a
second kernel, its outputs fused and bound to thread blocks of a sampled width, the sum kept in a register and
stored once (where an epilogue the graph fused is then inlined). The states as they are stay: the search picks.
Off unless TunerSettings.split_k."""
from __future__ import annotations

import math

from tvm import tirx
from tvm.ir.utils import derived_object
from tvm.s_tir.meta_schedule.schedule_rule import PyScheduleRule

# a block qualifies when it reduces at least this many elements per output into at most this many outputs
MIN_REDUCTION = 256
MAX_OUTPUTS = 1 << 19
# the parts a reduction is split in, one design-space state each (the partial sums cost a write and a read of
# parts x outputs floats: 16 parts of ViT's 0.3 M outputs would move 38 MB, some 10 us on an H200)
SPLITS = (2, 4, 8)
# the write-back kernel's threads a block, one sampled
WRITE_BACK_THREADS = (64, 128, 256, 512)

_SPATIAL, _REDUCE = tirx.IterVar.DataPar, tirx.IterVar.CommReduce


def qualifies(block) -> bool:
    """Whether a block is a long reduction of a product into few outputs (the module's doc)."""
    if block.init is None or len({r.source.name for r in block.reads}) < 2:
        return False
    kinds = {iv.iter_type for iv in block.iter_vars}
    if not kinds <= {_SPATIAL, _REDUCE}:
        return False
    extents = [(iv.iter_type, iv.dom.extent) for iv in block.iter_vars]
    if any(not hasattr(e, "value") for _, e in extents):
        return False
    reduction = math.prod(int(e.value) for k, e in extents if k == _REDUCE)
    outputs = math.prod(int(e.value) for k, e in extents if k == _SPATIAL)
    return reduction >= MIN_REDUCTION and outputs <= MAX_OUTPUTS


def split_state(sch, block, parts: int, tiling):
    """A copy of `sch` with `block`'s outermost reduction loop split in `parts`, the partial sums tiled by
    `tiling` (MultiLevelTiling) and added by a second kernel: the states `tiling` makes, or [] where the block's
    loops are not in the form this expects (its spatial loops first) or a primitive refuses."""
    out = sch.copy()
    loops = out.get_loops(block)
    spatial = sum(1 for iv in out.get(block).iter_vars if iv.iter_type == _SPATIAL)
    if len(loops) <= spatial or int(out.get(loops[spatial]).extent) % parts:
        return []
    outer, _ = out.split(loops[spatial], factors=[parts, None])
    out.reorder(outer, *loops[:spatial])
    partial = out.rfactor(outer, factor_axis=0)
    # the write-back (the block itself now): its outputs fused over blocks and threads, the parts summed inside
    sums = out.get_loops(block)
    out.reorder(*sums[1:], sums[0])
    fused = out.fuse(*out.get_loops(block)[:-1])
    width = out.sample_categorical(candidates=list(WRITE_BACK_THREADS),
                                   probs=[1 / len(WRITE_BACK_THREADS)] * len(WRITE_BACK_THREADS))
    bx, tx = out.split(fused, factors=[None, width])
    out.bind(bx, "blockIdx.x")
    out.bind(tx, "threadIdx.x")
    store = out.cache_write(block, 0, "local")  # the sum in a register; what the graph fused after it inlines here
    out.reverse_compute_at(store, tx)
    return list(tiling.apply(out, partial))


@derived_object
class SplitK(PyScheduleRule):
    """The block as it is and, where it qualifies, split-K states (the module's doc). `tiling`: the target's
    MultiLevelTiling rule (the same object the design space applies to every other block)."""

    def __init__(self, tiling=None):
        super().__init__()
        self.tiling = tiling

    def _initialize_with_tune_context(self, context) -> None:
        pass

    def apply(self, sch, block):
        if self.tiling is None or not qualifies(sch.get(block)):
            return [sch]
        states = [sch]
        for parts in SPLITS:
            try:
                states += split_state(sch, block, parts, self.tiling)
            except Exception:  # noqa: BLE001 -- a block whose loops this does not know: its states as they are
                continue
        return states

    def clone(self):
        return SplitK(self.tiling)


def with_split_k(rules: list) -> list:
    """The target's rules with SplitK just before MultiLevelTiling (unchanged where there is none)."""
    at = next((i for i, r in enumerate(rules) if type(r).__name__ == "MultiLevelTiling"), None)
    return rules if at is None else [*rules[:at], SplitK(rules[at]), *rules[at:]]

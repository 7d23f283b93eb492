"""Blocks whose output nothing reads, left out of a CUDA design space.

Relax legalizes an inference batch norm into a function that also copies the running mean and variance into
buffers of its own (the training-mode outputs), and fusion keeps those copies after nothing reads them. DLight's
default schedule runs the function as one kernel; MetaSchedule's rules leave each copy a block of its own (not
inlined: it has no consumer), so every schedule it samples launches three to five kernels, two to four of them
computing nothing used. On one H100 (2026-12-05) efficientnet-mbconv's three batch norms timed 13.0-14.4 us at
their best against 4.6-4.9 us by default, and none of regnety-stage's beat its default either. Every batch norm
of ResNet-18, MobileNetV2 and the panel's CNNs has them. `InlineDeadBlocks` runs before the target's rules and
inlines such a block, which removes it: the trace says so (`compute_inline`), so a record replays on the
workload as extracted, and a model compiled with the records (stock TVM's compile_relax too) runs one kernel.
"""
from __future__ import annotations

from tvm.ir.utils import derived_object
from tvm.s_tir.meta_schedule.schedule_rule import PyScheduleRule


def is_dead(sch, block) -> bool:
    """Whether the block writes only buffers of the function's own (allocated in its root block) and no other
    block reads what it writes. (Its queries are traced: ask it of a schedule whose trace is not kept.)"""
    written = [w.source for w in sch.get(block).writes]
    if not written or sch.get_consumers(block):
        return False
    allocated = set(sch.get(sch.get_sblock("root")).alloc_buffers)
    return all(buf in allocated for buf in written)


def dead_blocks(mod) -> set[str]:
    """The names of a workload's dead blocks (is_dead), from a schedule of its own."""
    from tvm.s_tir.schedule import Schedule

    sch = Schedule(mod)
    return {sch.get(b).name_hint for b in sch.get_child_blocks(sch.get_sblock("root")) if is_dead(sch, b)}


@derived_object
class InlineDeadBlocks(PyScheduleRule):
    """A dead block (is_dead) inlined, which removes it; any other block as it is. Which blocks are dead is read
    once from the workload, so a space's trace gains only the inlining of each."""

    def _initialize_with_tune_context(self, context) -> None:
        try:
            self.dead = dead_blocks(context.mod) if context.mod is not None else set()
        except Exception:  # noqa: BLE001 -- a function this rule cannot read (no root block): nothing left out
            self.dead = set()

    def apply(self, sch, block):
        if sch.get(block).name_hint in getattr(self, "dead", ()):
            try:
                sch.compute_inline(block)
            except Exception:  # noqa: BLE001 -- a block TVM will not inline: left as it is, as the target's rules would
                pass
        return [sch]

    def clone(self):
        return InlineDeadBlocks()

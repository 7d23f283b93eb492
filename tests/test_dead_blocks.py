"""A CUDA design space leaves out the blocks whose output nothing reads (services/tuner/metaschedule/dead_blocks.py):
a batch norm's copies of its running statistics. CPU only: spaces, sampled schedules and CUDA source need no GPU."""
from __future__ import annotations

import pytest

pytest.importorskip("tvm")

import tvm_ffi  # noqa: E402
from tvm.s_tir.schedule import Schedule  # noqa: E402

from services.measurer.metaschedule.targets import family_target  # noqa: E402
from services.tuner.metaschedule.context import tune_context  # noqa: E402
from services.tuner.metaschedule.dead_blocks import dead_blocks  # noqa: E402
from services.tuner.metaschedule.extract import extract  # noqa: E402
from sharetune.intake import to_relax  # noqa: E402
from sharetune.testing.dead_blocks import kernel_count  # noqa: E402


@pytest.fixture(scope="module")
def target():
    from services.tuner.metaschedule.intrinsics import load_tensor_intrinsics

    load_tensor_intrinsics("cuda")
    return family_target("cuda.sm_90")


@pytest.fixture(scope="module")
def tasks(target):
    return {t.name: t for t in extract(to_relax("resnet18").mod, target)}


def _dead(mod) -> list[str]:
    return sorted(dead_blocks(mod))


def test_a_batch_norm_has_dead_copies_and_a_convolution_none(tasks):
    assert _dead(tasks["fused_batch_norm_relu"].mod) == ["T_multiply_1", "T_multiply_2"]
    assert _dead(tasks["conv2d1"].mod) == []


def test_a_sampled_batch_norm_schedule_is_one_kernel_and_replays_on_the_workload(tasks, target):
    """Sampled from the tuner's CUDA space, a batch norm runs as one kernel (DLight's default does too; without
    the rule each sample launched three), and its trace replays on the workload as extracted, as compile_relax
    applies a record."""
    task = tasks["fused_batch_norm_relu"]
    ctx = tune_context(task.mod, target, task.name, cold=True, population=64, num_threads=1)
    ctx.pre_tuning(1 << 20, 4, ctx.generate_design_space(), None, None)
    cands = ctx.generate_measure_candidates()
    assert cands
    for cand in cands:
        assert _dead(cand.sch.mod) == []
        assert kernel_count(cand.sch.mod, target) == 1
        again = Schedule(task.mod)
        cand.sch.trace.apply_to_schedule(again, remove_postproc=False)
        assert tvm_ffi.structural_equal(again.mod, cand.sch.mod)


def test_a_space_without_dead_blocks_is_unchanged(tasks, target):
    """The rule touches nothing else: a convolution's design spaces are those of the target's rules alone."""
    import tvm.s_tir.meta_schedule as ms

    from services.tuner.metaschedule.validity import cuda_postprocs, rule_kind

    task = tasks["conv2d1"]
    ours = tune_context(task.mod, target, task.name, cold=True, population=64, num_threads=1).generate_design_space()
    theirs = ms.TuneContext(mod=task.mod, target=target, task_name=task.name, num_threads=1,
                            space_generator=ms.space_generator.PostOrderApply(
                                sch_rules=ms.schedule_rule.ScheduleRule.create(rule_kind(target)),
                                postprocs=cuda_postprocs(target))).generate_design_space()
    def steps(spaces):  # the instructions, not the decisions sampled for them
        return [[inst.kind.name for inst in sp.trace.insts] for sp in spaces]

    assert steps(ours) == steps(theirs)

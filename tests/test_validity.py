"""The CUDA limits check that runs before MetaSchedule lowers a sample: it may reject only what TVM's own
postprocessors (VerifyGPUCode last) reject. CUDA design spaces and TVM's GPU checks need no GPU."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def cuda_tasks():
    from services.measurer.metaschedule.targets import family_target
    from services.tuner.metaschedule.extract import extract
    from services.tuner.metaschedule.intrinsics import load_tensor_intrinsics
    from sharetune.intake import to_relax

    load_tensor_intrinsics("cuda")
    target = family_target("cuda.sm_90")
    tasks = {t.name: t for t in extract(to_relax("resnet18").mod, target)}
    tasks.update({f"transformer:{t.name}": t for t in extract(to_relax("transformer").mod, target)})
    return target, tasks


@pytest.mark.parametrize("name", ["conv2d1", "conv2d3", "transformer:matmul1"])
def test_it_rejects_only_samples_that_tvm_rejects(cuda_tasks, name):
    import tvm

    from services.tuner.metaschedule.context import tune_context
    from services.tuner.metaschedule.validity import violations

    target, tasks = cuda_tasks
    if name not in tasks:
        name = next(n for n in tasks if n.startswith(name.split(":")[0] + ":") and "matmul" in n)
    task = tasks[name]
    ctx = tune_context(task.mod, target, task.name, True, 16, rand_state=1, num_threads=1, valid_sampling=False)
    spaces = ctx.generate_design_space()
    tvm_posts = ctx.space_generator.postprocs
    assert "_PyPostproc" not in [type(p).__name__ for p in tvm_posts]  # the setting off: TVM's own alone
    limits = (int(target.attrs["max_threads_per_block"]), int(target.attrs["max_shared_memory_per_block"]))
    rejected = tvm_rejected = 0
    for i in range(60):
        sch = tvm.s_tir.Schedule(task.mod, seed=i + 1, debug_mask=0)
        tvm.s_tir.schedule.Trace(spaces[i % len(spaces)].trace.insts, {}).apply_to_schedule(sch, remove_postproc=True)
        broken = [v for f in sch.mod.functions.values() if isinstance(f, tvm.tirx.PrimFunc)
                  for v in violations(f, *limits)]
        accepted = all(p.apply(sch) for p in tvm_posts)
        assert not (broken and accepted), f"sample {i} rejected ({broken}) though TVM accepts it"
        rejected += bool(broken)
        tvm_rejected += not accepted
    if name.startswith("conv2d"):  # most random conv samples break a limit the loop nest already shows
        assert rejected >= tvm_rejected // 2 > 0


def test_the_cuda_context_runs_the_check_first_and_keeps_tvms_postprocs(cuda_tasks):
    from services.tuner.metaschedule.context import tune_context
    from services.tuner.metaschedule.validity import LimitsCheck

    target, tasks = cuda_tasks
    task = tasks["conv2d1"]
    on = tune_context(task.mod, target, task.name, True, 16, num_threads=1).space_generator.postprocs
    off = tune_context(task.mod, target, task.name, True, 16, num_threads=1,
                       valid_sampling=False).space_generator.postprocs
    assert type(on[0]).__name__ == "_PyPostproc"  # TVM's wrapper of LimitsCheck
    assert [type(p).__name__ for p in on[1:]] == [type(p).__name__ for p in off]
    before = LimitsCheck.rejected
    ctx = tune_context(task.mod, target, task.name, True, 16, rand_state=3, num_threads=1)
    from tvm.s_tir import meta_schedule as ms

    ctx.pre_tuning(1 << 20, 8, ctx.generate_design_space(), ms.database.MemoryDatabase(), ms.cost_model.RandomModel())
    assert len(ctx.generate_measure_candidates()) == 8
    assert LimitsCheck.rejected > before  # a cold round's samples went through it

"""The CUDA precheck (services/tuner/metaschedule/validity.py) on random samples of real design spaces:
it only rejects what TVM's own postprocessors reject, and it rejects most of those. CPU only."""
from __future__ import annotations

import pytest

pytest.importorskip("tvm")

import tvm  # noqa: E402
from tvm.s_tir import meta_schedule as ms  # noqa: E402
from tvm.s_tir.schedule import Schedule, Trace  # noqa: E402

from services.measurer.metaschedule.targets import family_target  # noqa: E402
from services.tuner.metaschedule import validity  # noqa: E402
from services.tuner.metaschedule.context import tune_context  # noqa: E402
from services.tuner.metaschedule.extract import extract  # noqa: E402
from sharetune.intake import to_relax  # noqa: E402

TASKS = {"resnet18": ("conv2d1", "conv2d9"), "transformer": ("fused_matmul_add",)}
SAMPLES = 150


@pytest.fixture(scope="module")
def target():
    return family_target("cuda.sm_90")


@pytest.fixture(scope="module")
def tasks(target):
    out = {}
    for model, names in TASKS.items():
        by_name = {t.name: t for t in extract(to_relax(model).mod, target)}
        out.update({name: by_name[name] for name in names})
    return out


def _sample(task, spaces, seed: int):
    """One random sample of the task's design space, replayed as ReplayTrace does, before postprocs."""
    sch = Schedule(task.mod, seed=seed, debug_mask=0)
    Trace(spaces[seed % len(spaces)].trace.insts, {}).apply_to_schedule(sch, remove_postproc=True)
    sch.enter_postproc()
    return sch


@pytest.mark.parametrize("name", [n for names in TASKS.values() for n in names])
def test_precheck_rejects_only_what_tvm_rejects(tasks, target, name):
    limits = (int(target.attrs["max_threads_per_block"]), int(target.attrs["max_shared_memory_per_block"]),
              int(target.attrs["thread_warp_size"]))
    task = tasks[name]
    ctx = tune_context(task.mod, target, task.name, cold=True, population=64, rand_state=1, num_threads=1,
                       valid_sampling=False)
    spaces, postprocs = ctx.generate_design_space(), list(ctx.space_generator.postprocs)
    rejected = tvm_rejected = 0
    for seed in range(1, SAMPLES + 1):
        sch = _sample(task, spaces, seed)
        why = validity.violation(sch.mod, *limits)
        tvm_ok = True
        for p in postprocs:  # TVM's default chain, VerifyGPUCode last but one
            try:
                tvm_ok = bool(p.apply(sch))
            except Exception:  # noqa: BLE001 -- as ThreadedTraceApply: an exception rejects
                tvm_ok = False
            if not tvm_ok:
                break
        assert not (why and tvm_ok), f"{name} seed {seed}: precheck rejected ({why}) what TVM accepts"
        rejected += why is not None
        tvm_rejected += not tvm_ok
    # most random samples break the limits, and the precheck sees most of those (measured: 85-98 %)
    assert tvm_rejected >= SAMPLES // 2
    assert rejected >= 0.7 * tvm_rejected, (name, rejected, tvm_rejected)


def test_setting_picks_the_postprocs(tasks, target):
    task = tasks["conv2d1"]
    names = lambda ctx: [type(p).__name__ for p in ctx.space_generator.postprocs]  # noqa: E731
    stock = [type(p).__name__ for p in ms.postproc.Postproc.create("cuda-tensorcore")]
    off = tune_context(task.mod, target, task.name, cold=True, population=64, num_threads=1, valid_sampling=False)
    on = tune_context(task.mod, target, task.name, cold=True, population=64, num_threads=1)
    assert names(off) == stock and "VerifyGPUCode" in stock
    assert names(on) == ["_PyPostproc", *stock]  # the precheck (a Python postproc), then TVM's
    llvm = tvm.target.Target({"kind": "llvm", "num-cores": 2})
    cpu = tune_context(task.mod, llvm, task.name, cold=True, population=64, num_threads=1)
    assert "_PyPostproc" not in names(cpu)

"""Split-K states of a CUDA design space (services/tuner/metaschedule/split_k.py) on real workloads: which blocks get
them, that a cold round draws them within the limits, and that what it proposes passes TVM's whole postprocessor
chain and launches a partial-sum kernel and a write-back kernel. CPU only."""
from __future__ import annotations

import pytest

pytest.importorskip("tvm")

from tvm import relax  # noqa: E402
from tvm.s_tir import meta_schedule as ms  # noqa: E402

from services.measurer.metaschedule.targets import family_target  # noqa: E402
from services.tuner.metaschedule import split_k  # noqa: E402
from services.tuner.metaschedule.context import tune_context  # noqa: E402
from services.tuner.metaschedule.extract import extract  # noqa: E402
from services.tuner.metaschedule.sampling import TileLimits  # noqa: E402


@pytest.fixture(scope="module")
def target():
    from services.tuner.metaschedule.intrinsics import load_tensor_intrinsics

    load_tensor_intrinsics("cuda")
    return family_target("cuda.sm_90")


def _task(target, build):
    x = relax.Var("x", relax.TensorType(build["x"], "float32"))
    w = relax.Var("w", relax.TensorType(build["w"], "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, w]):
        with bb.dataflow():
            out = bb.emit_output(build["op"](x, w))
        bb.emit_func_output(out)
    (task,) = extract(bb.get(), target)
    return task


# wav2vec 2.0's feature-encoder convolution (256 channels, kernel 3, stride 2): 768 products into 0.1 M outputs
CONV1D = {"x": (1, 256, 799), "w": (256, 256, 3), "op": lambda x, w: relax.op.nn.conv1d(x, w, strides=2)}
# a depthwise 3x3 convolution: 9 products an output
DEPTHWISE = {"x": (1, 96, 56, 56), "w": (96, 1, 3, 3),
             "op": lambda x, w: relax.op.nn.conv2d(x, w, padding=1, groups=96)}
# a matmul whose 1 M outputs give the GPU enough blocks without a split
WIDE = {"x": (1024, 256), "w": (256, 1024), "op": relax.op.matmul}


def _block(task):
    from tvm.s_tir import Schedule

    sch = Schedule(task.mod)
    blocks = sch.get_child_blocks(sch.get_sblock("root", func_name="main"))
    return [sch.get(b) for b in blocks if sch.get(b).init is not None][0]


def test_only_long_reductions_into_few_outputs_qualify(target):
    assert split_k.qualifies(_block(_task(target, CONV1D)))
    assert not split_k.qualifies(_block(_task(target, DEPTHWISE)))
    assert not split_k.qualifies(_block(_task(target, WIDE)))


def _round(task, target, split: bool):
    ctx = tune_context(task.mod, target, task.name, cold=True, population=32, rand_state=3, num_threads=1,
                       split_k=split)
    spaces = ctx.generate_design_space()
    ctx.pre_tuning(1 << 20, 32, spaces, ms.database.MemoryDatabase(), None)
    return ctx, spaces, ctx.generate_measure_candidates() or []


def _kernels(mod, target) -> int:
    """The kernels a candidate launches, as a builder builds it."""
    import re

    from services.measurer.metaschedule.build import build

    source = build(mod, target).imports[0].inspect_source()
    return len(set(re.findall(r"__global__ void (?:__launch_bounds__\(\d+\) )?(\w+)\(", source)))


def _split(trace) -> bool:
    return any(inst.kind.name == "RFactor" for inst in trace.insts)


def test_a_cold_round_draws_split_states_that_tvm_accepts(target):
    task = _task(target, CONV1D)
    ctx, spaces, cands = _round(task, target, split=True)
    split_spaces = [s for s in spaces if _split(s.trace)]
    assert split_spaces and len(split_spaces) < len(spaces)  # the unsplit states stay
    # the partial-sum block's shared-memory reads are read off the trace, so draws respect the limit
    limits = TileLimits.of(split_spaces[0].trace, ctx.mod, int(target.attrs["max_shared_memory_per_block"]))
    assert limits.shared
    split = [c for c in cands if _split(c.sch.trace)]
    assert split, "a cold round proposed no split-K schedule"
    verify = ms.postproc.VerifyGPUCode()
    verify._initialize_with_tune_context(ctx)  # noqa: SLF001
    for cand in split[:3]:
        assert verify.apply(cand.sch.copy())
        assert _kernels(cand.sch.mod, target) == 2  # the partial sums, then their sum


def test_the_setting_off_leaves_the_design_space_as_it_was(target):
    task = _task(target, CONV1D)
    _, spaces, cands = _round(task, target, split=False)
    assert not any(_split(s.trace) for s in spaces)
    assert not any(_split(c.sch.trace) for c in cands)


def test_rules_without_multi_level_tiling_are_left_alone():
    rules = [object(), object()]
    assert split_k.with_split_k(rules) is rules


def test_an_ab_run_says_which_bests_split(target, tmp_path):
    from sharetune.testing.occupancy import split_bests_us
    from sharetune.testing.settings_ab import with_split_bests

    task = _task(target, CONV1D)
    _, _, cands = _round(task, target, split=True)
    split = next(c for c in cands if _split(c.sch.trace))
    plain = next(c for c in cands if not _split(c.sch.trace))
    db = ms.database.JSONDatabase(work_dir=str(tmp_path))
    workload = db.commit_workload(task.mod)
    args = ms.arg_info.ArgInfo.from_prim_func(task.mod["main"])
    db.commit_tuning_record(ms.database.TuningRecord(plain.sch.trace, workload, [3e-5], target, args))
    db.commit_tuning_record(ms.database.TuningRecord(split.sch.trace, workload, [2e-5], target, args))
    assert split_bests_us(str(tmp_path)) == [20.0]  # the workload's best is the split schedule
    db.commit_tuning_record(ms.database.TuningRecord(plain.sch.trace, workload, [1e-5], target, args))
    assert split_bests_us(str(tmp_path)) == []
    assert split_bests_us(str(tmp_path / "missing")) is None
    result = {"models": {"m": {"cold": {"database_dir": str(tmp_path)}}}}
    assert with_split_bests(result, "m")["models"]["m"]["cold"]["split_bests_us"] == []

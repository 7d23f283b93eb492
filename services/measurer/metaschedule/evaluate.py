"""The measurer's only TVM boundary: build a scheduled candidate and time it, in this warm process.

Builds run here, in the lane's long-lived process, and skip the import of tvm.s_tir.tensor_intrin that
stock LocalBuilder pays in every fresh pool (~40-70 s on a 2-core host): a candidate arrives already
scheduled (tensorized if at all), so building it needs no intrinsic registry."""
from __future__ import annotations

import time

import tvm
from tvm.s_tir.meta_schedule.runner.config import EvaluatorConfig
from tvm.s_tir.meta_schedule.runner.utils import alloc_argument_common, run_evaluator_common

from shared.codec import load_ir
from shared.messages import Candidate, MeasureResult, TimingConfig


def target_from_json(text: str) -> tvm.target.Target:
    import json

    return tvm.target.Target(json.loads(text))


def device_for(target: tvm.target.Target):
    return tvm.cuda(0) if target.kind.name == "cuda" else tvm.cpu(0)


def _random_fill(arr) -> None:
    import numpy as np

    shape = tuple(int(s) for s in arr.shape)
    dtype = str(arr.dtype)
    if dtype.startswith("float"):
        data = np.random.uniform(-1, 1, size=shape).astype(dtype)
    elif dtype == "bool":
        data = np.random.randint(0, 2, size=shape).astype(dtype)
    else:
        data = np.random.randint(0, 8, size=shape).astype(dtype)
    arr.copyfrom(data)


def build(mod, target):
    from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock

    mod = RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod)
    with target:  # CUDA codegen reads the current target when it compiles to a cubin
        return tvm.build(mod, target=target)


def measure(candidate: Candidate, target, timing: TimingConfig) -> MeasureResult:
    """Build and time one candidate; every failure comes back as data, never as an exception."""
    t0 = time.perf_counter()
    try:
        rt_mod = build(load_ir(candidate.mod), target)
    except Exception as err:  # noqa: BLE001 - a failed build is a result, not a crash
        return MeasureResult(
            candidate_id=candidate.candidate_id, error=f"build failed: {_clip(err)}", build_s=time.perf_counter() - t0
        )
    t1 = time.perf_counter()
    try:
        dev = device_for(target)
        args = alloc_argument_common(_random_fill_fn(), dev, candidate.args_info, 1)
        config = EvaluatorConfig(
            number=timing.number, repeat=timing.repeat, min_repeat_ms=timing.min_repeat_ms, enable_cpu_cache_flush=False
        )
        costs = run_evaluator_common(rt_mod, dev, config, args)
    except Exception as err:  # noqa: BLE001
        return MeasureResult(
            candidate_id=candidate.candidate_id,
            error=f"run failed: {_clip(err)}",
            build_s=t1 - t0,
            run_s=time.perf_counter() - t1,
        )
    return MeasureResult(
        candidate_id=candidate.candidate_id, run_secs=costs, build_s=t1 - t0, run_s=time.perf_counter() - t1
    )


def _random_fill_fn():
    f = tvm.get_global_func("tvm.contrib.random.random_fill_for_measure", allow_missing=True)
    return f if f is not None else _random_fill


def _clip(err: Exception, limit: int = 2000) -> str:
    text = f"{type(err).__name__}: {err}"
    return text if len(text) <= limit else text[: limit // 2] + " ... " + text[-limit // 2 :]


def warm_up(target) -> float:
    """Build and run a trivial kernel once so the first real candidate pays no start-up. On a GPU the
    kernel is bound to threads: an unbound one would run as host code on device memory and crash."""
    from tvm import te

    t0 = time.perf_counter()
    a = te.placeholder((64,), name="a")
    b = te.compute((64,), lambda i: a[i] + 1.0, name="b")
    mod = tvm.IRModule({"main": te.create_prim_func([a, b])})
    if target.kind.name == "cuda":
        sch = tvm.s_tir.Schedule(mod)
        (loop,) = sch.get_loops(sch.get_sblock("b"))
        bx, tx = sch.split(loop, [None, 32])
        sch.bind(bx, "blockIdx.x")
        sch.bind(tx, "threadIdx.x")
        mod = sch.mod
    rt_mod = build(mod, target)
    dev = device_for(target)
    args = [tvm.runtime.empty((64,), "float32", dev) for _ in range(2)]
    rt_mod.time_evaluator(rt_mod.entry_name, dev, number=1)(*args)
    return time.perf_counter() - t0


def gpu_target() -> tvm.target.Target:
    """The CUDA target of the GPU this process sees (CUDA_VISIBLE_DEVICES=<uuid>), from the device
    itself: arch, threads per block, shared memory per block, warp size (a bare {"kind": "cuda"}
    extracts tasks but cannot be tuned)."""
    import tvm.support.nvcc  # noqa: F401 - registers the CUDA compile callback (NVRTC or nvcc)

    dev = tvm.cuda(0)
    if not dev.exist:
        raise RuntimeError("no CUDA device visible to this lane (check CUDA_VISIBLE_DEVICES and the MPS daemon)")
    major, minor = dev.compute_version.split(".")
    return tvm.target.Target(
        {
            "kind": "cuda",
            "arch": f"sm_{major}{minor}",
            "max_threads_per_block": int(dev.max_threads_per_block),
            "max_shared_memory_per_block": int(dev.max_shared_memory_per_block),
            "thread_warp_size": int(dev.warp_size),
        }
    )


def cpu_target(cores: int) -> tvm.target.Target:
    return tvm.target.Target({"kind": "llvm", "num-cores": int(cores), "mcpu": tvm.target.codegen.llvm_get_system_cpu()})

"""The measurer's only TVM boundary: build a scheduled candidate and time it, in this warm process.

Builds run here, in the lane's long-lived process, and skip the import of tvm.s_tir.tensor_intrin that
stock LocalBuilder pays in every fresh pool (~40-70 s on a 2-core host): a candidate arrives already
scheduled (tensorized if at all), so building it needs no intrinsic registry."""
from __future__ import annotations

import time

import tvm
from tvm.s_tir.meta_schedule.runner.config import EvaluatorConfig
from tvm.s_tir.meta_schedule.runner.utils import alloc_argument_common, run_evaluator_common

from services.measurer.metaschedule.codec import dump_ir, load_ir
from shared.messages import MAX_ARTIFACT_BYTES, Artifact, Candidate, MeasureResult, TimingConfig


def target_from_json(text: str) -> tvm.target.Target:
    import json

    return tvm.target.Target(json.loads(text))


def device_for(target: tvm.target.Target):
    return tvm.cuda(0) if target.kind.name == "cuda" else tvm.cpu(0)


# Device objects of a CUDA context that a fault ended. They are never freed: freeing one calls into the dead
# context, whose error, thrown from a destructor, aborts the process before its lane can report the fault.
KEPT_AFTER_FAULT: list = []


def cuda_context_alive() -> bool:
    """After an unexplained run error: does this lane's CUDA context still work? (A sticky fault makes
    every later call fail.)"""
    probe = None
    try:
        dev = tvm.cuda(0)
        probe = tvm.runtime.empty((1,), "float32", dev)
        probe.copyfrom(__import__("numpy").zeros(1, "float32"))
        dev.sync()
        return True
    except Exception:  # noqa: BLE001
        KEPT_AFTER_FAULT.append(probe)
        return False


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

    if target.kind.name == "cuda":  # every CUDA build of the measurer compiles through cuda_compile
        from services.measurer.metaschedule import cuda_compile

        cuda_compile.install()
    mod = RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod)
    with target:  # CUDA codegen reads the current target when it compiles to a cubin
        return tvm.build(mod, target=target)


def measure(candidate: Candidate, target, timing: TimingConfig) -> MeasureResult:
    """Build (unless a builder did) and time one candidate; every failure comes back as data, never as an
    exception."""
    if candidate.artifact is not None:
        return measure_built(candidate, target, timing)
    t0, c0 = time.perf_counter(), cpu_now()
    try:
        rt_mod = build(load_ir(candidate.mod), target)
    except Exception as err:  # noqa: BLE001 - a failed build is a result, not a crash
        return MeasureResult(candidate_id=candidate.candidate_id, error=f"build failed: {_clip(err)}",
                             build_s=time.perf_counter() - t0, build_cpu_s=cpu_since(c0))
    cpu = cpu_since(c0)
    res = time_module(rt_mod, candidate, target, timing)
    res.build_s, res.build_cpu_s = time.perf_counter() - t0 - res.run_s, cpu
    return res


# ---- built by a builder worker, timed by the lane -----------------------------------------------------


def check_built(target, rt_mod) -> None:
    """A CUDA build must hold device code the lane can load without compiling. Where TVM's CUDA runtime
    is not loaded (no libcuda on the host), TVM 0.27 silently ships CUDA source instead (a fallback module
    that cannot run), and the lane would compile it: refuse that build."""
    if target.kind.name != "cuda":
        return
    for dev_mod in rt_mod.imports:
        if dev_mod.kind == "cuda" and not dev_mod.is_runnable():
            raise RuntimeError("this host cannot compile CUDA: TVM's CUDA runtime is not loaded (no libcuda), so "
                               "the build holds CUDA source, not a cubin; run CUDA builders on a host with the NVIDIA driver")


def build_artifact(candidate: Candidate, target, builder: str = "") -> tuple[Artifact | None, str | None, float]:
    """Build one candidate and package it as bytes for its lane: (artifact, error, seconds)."""
    import base64
    import hashlib
    import os
    import tempfile

    t0, c0 = time.perf_counter(), cpu_now()
    try:
        rt_mod = build(load_ir(candidate.mod), target)
        check_built(target, rt_mod)
        with tempfile.TemporaryDirectory(prefix="sharetune-build-") as tmp:
            path = os.path.join(tmp, "candidate.so")
            rt_mod.export_library(path)  # links with the host compiler: a child process, counted below
            with open(path, "rb") as f:
                data = f.read()
    except Exception as err:  # noqa: BLE001 - a failed build is a result, not a crash
        return None, f"build failed: {_clip(err)}", time.perf_counter() - t0
    secs = time.perf_counter() - t0
    return Artifact(data=base64.b64encode(data).decode(), size=len(data), sha256=hashlib.sha256(data).hexdigest(),
                    build_s=secs, build_cpu_s=cpu_since(c0), builder=builder), None, secs


def artifact_bytes(art: Artifact) -> bytes:
    """The artifact's library, checked: ValueError naming what is wrong with it."""
    import base64
    import binascii
    import hashlib

    if art.size > MAX_ARTIFACT_BYTES:
        raise ValueError(f"artifact of {art.size} bytes exceeds the limit of {MAX_ARTIFACT_BYTES}")
    if len(art.data) > (MAX_ARTIFACT_BYTES * 4) // 3 + 4:
        raise ValueError(f"artifact data of {len(art.data)} base64 characters exceeds the limit of {MAX_ARTIFACT_BYTES} bytes")
    try:
        data = base64.b64decode(art.data, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("artifact data is not valid base64") from None
    if len(data) != art.size:
        raise ValueError(f"artifact is {len(data)} bytes, its header says {art.size}")
    if hashlib.sha256(data).hexdigest() != art.sha256:
        raise ValueError("artifact checksum mismatch (corrupted in transit)")
    return data


def measure_built(candidate: Candidate, target, timing: TimingConfig) -> MeasureResult:
    """Time a candidate a builder built: check the artifact, load it, time it."""
    import os
    import tempfile

    art = candidate.artifact
    t0 = time.perf_counter()
    try:
        data = artifact_bytes(art)
    except ValueError as err:
        return MeasureResult(candidate_id=candidate.candidate_id, error=f"artifact refused: {err}", build_s=art.build_s)
    fd, path = tempfile.mkstemp(prefix="sharetune-built-", suffix=".so")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        rt_mod = tvm.runtime.load_module(path)
    except Exception as err:  # noqa: BLE001
        return MeasureResult(candidate_id=candidate.candidate_id, error=f"artifact refused: cannot load it: {_clip(err)}",
                             build_s=art.build_s)
    finally:
        os.remove(path)  # the loaded library stays mapped
    load_s = time.perf_counter() - t0
    res = time_module(rt_mod, candidate, target, timing)
    res.build_s, res.build_cpu_s = art.build_s + load_s, art.build_cpu_s
    return res


def family_target(family: str) -> tvm.target.Target:
    """A target of a build family, for a builder's warm-up (candidates come with their own target)."""
    kind, _, isa = family.partition(".")
    if kind == "cuda":
        return tvm.target.Target({"kind": "cuda", "arch": isa, "max_threads_per_block": 1024,
                                  "max_shared_memory_per_block": 49152, "thread_warp_size": 32})
    return tvm.target.Target({"kind": "llvm", **({"mcpu": isa} if isa != "generic" else {})})


def warm_up_builder(family: str) -> float:
    """Build and package a trivial kernel once, so the first candidate pays no start-up; raises when this
    host cannot build for the family (e.g. CUDA without libcuda)."""
    t0 = time.perf_counter()
    target = family_target(family)
    art, err, _ = build_artifact(Candidate(candidate_id="warm-up", mod=dump_ir(trivial_kernel(target)), args_info=[]),
                                 target)
    if art is None:
        raise RuntimeError(f"builder for {family} cannot build here: {err}")
    return time.perf_counter() - t0


def _random_fill_fn():
    """Floats: TVM's own fill (fast, on the device). Integers and booleans: small non-negative values,
    because TVM's fill spans the whole integer range, and an index tensor (an embedding's `take`, a
    gather) filled so reads far out of bounds: an illegal address on a GPU, which ends the lane's CUDA
    context, for every candidate of such a task."""
    f = tvm.get_global_func("tvm.contrib.random.random_fill_for_measure", allow_missing=True)
    if f is None:
        return _random_fill

    def fill(arr) -> None:
        (f if str(arr.dtype).startswith(("float", "bfloat")) else _random_fill)(arr)

    return fill


def _clip(err: Exception, limit: int = 2000) -> str:
    text = f"{type(err).__name__}: {err}"
    return text if len(text) <= limit else text[: limit // 2] + " ... " + text[-limit // 2 :]


def trivial_kernel(target) -> tvm.IRModule:
    """b = a + 1 over 64 floats; on a GPU bound to threads (an unbound kernel would run as host code
    on device memory and crash)."""
    from tvm import te

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
    return mod


def warm_up(target) -> float:
    """Build and run a trivial kernel once so the first real candidate pays no start-up."""
    t0 = time.perf_counter()
    rt_mod = build(trivial_kernel(target), target)
    dev = device_for(target)
    args = [tvm.runtime.empty((64,), "float32", dev) for _ in range(2)]
    rt_mod.time_evaluator(rt_mod.entry_name, dev, number=1)(*args)
    return time.perf_counter() - t0


def gpu_target() -> tvm.target.Target:
    """The CUDA target of the GPU this process sees (CUDA_VISIBLE_DEVICES=<uuid>), from the device
    itself: arch, threads per block, shared memory per block, warp size (a bare {"kind": "cuda"}
    extracts tasks but cannot be tuned)."""
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


# ---- a warm build pool beside the lane ---------------------------------------------------------------
# Measured on the H200 host: a CUDA conv candidate takes seconds to build (NVRTC) but micro- to
# milliseconds to time, so a lane that builds in its own process leaves the 16 cores idle and the GPU
# waiting. The pool's processes are spawned once (before the lane touches CUDA), stay warm for the
# lane's life, build and export each candidate to a shared library the lane loads and times.


def _pool_init() -> None:
    """A build process sees no GPU (set before anything initialises CUDA here), so it never becomes a
    client of its lane's MPS server: a GPU fault's recovery need not find it."""
    import os

    from services.measurer.lanes import builder_environment

    os.environ.update(builder_environment("", os.environ.get("SHARETUNE_BUILDER_HIDE_GPUS", "1") != "0"))
    import tvm  # noqa: F401


def cpu_since(c0: float) -> float:
    """CPU seconds of this process and of the children it waited for (the linker) since `c0`, a
    `cpu_now()` reading."""
    return round(cpu_now() - c0, 4)


def cpu_now() -> float:
    import os

    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def build_to_file(packed_mod: str, target_json: str, out_dir: str) -> tuple[str | None, str | None, float, float]:
    """In a pool process: build one candidate and export it; returns (path, error, seconds, CPU seconds)."""
    import os
    import uuid

    t0, c0 = time.perf_counter(), cpu_now()
    try:
        target = target_from_json(target_json)
        rt_mod = build(load_ir(packed_mod), target)
        path = os.path.join(out_dir, f"cand-{uuid.uuid4().hex}.so")
        rt_mod.export_library(path)
        return path, None, time.perf_counter() - t0, cpu_since(c0)
    except Exception as err:  # noqa: BLE001
        return None, f"build failed: {_clip(err)}", time.perf_counter() - t0, cpu_since(c0)


WARM_UP_TIMEOUT_S = 300.0  # spawn, import TVM and build a trivial kernel, on a loaded host


def _discard_built(fut) -> None:
    import os

    try:
        path = fut.result()[0]
    except Exception:  # noqa: BLE001 - a warm-up that failed: the real builds will say why
        return
    if path:
        os.remove(path)


class BuildPool:
    def __init__(self, workers: int):
        import multiprocessing
        import tempfile
        from concurrent.futures import ProcessPoolExecutor

        self.workers = workers
        self.out_dir = tempfile.mkdtemp(prefix="sharetune-builds-")
        self._ctx = multiprocessing.get_context("spawn")
        self._make = lambda: ProcessPoolExecutor(workers, mp_context=self._ctx, initializer=_pool_init)
        self.pool = self._make()
        self._warming: list = []

    def start_warm_up(self, target) -> None:
        """Build a trivial kernel in every worker, so each pays its start-up before real work, while the
        caller goes on: a lane restarted after a GPU fault measures prebuilt candidates at once, and a build
        sent meanwhile queues behind the warm-up."""
        from services.measurer.metaschedule.codec import dump_ir

        packed = dump_ir(trivial_kernel(target))
        self._warming = [self.pool.submit(build_to_file, packed, str(target), self.out_dir) for _ in range(self.workers)]
        for f in self._warming:
            f.add_done_callback(_discard_built)

    def finish_warm_up(self, timeout_s: float = WARM_UP_TIMEOUT_S) -> None:
        """Wait for the workers' warm-up, so no candidate's build timeout is spent on the pool's start-up."""
        from concurrent.futures import wait

        wait(self._warming, timeout=timeout_s)
        self._warming = []

    def measure_batch(self, candidates: list[Candidate], target, timing: TimingConfig):
        """Build all candidates in parallel; time each in this process as soon as it is built."""
        import os
        from concurrent.futures.process import BrokenProcessPool

        futs = [None if c.artifact is not None else self.pool.submit(build_to_file, c.mod, str(target), self.out_dir)
                for c in candidates]
        for cand, fut in zip(candidates, futs):
            if fut is None:  # a builder built it
                yield measure_built(cand, target, timing)
                continue
            try:
                path, error, build_s, cpu_s = fut.result(timeout=timing.timeout_s)
            except BrokenProcessPool:
                self.pool = self._make()  # a build that killed its process; the next batch gets a fresh pool
                path, error, build_s, cpu_s = None, "build failed: the build process died", 0.0, None
            except Exception as err:  # noqa: BLE001 - e.g. a build past its timeout
                path, error, build_s, cpu_s = None, f"build failed: {_clip(err)}", timing.timeout_s, None
            if error is not None:
                yield MeasureResult(candidate_id=cand.candidate_id, error=error, build_s=build_s, build_cpu_s=cpu_s)
                continue
            t1 = time.perf_counter()
            try:
                res = time_module(tvm.runtime.load_module(path), cand, target, timing)
            finally:
                os.remove(path)
            res.build_s, res.build_cpu_s = build_s + (time.perf_counter() - t1 - res.run_s), cpu_s
            yield res


def time_module(rt_mod, candidate: Candidate, target, timing: TimingConfig) -> MeasureResult:
    """Time a built candidate. With a bar (`candidate.full_below_s`) it is screened first: one launch
    (does it run at all), then about `timing.brief_ms` of kernel time in three repeats; only when their
    median is under the bar does it get the full timing. Without a bar: the full timing."""
    from shared.ranking import rank_secs

    t1 = time.perf_counter()
    args = None
    try:
        dev = device_for(target)
        args = alloc_argument_common(_random_fill_fn(), dev, candidate.args_info, 1)
        result = "full"
        if candidate.full_below_s is not None:
            costs = brief_costs(rt_mod, dev, args, timing.brief_ms, candidate.full_below_s)
            if rank_secs(costs) >= candidate.full_below_s:
                result = "brief"
        if result == "full":
            config = EvaluatorConfig(number=timing.number, repeat=timing.repeat, min_repeat_ms=timing.min_repeat_ms,
                                     enable_cpu_cache_flush=False)
            costs = run_evaluator_common(rt_mod, dev, config, args)
    except Exception as err:  # noqa: BLE001
        if target.kind.name == "cuda" and not cuda_context_alive():
            KEPT_AFTER_FAULT.extend([args, rt_mod])
        return MeasureResult(candidate_id=candidate.candidate_id, error=f"run failed: {_clip(err)}",
                             run_s=time.perf_counter() - t1)
    return MeasureResult(candidate_id=candidate.candidate_id, run_secs=costs, run_s=time.perf_counter() - t1,
                         timing=result)


BRIEF_REPEATS = 3
MAX_BRIEF_NUMBER = 10_000


def brief_costs(rt_mod, dev, args, brief_ms: float, bar_s: float) -> list[float]:
    """One launch (after the evaluator's own warm-up call); a launch at three times the bar or more is out as it
    stands (a slow kernel's one launch is estimate enough). Else BRIEF_REPEATS repeats of as many launches
    as fill about `brief_ms` of kernel time together. Per-launch seconds."""
    import math

    probe = run_evaluator_common(rt_mod, dev, EvaluatorConfig(number=1, repeat=1, min_repeat_ms=0,
                                                              enable_cpu_cache_flush=False), args)[0]
    if probe >= 3 * bar_s:
        return [probe]
    per_repeat = brief_ms / 1e3 / BRIEF_REPEATS
    number = max(1, min(MAX_BRIEF_NUMBER, math.ceil(per_repeat / max(probe, 1e-9))))
    return run_evaluator_common(rt_mod, dev, EvaluatorConfig(number=number, repeat=BRIEF_REPEATS, min_repeat_ms=0,
                                                             enable_cpu_cache_flush=False), args)

"""The measurer's only TVM boundary, end to end: build (unless a builder did) and time a candidate in this warm
process, or in a warm build pool beside it; warm-up. The steps live by concern beside it: targets, build,
artifact, timing."""
from __future__ import annotations

import time

import tvm

from services.measurer.metaschedule import artifact
from services.measurer.metaschedule.build import init_build_process, build, build_to_file, cpu_now, cpu_since, trivial_kernel
from services.measurer.metaschedule.candidate_codec import clip_error, load_ir
from services.measurer.metaschedule.cuda_compile import CompileOptions
from services.measurer.metaschedule.targets import device_for
from services.measurer.metaschedule.timing import time_module
from shared.messages import Candidate, ErrorKind, MeasureResult, TimingConfig


def measure(candidate: Candidate, target, timing: TimingConfig) -> MeasureResult:
    """Build (unless a builder did) and time one candidate; every failure comes back as data, never as an
    exception."""
    if candidate.artifact is not None:
        return measure_built(candidate, target, timing)
    t0, c0 = time.perf_counter(), cpu_now()
    try:
        rt_mod = build(load_ir(candidate.mod), target)
    except Exception as err:  # noqa: BLE001 - a failed build is a result, not a crash
        return MeasureResult(candidate_id=candidate.candidate_id, error=f"build failed: {clip_error(err)}",
                             error_kind=ErrorKind.BUILD, build_s=time.perf_counter() - t0, build_cpu_s=cpu_since(c0))
    cpu = cpu_since(c0)
    res = time_module(rt_mod, candidate, target, timing)
    res.build_s, res.build_cpu_s = time.perf_counter() - t0 - res.run_s, cpu
    return res


def measure_built(candidate: Candidate, target, timing: TimingConfig) -> MeasureResult:
    """Time a candidate a builder built: check the artifact, load it, time it."""
    art = candidate.artifact
    t0 = time.perf_counter()
    try:
        rt_mod = artifact.load(art)
    except ValueError as err:
        return MeasureResult(candidate_id=candidate.candidate_id, error=f"artifact refused: {err}",
                             error_kind=ErrorKind.BUILD, build_s=art.build_s)
    load_s = time.perf_counter() - t0
    res = time_module(rt_mod, candidate, target, timing)
    res.build_s, res.build_cpu_s = art.build_s + load_s, art.build_cpu_s
    return res


def warm_up(target) -> float:
    """Build and run a trivial kernel once so the first real candidate pays no start-up."""
    t0 = time.perf_counter()
    rt_mod = build(trivial_kernel(target), target)
    dev = device_for(target)
    args = [tvm.runtime.empty((64,), "float32", dev) for _ in range(2)]
    rt_mod.time_evaluator(rt_mod.entry_name, dev, number=1)(*args)
    return time.perf_counter() - t0


# ---- a warm build pool beside the lane ---------------------------------------------------------------
# Measured on the H200 host: a CUDA conv candidate takes seconds to build (NVRTC) but micro- to
# milliseconds to time, so a lane that builds in its own process leaves the 16 cores idle and the GPU
# waiting. The pool's processes are spawned once (before the lane touches CUDA), stay warm for the
# lane's life, build and export each candidate to a shared library the lane loads and times.

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
    def __init__(self, workers: int, hide_gpus: bool = True, compile_options: CompileOptions = CompileOptions(),
                 batch_priority: str = "idle"):
        """`workers` build processes, each with GPUs hidden unless told otherwise, compiling CUDA in that mode,
        at that CPU priority."""
        import multiprocessing
        import tempfile
        from concurrent.futures import ProcessPoolExecutor

        self.workers = workers
        self.out_dir = tempfile.mkdtemp(prefix="sharetune-builds-")
        self._ctx = multiprocessing.get_context("spawn")
        self._make = lambda: ProcessPoolExecutor(workers, mp_context=self._ctx, initializer=init_build_process,
                                                 initargs=(hide_gpus, compile_options, batch_priority))
        self.pool = self._make()
        self._warming: list = []

    def start_warm_up(self, target) -> None:
        """Build a trivial kernel in every worker, so each pays its start-up before real work, while the
        caller goes on: a lane restarted after a GPU fault measures prebuilt candidates at once, and a build
        sent meanwhile queues behind the warm-up."""
        from services.measurer.metaschedule.candidate_codec import dump_ir

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
                path, error, build_s, cpu_s = None, f"build failed: {clip_error(err)}", timing.timeout_s, None
            if error is not None:
                yield MeasureResult(candidate_id=cand.candidate_id, error=error, error_kind=ErrorKind.BUILD,
                                    build_s=build_s, build_cpu_s=cpu_s)
                continue
            t1 = time.perf_counter()
            try:
                res = time_module(tvm.runtime.load_module(path), cand, target, timing)
            finally:
                os.remove(path)
            res.build_s, res.build_cpu_s = build_s + (time.perf_counter() - t1 - res.run_s), cpu_s
            yield res

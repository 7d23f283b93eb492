"""Building a scheduled candidate: in this warm process, in a build pool's process, or as an artifact a builder
ships to its lane. Builds skip the import of tvm.s_tir.tensor_intrin that stock LocalBuilder pays in every
fresh pool (~40-70 s on a 2-core host): a candidate arrives already scheduled (tensorized if at all), so
building it needs no intrinsic registry. Failures come back as data, never as exceptions."""
from __future__ import annotations

import time

import tvm

from services.measurer.metaschedule.candidate_codec import clip_error, dump_ir, load_ir
from services.measurer.metaschedule.cuda_compile import CompileOptions
from services.measurer.metaschedule.targets import family_target, target_from_json
from shared.messages import Artifact, Candidate


def build(mod, target):
    from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock

    config, instruments = {}, []
    if target.kind.name == "cuda":  # every CUDA build of the measurer compiles through cuda_compile
        from services.measurer.metaschedule import cuda_compile
        from services.measurer.metaschedule.gpu_limits import CheckGPULimits

        cuda_compile.install()
        config, instruments = cuda_compile.lowering_config(), [CheckGPULimits(target)]
    mod = RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod)
    # CUDA codegen reads the current target when it compiles to a cubin
    with target, _pass_context(config, instruments):
        return tvm.build(mod, target=target)


def _pass_context(config: dict, instruments: list = ()) -> tvm.transform.PassContext:
    """The current PassContext with `config` and `instruments` added (a caller's instruments and passes kept)."""
    cur = tvm.transform.PassContext.current()
    return tvm.transform.PassContext(opt_level=cur.opt_level, required_pass=list(cur.required_pass),
                                     disabled_pass=list(cur.disabled_pass), instruments=[*cur.instruments, *instruments],
                                     config={**dict(cur.config), **config})


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
        return None, f"build failed: {clip_error(err)}", time.perf_counter() - t0
    secs = time.perf_counter() - t0
    return Artifact(data=base64.b64encode(data).decode(), size=len(data), sha256=hashlib.sha256(data).hexdigest(),
                    build_s=secs, build_cpu_s=cpu_since(c0), builder=builder), None, secs


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


def init_build_process(hide_gpus: bool = True, compile_options: CompileOptions = CompileOptions(),
                       batch_priority: str = "idle") -> None:
    """A build process of a lane's pool, as its lane's settings say (LaneSettings.builder_hide_gpus,
    cuda_compile, batch_priority): with GPUs hidden (set before anything initialises CUDA here) it never becomes a
    client of its lane's MPS server, so a GPU fault's recovery need not find it; it gives way to its lane's timing."""
    import os

    from services.measurer.lane_pool import builder_environment
    from services.measurer.metaschedule import cuda_compile
    from shared.cpu_priority import yield_cpu

    yield_cpu(batch_priority)
    os.environ.update(builder_environment("", hide_gpus))
    cuda_compile.configure(compile_options)
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
        return None, f"build failed: {clip_error(err)}", time.perf_counter() - t0, cpu_since(c0)

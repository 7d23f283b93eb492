"""Targets and devices of the measurer: from a candidate's JSON, a build family's name, or the device this
process sees (a lane's GPU at its MPS share, its cores)."""
from __future__ import annotations

import tvm


def target_from_json(text: str) -> tvm.target.Target:
    import json

    return tvm.target.Target(json.loads(text))


def device_for(target: tvm.target.Target):
    return tvm.cuda(0) if target.kind.name == "cuda" else tvm.cpu(0)


def family_target(family: str) -> tvm.target.Target:
    """A target of a build family, for a builder's warm-up (candidates come with their own target)."""
    kind, _, isa = family.partition(".")
    if kind == "cuda":
        return tvm.target.Target({"kind": "cuda", "arch": isa, "max_threads_per_block": 1024,
                                  "max_shared_memory_per_block": 49152, "thread_warp_size": 32})
    return tvm.target.Target({"kind": "llvm", **({"mcpu": isa} if isa != "generic" else {})})


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

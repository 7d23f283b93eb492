"""Register only the tensor intrinsics a target can use.

TuneContext imports the package tvm.s_tir.tensor_intrin, whose __init__ parses the intrinsics of every
backend (arm, x86, rocm, hexagon, riscv, cuda): 70 s on a 2-core host, 174 s under load. An llvm/x86
tuner needs only x86 (0.7 s), a CUDA tuner only cuda (~31 s). We put the package in sys.modules with
just those submodules loaded, so TuneContext's import finds it and costs nothing."""
from __future__ import annotations

import importlib
import os
import platform
import sys
import types

PACKAGE = "tvm.s_tir.tensor_intrin"


def submodules_for(target_kind: str) -> list[str]:
    if target_kind == "cuda":
        return ["cuda"]
    return ["arm_cpu"] if platform.machine().lower() in ("aarch64", "arm64") else ["x86"]


def load_tensor_intrinsics(target_kind: str) -> list[str]:
    """Load the intrinsics for `target_kind`; returns the submodules loaded now. Idempotent."""
    import tvm.s_tir

    pkg = sys.modules.get(PACKAGE)
    if pkg is None:
        pkg = types.ModuleType(PACKAGE)
        pkg.__path__ = [os.path.join(os.path.dirname(tvm.s_tir.__file__), "tensor_intrin")]
        pkg.__package__ = PACKAGE
        sys.modules[PACKAGE] = pkg
    loaded = []
    for name in submodules_for(target_kind):
        if f"{PACKAGE}.{name}" not in sys.modules:
            importlib.import_module(f"{PACKAGE}.{name}")
            loaded.append(name)
    return loaded

"""This host's CPU as TVM names it, without loading MetaSchedule (a builder reads it before it execs)."""
from __future__ import annotations


def system_cpu() -> str:
    import tvm

    return tvm.target.codegen.llvm_get_system_cpu()

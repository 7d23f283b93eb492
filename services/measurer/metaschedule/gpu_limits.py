"""A CUDA build checks its own lowering against the GPU's limits, as MetaSchedule's VerifyGPUCode checks a schedule.

VerifyGPUCode lowers a schedule through ~20 of TVM's passes and then runs `verify_gpu_code` (shared memory and
threads per block from the target, at most 8 virtual threads, vectors of at most 16 bytes): 8-22 ms of CPU a
candidate, and on the tuner's proposals, already within the limits sampling.TileLimits and validity.GPUPrecheck
read off the design space, it almost never says no (1 of 830 cold draws of the panel's tasks, none of their
evolutionary proposals: docs/time_to_quality.md). A build lowers the candidate through the same passes anyway:
here the same analysis, with the same limits, runs on the build's module where it is the postprocessor's
(after the shared-memory allocations are merged, before host and device are split), and a module over a limit
fails its build with an error that names it. A tuner whose builders check (TunerSettings.verify_in_build) need
not lower its proposals a second time."""
from __future__ import annotations

import tvm
from tvm import tirx

# the pass after which the build's module is what VerifyGPUCode's own lowering verifies
AFTER_PASS = "s_tir.MergeSharedMemoryAllocations"


class GPULimitsExceeded(RuntimeError):
    """A candidate's kernel breaks the target's limits: it is not compiled."""


def constraints(target: tvm.target.Target) -> dict[str, int] | None:
    """VerifyGPUCode's limits for `target`; None where the target does not say them (VerifyGPUCode itself refuses
    such a target: there is nothing to agree with)."""
    shared, threads = (target.attrs.get(k) for k in ("max_shared_memory_per_block", "max_threads_per_block"))
    if shared is None or threads is None:
        return None
    return {"max_shared_memory_per_block": int(shared), "max_threads_per_block": int(threads),
            "max_vthread": 8, "max_vector_bytes": 16}


@tvm.instrument.pass_instrument
class CheckGPULimits:
    """A pass instrument that verifies every PrimFunc of the module after AFTER_PASS."""

    def __init__(self, target: tvm.target.Target):
        self.limits = constraints(target)
        self.target = str(target.attrs.get("arch", target.kind.name))

    def run_after_pass(self, mod, info) -> None:
        if info.name != AFTER_PASS or self.limits is None:
            return
        from tvm.s_tir.analysis import verify_gpu_code

        for gv, func in mod.functions.items():
            if isinstance(func, tirx.PrimFunc) and not verify_gpu_code(func, self.limits):
                raise GPULimitsExceeded(
                    f"{gv.name_hint} breaks the GPU's limits on {self.target} (TVM's VerifyGPUCode: at most "
                    f"{self.limits['max_shared_memory_per_block']} bytes of shared memory and "
                    f"{self.limits['max_threads_per_block']} threads a block, 8 virtual threads, 16-byte vectors)")

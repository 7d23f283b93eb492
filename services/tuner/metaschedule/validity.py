"""A CUDA schedule's limits checked from its loop nest, before MetaSchedule's postprocessors lower it.

Of a cold CUDA round's random samples ~97 % fail `VerifyGPUCode`, the last postprocessor, which rewrites the
cooperative fetches and lowers the whole function through ~15 passes before it rejects it (~11 of a sample's
~16 ms on a ResNet conv, on the host's CPU; the replay of the trace itself is the other ~5). `LimitsCheck` runs
first and rejects, from the replayed schedule alone, the samples whose sampled tile factors already break a
limit that VerifyGPUCode enforces:

- threads per block: the product of the threadIdx-bound loop extents of one kernel (each axis counted once)
  above the target's max_threads_per_block;
- shared memory per block: each shared-scope block's footprint (the loops compute_at made for it alone, times
  the element size), summed over a kernel, above max_shared_memory_per_block.

Each figure is a lower bound of what VerifyGPUCode measures after lowering (a footprint under a predicate is
not counted; a loop nest with anything but plain loops and blocks is let through), so the check only rejects
what TVM would reject: the schedules it passes are still checked by TVM's own postprocessors.
tests/test_validity.py holds it to that on sampled tasks."""
from __future__ import annotations

import math

from tvm import tirx
from tvm.ir.utils import derived_object
from tvm.s_tir import SBlockRealize
from tvm.s_tir.meta_schedule.postproc import Postproc, PyPostproc


class _Kernel:
    def __init__(self):
        self.threads: dict[str, int] = {}
        self.shared_bytes = 0


def _const(expr) -> int | None:
    return int(expr) if isinstance(expr, tirx.IntImm) else None


def _blocks_in(stmt) -> int:
    """How many blocks the statement holds (compute_at's loops hold exactly one)."""
    if isinstance(stmt, SBlockRealize):
        return 1 + _blocks_in(stmt.block.body)
    if isinstance(stmt, tirx.For):
        return _blocks_in(stmt.body)
    if isinstance(stmt, tirx.SeqStmt):
        return sum(_blocks_in(s) for s in stmt.seq)
    return 0


class _Walk:
    """One pass over the function body: each kernel's threads and shared bytes. (A vthread extent above
    MetaSchedule's 8 is no certain failure: VerifyGPUCode accepted vthread 16 on a transformer matmul.)"""

    def __init__(self):
        self.kernels: list[_Kernel] = []
        self.opaque = False  # a statement kind this walk does not model: nothing is concluded

    def visit(self, stmt, kernel: _Kernel | None, own_loops: list[int]) -> None:
        if isinstance(stmt, tirx.SeqStmt):
            for s in stmt.seq:
                self.visit(s, kernel, [])
        elif isinstance(stmt, tirx.For):
            kernel = self._loop(stmt, kernel)
            ext = _const(stmt.extent)
            # a loop whose body is this one block alone belongs to that block (compute_at made it)
            alone = _blocks_in(stmt.body) == 1
            loops = (own_loops + [ext if ext is not None else 0]) if alone and stmt.thread_binding is None else []
            self.visit(stmt.body, kernel, loops)
        elif isinstance(stmt, SBlockRealize):
            block = stmt.block
            if kernel is not None and _const(stmt.predicate) == 1:
                for buf in [w.source for w in block.writes]:
                    if buf.scope() == "shared" and own_loops and all(own_loops):
                        kernel.shared_bytes += math.prod(own_loops) * _bytes(buf.dtype)
            self.visit(block.body, kernel, [])
        elif isinstance(stmt, (tirx.BufferStore, tirx.Evaluate)):
            return
        else:
            self.opaque = True

    def _loop(self, loop, kernel: _Kernel | None) -> _Kernel | None:
        binding = loop.thread_binding
        if binding is None:
            return kernel
        tag, ext = binding.thread_tag, _const(loop.extent)
        if tag.startswith("blockIdx") and kernel is None:
            kernel = _Kernel()
            self.kernels.append(kernel)
        if kernel is None or ext is None:
            return kernel
        if tag.startswith("threadIdx"):
            kernel.threads[tag] = max(kernel.threads.get(tag, 1), ext)
        return kernel


def _bytes(dtype) -> int:
    d = tirx.DataType(str(dtype)) if hasattr(tirx, "DataType") else None
    if d is not None:
        return max(1, d.bits * d.lanes // 8)
    s = str(dtype)
    bits = int("".join(c for c in s if c.isdigit()) or 32)
    return max(1, bits // 8)


def violations(func, max_threads: int, max_shared_bytes: int) -> list[str]:
    """What of the limits the function's loop nest certainly breaks (empty: nothing certain)."""
    walk = _Walk()
    walk.visit(func.body, None, [])
    if walk.opaque:
        return []
    out = []
    for k in walk.kernels:
        threads = math.prod(k.threads.values())
        if threads > max_threads:
            out.append(f"{threads} threads per block > {max_threads}")
        if k.shared_bytes > max_shared_bytes:
            out.append(f"{k.shared_bytes} B shared memory per block > {max_shared_bytes}")
    return out


@derived_object
class LimitsCheck(PyPostproc):
    """The first CUDA postprocessor: a sample whose loop nest breaks a limit is rejected before lowering."""

    rejected = 0  # samples rejected in this process, every instance (TVM keeps its own wrapper of each clone)

    def __init__(self):
        super().__init__()
        self.max_threads = 1024
        self.max_shared = 49152

    def _initialize_with_tune_context(self, context) -> None:
        attrs = context.target.attrs
        self.max_threads = int(attrs.get("max_threads_per_block", self.max_threads))
        self.max_shared = int(attrs.get("max_shared_memory_per_block", self.max_shared))

    def apply(self, sch) -> bool:
        for gv, func in sch.mod.functions.items():
            if isinstance(func, tirx.PrimFunc) and violations(func, self.max_threads, self.max_shared):
                LimitsCheck.rejected += 1
                return False
        return True

    def clone(self) -> Postproc:
        twin = LimitsCheck()
        twin.max_threads, twin.max_shared = self.max_threads, self.max_shared
        return twin

    def __str__(self) -> str:
        return "LimitsCheck"


def cuda_postprocs() -> list:
    """TVM's default CUDA postprocessors, in their order, with LimitsCheck first."""
    return [LimitsCheck()] + list(Postproc.create("cuda"))

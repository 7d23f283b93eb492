"""A cheap GPU precheck that runs first among a CUDA task's postprocessors.

Most random CUDA samples fail TVM's last postprocessor, VerifyGPUCode, which lowers each one through
~20 TIR passes before rejecting it. Measured on ResNet-18's convs (200 samples each): 60-90 % exceed the
shared memory per block, ~70 % break the thread-extent bounds MultiLevelTiling annotates (many both),
~1 % the threads per block, 4-12 % crash in InjectSoftwarePipeline (not predicted here). This check reads
the replayed schedule's loop nest alone and rejects a sample only when VerifyGPUCode certainly would:

- the thread-extent bounds (meta_schedule.thread_extent_{low,high}_inclusive) a block carries, against
  the threadIdx extents around it: the very check VerifyGPUCode runs first, before lowering;
- threads per block: the product over threadIdx axes of the smallest extent bound to each, per kernel;
- shared memory per block: per kernel, the sum over shared buffers of a lower bound on the bytes each
  needs once compacted (the elements one writer block stores under the loops it shares with no reader).

Every estimate is a lower bound of what the lowered kernel uses, so what passes here is still checked by
TVM; tests/test_validity.py asserts that on sampled schedules.
"""
from __future__ import annotations

import math

import tvm
from tvm import tirx
from tvm.ir.utils import derived_object
from tvm.s_tir import SBlockRealize
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.meta_schedule.postproc import PyPostproc
from tvm.sym import detect_iter_map

_LOW, _HIGH = "meta_schedule.thread_extent_low_inclusive", "meta_schedule.thread_extent_high_inclusive"
_THREADS = ("threadIdx.x", "threadIdx.y", "threadIdx.z")


def rule_kind(target: tvm.target.Target) -> str:
    """MetaSchedule's rule kind for a CUDA target (as GetRuleKindFromTarget): tensor-core rules from sm_75."""
    arch = str(target.attrs.get("arch", ""))
    return "cuda-tensorcore" if arch.startswith("sm_") and arch[3:].isdigit() and int(arch[3:]) >= 75 else "cuda"


def _int(e) -> int | None:
    return int(e.value) if isinstance(e, tirx.IntImm) else None


class _Kernel:
    def __init__(self):
        self.min_threads: dict[str, int] = {}
        self.blocks: list[tuple[SBlockRealize, tuple]] = []  # (block, enclosing loops of this kernel)


def _walk(stmt, loops: tuple, threads: dict, kernels: list, warp: int, fail: list) -> None:
    """Collect each kernel's thread extents and blocks, and check the thread-extent annotations."""
    if isinstance(stmt, tirx.For):
        tag = stmt.thread_binding.thread_tag if stmt.kind == tirx.ForKind.THREAD_BINDING else None
        if tag is not None and not loops:
            kernels.append(_Kernel())  # the outermost thread-bound loop opens a kernel
        inner = loops + (stmt,) if (loops or tag is not None) else loops
        if tag in _THREADS:
            ext = _int(stmt.extent)
            if ext is None:
                return  # dynamic extents: left to TVM
            k = kernels[-1]
            k.min_threads[tag] = min(ext, k.min_threads.get(tag, ext))
            threads = {**threads, tag: ext}
        _walk(stmt.body, inner, threads, kernels, warp, fail)
    elif isinstance(stmt, SBlockRealize):
        block = stmt.block
        if loops:
            kernels[-1].blocks.append((stmt, loops))
        ann = block.annotations
        if "warp_execution" in ann:
            threads = {**threads, "threadIdx.x": warp}
        if _LOW in ann and _HIGH in ann:
            n = math.prod(threads.get(t, 1) for t in _THREADS)
            if not int(ann[_LOW]) <= n <= int(ann[_HIGH]):
                fail.append(f"thread extent {n} outside [{int(ann[_LOW])}, {int(ann[_HIGH])}]")
        _walk(block.body, loops, threads, kernels, warp, fail)
    elif isinstance(stmt, tirx.SeqStmt):
        for s in stmt.seq:
            _walk(s, loops, threads, kernels, warp, fail)
    elif isinstance(stmt, tirx.IfThenElse):
        _walk(stmt.then_case, loops, threads, kernels, warp, fail)
        if stmt.else_case is not None:
            _walk(stmt.else_case, loops, threads, kernels, warp, fail)
    elif hasattr(stmt, "body"):  # AttrStmt, LetStmt, DeclBuffer, ...
        _walk(stmt.body, loops, threads, kernels, warp, fail)


def _distinct_elements(br: SBlockRealize, buf, own: tuple) -> int:
    """How many distinct elements of `buf` the block stores over the loops `own`: their extents' product
    when the block stores to its own iterators one to one and those loops map onto the iterators
    bijectively (as compute_at and fuse leave a cache stage); else 0, counting nothing."""
    block = br.block
    if not (isinstance(br.predicate, tirx.IntImm) and int(br.predicate.value) == 1):
        return 0
    dom = {}
    for loop in own:
        if _int(loop.extent) is None:
            return 0
        dom[loop.loop_var] = tvm.ir.Range.from_min_extent(loop.min, loop.extent)
    if not dom:
        return 1
    ivars = [iv.var for iv in block.iter_vars]
    for w in block.writes:
        if w.source.same_as(buf):
            mins = [r.min for r in w.region]
            if any(_int(r.extent) != 1 for r in w.region) or not all(isinstance(m, tirx.Var) for m in mins) \
                    or len({m.name for m in mins}) != len(mins) or not all(any(m.same_as(v) for v in ivars) for m in mins):
                return 0
    if detect_iter_map(list(br.iter_values), dom, True, "bijective").errors:
        return 0
    return math.prod(_int(loop.extent) for loop in own)


def _shared_bytes(kernel: _Kernel) -> int:
    """A lower bound on a kernel's shared memory: per shared buffer, the elements one writer block stores
    under the loops it shares with none of the buffer's readers. Those loops lie under the buffer's
    allocation point (the accesses' common ancestor), so its compacted size holds at least that many."""
    readers: dict = {}
    for br, loops in kernel.blocks:
        for r in br.block.reads:
            readers.setdefault(r.source.name, []).append(loops)  # a block's buffer names are unique
    need: dict = {}
    for br, loops in kernel.blocks:
        for w in br.block.writes:
            buf = w.source
            if buf.scope() not in ("shared", "shared.dyn") or buf.name not in readers:
                continue
            common = 0
            for other in readers[buf.name]:
                n = 0
                while n < min(len(loops), len(other)) and loops[n].same_as(other[n]):
                    n += 1
                common = max(common, n)
            dtype = tvm.DataType(buf.dtype)
            elems = _distinct_elements(br, buf, loops[common:])
            need[buf.name] = max(need.get(buf.name, 0), elems * dtype.bits * dtype.lanes // 8)
    return sum(need.values())


def violation(mod: tvm.IRModule, max_threads: int, max_shared: int, warp: int) -> str | None:
    """Why the sampled module certainly fails VerifyGPUCode, or None when it may pass."""
    for func in mod.functions.values():
        if not isinstance(func, tirx.PrimFunc):
            continue
        kernels: list[_Kernel] = []
        fail: list[str] = []
        _walk(func.body, (), {}, kernels, warp, fail)
        if fail:
            return fail[0]
        for k in kernels:
            threads = math.prod(k.min_threads.values())
            if threads > max_threads:
                return f"{threads} threads per block > {max_threads}"
            shared = _shared_bytes(k)
            if shared > max_shared:
                return f"{shared} B of shared memory per block > {max_shared}"
    return None


@derived_object
class GPUPrecheck(PyPostproc):
    """Rejects, before any lowering, samples that VerifyGPUCode would reject (see the module's doc)."""

    def __init__(self):
        super().__init__()
        self.limits = None

    def _initialize_with_tune_context(self, context) -> None:
        t = context.target
        self.limits = (int(t.attrs["max_threads_per_block"]), int(t.attrs["max_shared_memory_per_block"]),
                       int(t.attrs["thread_warp_size"]))

    def apply(self, sch) -> bool:
        try:
            return violation(sch.mod, *self.limits) is None
        except Exception:  # noqa: BLE001 -- a TIR shape this walk does not know: TVM's checks decide
            return True

    def clone(self):
        other = GPUPrecheck()
        other.limits = self.limits
        return other


def cuda_postprocs(target: tvm.target.Target) -> list:
    """The precheck, then TVM's default postprocessors for the target, in their order."""
    return [GPUPrecheck(), *ms.postproc.Postproc.create(rule_kind(target))]

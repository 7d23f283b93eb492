"""Valid CUDA first rounds: tile decisions drawn within the target's limits before any replay.

MetaSchedule's replay-trace strategy replays a design space's whole trace with random decisions, then runs the
postprocessors; on CUDA convolutions 92-99 % of those samples break the thread-extent bounds that
MultiLevelTiling annotates on the tiled block ([warp size, max threads per block]) or the shared memory per
block, and each costs a full replay (10-30 ms of CPU) before validity.GPUPrecheck rejects it. Both depend on the
tile decisions alone: the block's threadIdx loop is the fuse of one split level of its tiled loops, so its
extent is a product of sampled factors, and a shared cache read's footprint is a box whose sides are sums of
such products. `TileLimits` reads that dataflow off the design space's trace once; `ValidReplay` draws perfect
tilings, keeps only those within the limits (arithmetic, microseconds) and replays just those, then runs the
context's postprocessors (GPUPrecheck, then TVM's, VerifyGPUCode last) as replay-trace does. A decision vector
is rejected here only when it breaks a bound VerifyGPUCode checks, by a lower-bound estimate, so what passes
is what replay-trace would accept; tests/test_validity.py asserts that on sampled tasks.
"""
from __future__ import annotations

import functools
import math
import random
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import tvm
import tvm_ffi
from tvm.ir.utils import derived_object
from tvm.s_tir import SBlockRealize, Schedule, Trace
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.meta_schedule.search_strategy import PySearchStrategy
from tvm.sym import detect_linear_equation

_LOW, _HIGH = "meta_schedule.thread_extent_low_inclusive", "meta_schedule.thread_extent_high_inclusive"
# draws of decision vectors per candidate before a slot is given up (replay-trace gives up after 100 replays;
# a rejected draw here costs microseconds)
MAX_DRAWS = 2000
# decision vectors a tile draw makes at once
DRAW_BATCH = 128
# replays per candidate slot before it is given up, as replay-trace's max_fail_count
MAX_REPLAYS = 100


@dataclass
class _Tile:
    inst: object  # the SamplePerfectTile instruction
    extent: int
    n: int
    max_innermost: int


# one shared buffer's bytes as a function of the tiling: (bytes an element, [(the dimension's size, the access's
# own extent, [(coefficient, [(tile index, position), ...], divisor), ...]), ...]): _index_parts says why
_SharedTerm = tuple[int, list[tuple[int, int, list[tuple[int, list[tuple[int, int]], int]]]]]


@dataclass
class TileLimits:
    """What a design space's tile decisions must satisfy, read off its trace once:
    - `bounds`: per annotated block, [warp, max threads] and the factors whose product is its threads;
    - `shared`: per tiled block, its shared-memory cache reads' footprints (`_shared_terms`) against
      `max_shared`: a lower bound of what the lowered kernel allocates, since each is the box its consumer
      reads under the cache's compute-at loop and the block's threads, clipped to the buffer, times the copies
      its software pipeline keeps (`_versions`);
    - `pipelined`: the factors of each software-pipelined loop (the fused outer reduction loops the caches are
      computed at), which must make an extent above 1: at 1 the loop is gone, and InjectSoftwarePipeline fails
      on every such sample (its stages no longer match the body)."""

    tiles: list[_Tile] = field(default_factory=list)
    bounds: list[tuple[int, int, list[tuple[int, int]]]] = field(default_factory=list)
    shared: list[list[_SharedTerm]] = field(default_factory=list)
    max_shared: int = 0
    pipelined: list[list[tuple[int, int]]] = field(default_factory=list)  # factors of each software-pipelined loop

    @classmethod
    def of(cls, trace, mod=None, max_shared: int = 0) -> "TileLimits":
        out = cls(max_shared=max_shared)
        flow = _Dataflow()
        for inst in trace.insts:
            flow.step(inst, trace, out)
        for block, b in flow.ann.items():
            factors = flow.threads.get(block)
            if _LOW in b and _HIGH in b and factors:
                out.bounds.append((b[_LOW], b[_HIGH], factors))
        out.pipelined = flow.pipelined_loops()
        if mod is not None and max_shared > 0 and flow.cache_at:
            try:
                out.shared = _shared_terms(mod, trace, flow, out)
            except Exception:  # noqa: BLE001 -- a trace shape this reading does not know: left to the postprocs
                out.shared = []
        return out

    def draw(self, rng: random.Random) -> tuple[list[list[int]] | None, int]:
        """(perfect tilings of every tile instruction within the limits, or None after MAX_DRAWS tries; the
        tries). Drawn as arrays, DRAW_BATCH at a time and twice as many each time after (a depthwise conv's space
        needs ~300 draws for one within its limits: one by one in Python they cost as much CPU as the replays);
        the first that fits is taken, so the tilings come as they would one by one."""
        if not self.tiles:
            return [], 1  # nothing to draw: the space's one tiling
        gen = np.random.default_rng(rng.getrandbits(64))
        tries, batch = 0, DRAW_BATCH
        while tries < MAX_DRAWS:
            k = min(batch, MAX_DRAWS - tries)
            batch *= 2  # a space whose draws rarely fit is drawn in larger batches
            tilings = [_perfect_tiles(gen, t, k) for t in self.tiles]
            hits = np.flatnonzero(self.fitting(tilings))
            if hits.size:
                j = int(hits[0])
                return [tiles[j].tolist() for tiles in tilings], tries + j + 1
            tries += k
        return None, MAX_DRAWS

    def fitting(self, tilings: list[np.ndarray]) -> np.ndarray:
        """Which draws of a batch are within the limits (the thread bounds, the shared memory, the pipelined loops'
        extents): tilings[i] holds tile i's factors, one row a draw; a bool a draw."""
        ok = np.ones(len(tilings[0]) if tilings else 0, dtype=bool)
        for low, high, factors in self.bounds:
            threads = _product(tilings, factors)
            ok &= (threads >= low) & (threads <= high)
        for terms in self.shared:
            ok &= sum(_bytes_batch(term, tilings) for term in terms) <= self.max_shared
        for factors in self.pipelined:
            ok &= _product(tilings, factors) >= 2
        return ok

    def fits(self, tiling: list[list[int]]) -> bool:
        """Whether one tiling (a list of factors per tile instruction) is within the limits (`fitting`'s rules)."""
        return bool(self.fitting([np.array([factors], dtype=np.int64) for factors in tiling])[0]) if tiling else True


class SpaceDraws:
    """Tile draws over a task's design spaces: a space picked at random, a tiling within its limits drawn. A space
    whose draws have found none (e.g. a software-pipelined space of a depthwise 3x3 conv, whose outer reduction
    loop cannot reach 2 within the shared memory) is left out of later draws once MAX_DRAWS tries come back
    empty, so its slots go to the spaces that have valid schedules; a space that has given one stays in."""

    def __init__(self, limits: list[TileLimits]):
        self.limits = limits
        self.dry: set[int] = set()
        self.fertile: set[int] = set()
        self.drawn = 0  # decision vectors drawn in all

    def draw(self, rng: random.Random) -> tuple[int, list[list[int]]] | None:
        """(a space's index, a tiling within its limits), or None when no space gave one (a few spaces' tries)."""
        for _ in range(2 * len(self.limits)):
            open_ = [i for i in range(len(self.limits)) if i not in self.dry]
            if not open_:
                break
            s = rng.choice(open_)
            tiling, tries = self.limits[s].draw(rng)
            self.drawn += tries
            if tiling is not None:
                self.fertile.add(s)
                return s, tiling
            if s not in self.fertile:
                self.dry.add(s)
        return None


def _product(tilings: list[np.ndarray], factors) -> np.ndarray:
    out = np.ones(len(tilings[0]), dtype=np.int64)
    for i, p in factors:
        out = out * tilings[i][:, p]
    return out


def _bytes_batch(term: _SharedTerm, tilings: list[np.ndarray]) -> np.ndarray:
    """A shared buffer's bytes for each draw of a batch: per dimension, its own extent plus each index term's
    span (`_index_parts`), clipped to the dimension's size."""
    size, dims = term
    out = np.full(len(tilings[0]), size, dtype=np.int64)
    for clip, own, parts in dims:
        span = np.full(len(tilings[0]), own, dtype=np.int64)
        for c, fs, k in parts:
            span = span + c * ((_product(tilings, fs) - 1) // k)
        out = out * np.minimum(clip, span)
    return out


def _perfect_tiles(gen: np.random.Generator, tile: _Tile, k: int) -> np.ndarray:
    """k draws of perfect_tile for one tile instruction, a row each, as SamplePerfectTile draws them."""
    divisors = np.array(_divisors(tile.extent, tile.extent if tile.max_innermost <= 0 else tile.max_innermost))
    out = np.ones((k, tile.n), dtype=np.int64)
    inner = divisors[gen.integers(len(divisors), size=k)]
    out[:, -1] = inner
    if tile.n < 2:
        out[:, 0] *= tile.extent // inner
        return out
    for d in np.unique(inner):
        rows = np.flatnonzero(inner == d)
        for p in prime_factors(tile.extent // int(d)):
            np.multiply.at(out, (rows, gen.integers(tile.n - 1, size=rows.size)), p)
    return out


class _Dataflow:
    """The trace's random variables followed through MultiLevelTiling's instructions: which sampled factors
    make which loop, which block a loop tiles, which loops are bound to threads, where caches are computed."""

    def __init__(self):
        self.factor_of: dict = {}  # a sampled factor's Var -> (tile index, position)
        self.loop_factors: dict = {}  # a LoopRV -> the factors whose product is its extent (None: unknown)
        self.loop_block: dict = {}  # a LoopRV -> the block whose loops it came from
        self.split_of: dict = {}  # a LoopRV a split made -> (tile index, position)
        self.fused_from: dict = {}  # a fused LoopRV -> the loops it fuses
        self.tile_block: dict = {}  # tile index -> the block whose loop it splits
        self.block_name: dict = {}  # a BlockRV -> its name
        self.threads: dict = {}  # a block -> factors bound to threadIdx (None: unknown)
        self.thread_level: set = set()  # split loops fused into a threadIdx or vthread loop
        self.order: list = []  # the last reorder of split loops
        self.ann: dict = {}  # a block -> {low/high: int}
        self.caches: dict = {}  # a cache block -> (the block it reads for, the read buffer's index)
        self.cache_at: list = []  # (the tiled block, read buffer index, the compute-at LoopRV)
        self.pipelines: list = []  # (a tiled block, its software pipeline's stages)

    def step(self, inst, trace, out: TileLimits) -> None:
        kind, ins = inst.kind.name, list(inst.inputs)
        if kind == "GetSBlock":
            self.block_name[inst.outputs[0]] = str(inst.attrs[0])
        elif kind == "RFactor":  # the partial-sum block TVM names after the block it splits (split_k)
            name = self.block_name.get(self.loop_block.get(ins[0]))
            if name is not None:
                self.block_name[inst.outputs[0]] = name + "_rf"
        elif kind == "SamplePerfectTile":
            if inst not in trace.decisions:
                return
            idx = len(out.tiles)
            out.tiles.append(_Tile(inst, math.prod(int(d) for d in trace.decisions[inst]), int(inst.attrs[0]),
                                   int(inst.attrs[1])))
            self.tile_block[idx] = self.loop_block.get(ins[0])
            for pos, v in enumerate(inst.outputs):
                self.factor_of[v] = (idx, pos)
        elif kind == "GetLoops":
            for loop in inst.outputs:
                self.loop_block[loop] = ins[0]
        elif kind == "Split":
            block = self.loop_block.get(ins[0])
            for loop, f in zip(inst.outputs, ins[1:]):
                self.loop_factors[loop] = [self.factor_of[f]] if f in self.factor_of else None
                if f in self.factor_of:
                    self.split_of[loop] = self.factor_of[f]
                self.loop_block[loop] = block
        elif kind == "Reorder":
            self.order = ins
        elif kind == "Fuse":
            parts = [self.loop_factors.get(loop) for loop in ins]
            fused = inst.outputs[0]
            self.loop_factors[fused] = None if any(p is None for p in parts) else [f for p in parts for f in p]
            self.loop_block[fused] = self.loop_block.get(ins[0])
            self.fused_from[fused] = ins
        elif kind == "Bind":
            self._bind(ins[0], str(inst.attrs[0]))
        elif kind == "Annotate" and str(inst.attrs[0]) in (_LOW, _HIGH):
            if hasattr(ins[1], "value"):
                self.ann.setdefault(ins[0], {})[str(inst.attrs[0])] = int(ins[1].value)
        elif kind == "Annotate" and str(inst.attrs[0]) == "software_pipeline_stage":
            block = self.loop_block.get(ins[0])
            if block is not None:
                self.pipelines.append((block, [int(s) for s in ins[1]]))
        elif kind == "CacheRead" and str(inst.attrs[1]) in ("shared", "shared.dyn"):
            self.caches[inst.outputs[0]] = (ins[0], int(inst.attrs[0]))
        elif kind == "ComputeAt" and ins[0] in self.caches:
            block, index = self.caches[ins[0]]
            self.cache_at.append((block, index, ins[1]))

    def pipelined_loops(self) -> list[list[tuple[int, int]]]:
        """The factors of each software-pipelined block's fused loop that holds its caches' compute-at loop."""
        out = []
        for block, _ in self.pipelines:
            ats = [at for b, _, at in self.cache_at if b.same_as(block)]
            for fused, parts in self.fused_from.items():
                factors = self.loop_factors.get(fused)
                if factors and any(p.same_as(at) for p in parts for at in ats):
                    out.append(factors)
                    break
        return out

    def _bind(self, loop, axis: str) -> None:
        if axis.startswith(("threadIdx", "vthread")):
            self.thread_level.update(self.fused_from.get(loop, [loop]))
        if not axis.startswith("threadIdx"):
            return
        block = self.loop_block.get(loop)
        if block is None:
            return
        factors = self.loop_factors.get(loop)
        have = self.threads.get(block, [])
        self.threads[block] = None if factors is None or have is None else have + factors


def _shared_terms(mod, trace, flow: _Dataflow, limits: TileLimits) -> list[list[_SharedTerm]]:
    """Per tiled block, its shared cache reads as _SharedTerms. The block's iterators, read regions and the
    loop each tile splits are taken from one replay of the design space, at the tile instruction (before the
    tiling changes them)."""
    seen: dict[int, tuple] = {}  # tile index -> (its loop's var, the block realize then)
    sch = Schedule(mod, seed=1, debug_mask=0, error_render_level="none")
    count = [0]

    def provider(inst, inputs, attrs, decision):
        if inst.kind.name == "SamplePerfectTile" and count[0] < len(limits.tiles):
            idx = count[0]
            count[0] += 1
            name = flow.block_name.get(flow.tile_block.get(idx))
            seen[idx] = (sch.get(inputs[0]).loop_var, _realize(sch.mod, name) if name else None)
        return decision

    trace.apply_to_schedule(sch, remove_postproc=True, decision_provider=provider)
    per_block: dict = {}
    for block, index, at in flow.cache_at:
        if at not in flow.order:
            continue
        inside = set(flow.order[flow.order.index(at) + 1:]) | flow.thread_level
        tiles = [i for i, b in flow.tile_block.items() if b is not None and b.same_as(block)]
        if not tiles or seen.get(tiles[0], (None, None))[1] is None:
            continue
        realize = seen[tiles[0]][1]
        ivars = [iv.var for iv in realize.block.iter_vars]
        var_factors: dict[int, list] = {}  # iterator index -> its factors inside
        for i in tiles:
            loop_var = seen[i][0]
            for j, value in enumerate(realize.iter_values):
                if value.same_as(loop_var):
                    var_factors[j] = [(i, p) for loop, (ti, p) in flow.split_of.items() if ti == i and loop in inside]
        read = realize.block.reads[index]
        dtype = tvm.DataType(read.source.dtype)
        dims = []
        for rng_, size in zip(read.region, read.source.shape):
            if not isinstance(rng_.extent, tvm.tirx.IntImm) or not isinstance(size, tvm.tirx.IntImm):
                break
            parts = [(abs(c), var_factors[j], k) for j, c, k in _index_parts(rng_.min, ivars) if j in var_factors]
            dims.append((int(size), int(rng_.extent), parts))
        else:
            per_block.setdefault(block, []).append((dtype.bits * dtype.lanes // 8 * _versions(flow, block), dims))
    return list(per_block.values())


def _versions(flow: _Dataflow, block) -> int:
    """How many copies of each shared cache read of `block` its software pipeline keeps (1: none). The pipelined
    loop's body is the block's cache reads then its compute, stages e.g. (0, 0, 3): a buffer written at stage s
    and read at stage t is kept t - s + 1 times (InjectSoftwarePipeline); the fewest over the reads is a lower
    bound for each."""
    reads = sum(1 for b, _, _ in flow.cache_at if b.same_as(block))
    for b, stages in flow.pipelines:
        if b.same_as(block) and len(stages) == reads + 1 and reads:
            return max(1, stages[-1] - max(stages[:-1]) + 1)
    return 1


def _index_parts(expr, ivars: list) -> list[tuple[int, int, int]]:
    """(iterator index, coefficient, divisor) per term of an index expression that is `c * v` or `v // k * c`
    in one iterator v: over iterator ranges of extents E, each such term spans at least |c| * ((E - 1) // k), and
    terms in distinct iterators add up (the box hull TVM compacts a buffer to). An iterator in any other term,
    or in two terms, is left out: its span is not known here. E.g. `ff // 8 * 8 + rc + yy * 2 + ry`."""
    terms, stack = [], [expr]
    while stack:
        e = stack.pop()
        if isinstance(e, tvm.tirx.Add):
            stack += [e.a, e.b]
        else:
            terms.append(e)
    found: list[tuple[int, int, int]] = []
    tainted: set[int] = set()
    for term in terms:
        part = _floordiv_term(term, ivars)
        if part is None:
            coefs = detect_linear_equation(term, ivars)
            if coefs and all(isinstance(c, tvm.tirx.IntImm) for c in coefs):
                found += [(j, int(c), 1) for j, c in enumerate(coefs[:-1]) if int(c)]
                continue
            used = tvm.tirx.analysis.undefined_vars(term)
            tainted |= {j for j, v in enumerate(ivars) if any(v.same_as(u) for u in used)}
        else:
            found.append(part)
    seen = [j for j, _, _ in found]
    return [(j, c, k) for j, c, k in found if j not in tainted and seen.count(j) == 1]


def _floordiv_term(term, ivars: list) -> tuple[int, int, int] | None:
    """(iterator index, c, k) when the term is `v // k * c` or `v // k`, else None."""
    coef = 1
    if isinstance(term, tvm.tirx.Mul):
        a, b = term.a, term.b
        if isinstance(a, tvm.tirx.IntImm):
            a, b = b, a
        if not isinstance(b, tvm.tirx.IntImm):
            return None
        term, coef = a, int(b.value)
    if not (isinstance(term, tvm.tirx.FloorDiv) and isinstance(term.b, tvm.tirx.IntImm) and int(term.b.value) > 0):
        return None
    for j, v in enumerate(ivars):
        if v.same_as(term.a):
            return j, coef, int(term.b.value)
    return None


def _realize(mod, name: str) -> SBlockRealize | None:
    """The block realize named `name` in the module's functions, or None."""
    stack = [f.body for f in mod.functions.values() if isinstance(f, tvm.tirx.PrimFunc)]
    while stack:
        node = stack.pop()
        if isinstance(node, SBlockRealize):
            if node.block.name_hint == name:
                return node
            stack.append(node.block.body)
        elif isinstance(node, tvm.tirx.SeqStmt):
            stack.extend(node.seq)
        elif isinstance(node, tvm.tirx.IfThenElse):
            stack.extend(n for n in (node.then_case, node.else_case) if n is not None)
        elif hasattr(node, "body"):
            stack.append(node.body)
    return None


@functools.lru_cache(maxsize=4096)
def prime_factors(n: int) -> tuple[int, ...]:
    """n's prime factors with repeats, smallest first (kept: a draw asks for the same few extents again and again)."""
    out, p = [], 2
    while p * p <= n:
        while n % p == 0:
            out.append(p)
            n //= p
        p += 1
    if n > 1:
        out.append(n)
    return tuple(out)


@functools.lru_cache(maxsize=4096)
def _divisors(extent: int, limit: int) -> tuple[int, ...]:
    return tuple(d for d in range(1, min(extent, limit) + 1) if extent % d == 0)


def perfect_tile(rng: random.Random, extent: int, n: int, max_innermost: int) -> list[int]:
    """n factors whose product is `extent`, the innermost at most `max_innermost` (as SamplePerfectTile draws:
    the innermost among the small enough divisors, each prime factor of the rest at a random outer position)."""
    inner = rng.choice(_divisors(extent, extent if max_innermost <= 0 else max_innermost))
    out = [1] * n
    out[-1] = inner
    for p in prime_factors(extent // inner):
        out[rng.randrange(n - 1) if n > 1 else 0] *= p
    return out


def sampled(trace) -> list:
    """The trace's sampling instructions (those with a decision) before its postprocessing, in order."""
    out = []
    for inst in trace.insts:
        if inst.kind.name == "EnterPostproc":
            break
        if inst in trace.decisions:
            out.append(inst)
    return out


def replay(mod, trace, decisions: dict, postprocs, seed: int, refit=None):
    """The design space's trace replayed on `mod` with the given decisions (the others sampled from `seed`;
    `refit(sch, inst, inputs, attrs, decision)` may change each on the way, `sch` the schedule being replayed),
    then the postprocessors; the schedule, or None when TVM cannot schedule it or a postprocessor rejects it."""
    sch = Schedule(mod, seed=seed, debug_mask=0, error_render_level="none")
    provider = None if refit is None else functools.partial(refit, sch)
    try:
        Trace(trace.insts, decisions).apply_to_schedule(sch, remove_postproc=True, decision_provider=provider)
        sch.enter_postproc()
        return sch if all(p.apply(sch) for p in postprocs) else None
    except Exception:  # noqa: BLE001 -- a sample TVM cannot schedule is a rejected sample
        return None


def verifies(postproc) -> bool:
    """Whether the postprocessor only checks a schedule (TVM's VerifyGPUCode) rather than rewriting it."""
    return type(postproc).__name__ == "VerifyGPUCode"


def tensorizes(trace) -> bool:
    """Whether a design space marks blocks for RewriteTensorize (tensor-core tiling)."""
    return any(inst.kind.name == "Annotate" and "meta_schedule.auto_tensorize" in str(inst.attrs)
               for inst in trace.insts)


def deferred_check(postprocs: list, design_spaces) -> tuple[list, list]:
    """(the chain a search replays the schedules it scores with, the checks it runs on those it proposes only):
    TVM's VerifyGPUCode lowers a schedule through ~20 passes to say yes or no, and the cost model's features do not
    need it. TVM runs RewriteTensorize after it, so only where no space marks tensor cores can the check move to
    the end of the chain and give the same answer; elsewhere the whole chain stays and nothing is deferred."""
    at = next((i for i, p in enumerate(postprocs) if verifies(p)), None)
    if at is None or any(tensorizes(sp.trace) for sp in design_spaces):
        return list(postprocs), []
    return list(postprocs[:at]) + list(postprocs[at + 1:]), [postprocs[at]]


class ProposalCheck:
    """The deferred checks (deferred_check) on a search's proposals. Where the builders run the same check on the
    module they lower (`in_build`: services/measurer/metaschedule/gpu_limits.py), the search checks its first
    PROBE proposals itself and, if it turned none down, leaves the rest to them: on float32 tasks within the tile
    limits and the precheck the check turned down 1 draw in 830, on a bfloat16 matmul a third of the proposals
    (its vectors; docs/time_to_quality.md), which would each cost a trial in a failed build."""

    PROBE = 16

    def __init__(self, verifiers: list, in_build: bool = False):
        import threading

        self.verifiers, self.in_build = verifiers, in_build
        self.checked = self.rejected = 0
        self.lock = threading.Lock()

    @property
    def active(self) -> bool:
        return bool(self.verifiers) and not (self.in_build and self.checked >= self.PROBE and not self.rejected)

    def passes(self, sch) -> bool:
        if not self.active:
            return True
        ok = all(p.apply(sch) for p in self.verifiers)
        with self.lock:
            self.checked += 1
            self.rejected += not ok
        return ok


def candidate(sch) -> ms.MeasureCandidate:
    """A schedule as MetaSchedule measures it."""
    return ms.MeasureCandidate(sch, ms.arg_info.ArgInfo.from_entry_func(sch.mod, remove_preproc=True))


def distinct(cands: list, seen: set[int] | None = None) -> list:
    """The candidates whose scheduled module `seen` (structural hashes, updated) does not hold, each once, in order."""
    seen = set() if seen is None else seen
    out = []
    for c in cands:
        key = tvm_ffi.structural_hash(c.sch.mod)
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out


# Of a ranked round, this share is drawn at random from the rest of the pool: a model trained on other workloads
# misranks some tasks (on the H200 panel, left one model out, its ranked rounds lost to random ones on 4 of 24 tasks)
RANKED_EXPLORE = 0.25


def ranked_pick(scores, want: int, rng: random.Random) -> list[int]:
    """Indices of a ranked round: the `want` best by score, RANKED_EXPLORE of them drawn at random from the rest."""
    order = sorted(range(len(scores)), key=lambda i: -float(scores[i]))
    explore = int(want * RANKED_EXPLORE)
    return order[:want - explore] + rng.sample(order[want - explore:], explore)


@derived_object
class ValidReplay(PySearchStrategy):
    """Replay-trace whose tile decisions are drawn within the limits (see the module's doc); each round proposes
    up to num_trials_per_iter distinct valid schedules. With `pool` > 1 and a `model` that says it is trained
    (the tuner's central cost model, SnapshotCostModel, trained on other workloads' records: given here, since the
    one pre_tuning passes has lost its Python side), a round draws `pool` times as many and proposes the model's
    best, a quarter of them (RANKED_EXPLORE) drawn at random from the rest. Left one panel model out, a model
    trained on the other three's H200 records ranked a 3x pool so that the best of 16 was 1.07x the task's best
    against 1.26x for 16 random draws (docs/time_to_quality.md, "Ranked first rounds"). The pool is replayed
    without the checks `deferred_check` defers (VerifyGPUCode), which run on the round's picks only; with
    `verify_in_build` every round is, and the checks run while ProposalCheck says so."""

    def __init__(self, seed: int = -1, threads: int = 1, pool: int = 1, model=None, verify_in_build: bool = False):
        super().__init__()
        self.seed, self.threads, self.pool, self.model = seed, max(1, threads), max(1, pool), model
        self.verify_in_build = verify_in_build
        self.ctx = None
        self.ranked_rounds = 0
        self.replayed = 0  # what it cost: replays (self.draws.drawn: decision draws; self.proposed: candidates)
        self.verify_rejected = 0  # a ranked round's picks the deferred checks turned down
        self.draws = SpaceDraws([])

    def _initialize_with_tune_context(self, context) -> None:
        self.ctx = context

    def pre_tuning(self, max_trials, num_trials_per_iter, design_spaces, database=None, cost_model=None) -> None:
        self.max_trials, self.per_iter, self.proposed = max_trials, num_trials_per_iter, 0
        shared = int(self.ctx.target.attrs.get("max_shared_memory_per_block", 0))
        self.traces = [sp.trace for sp in design_spaces]
        self.draws = SpaceDraws([TileLimits.of(sp.trace, self.ctx.mod, shared) for sp in design_spaces])
        self.rng = random.Random(None if self.seed < 0 else self.seed)
        self.seen: set[int] = set()
        self.postprocs = list(self.ctx.space_generator.postprocs)
        # a ranked round scores its pool without the deferred checks and runs them on its picks only
        self.scoring, verifiers = deferred_check(self.postprocs, design_spaces)
        self.check = ProposalCheck(verifiers, self.verify_in_build)

    def post_tuning(self) -> None:
        pass

    def generate_measure_candidates(self):
        want = min(self.per_iter, self.max_trials - self.proposed)
        if want <= 0:
            return None
        ranked = self.pool > 1 and self._model_trained()
        seeds = [self.rng.getrandbits(31) for _ in range(want * self.pool if ranked else want)]
        # with verify_in_build a slot's draw is checked as the ProposalCheck says, and drawn again if turned down
        chain = self.scoring if ranked or self.verify_in_build else self.postprocs
        checked = self.verify_in_build and not ranked
        with ThreadPoolExecutor(self.threads) as pool:
            schs = list(pool.map(functools.partial(self._one, postprocs=chain, checked=checked), seeds))
        out = distinct([candidate(sch) for sch in schs if sch is not None], set(self.seen))
        if ranked and len(out) > want:
            out = self._ranked(out, want)
            self.ranked_rounds += 1
            if hasattr(self.model, "ranked_rounds"):  # the tuner's model: the job's split counts them
                self.model.ranked_rounds += 1
        elif ranked:
            out = self._checked(out, iter(()), want)
        out = distinct(out[:want], self.seen)
        self.proposed += len(out)
        return out or None

    def _model_trained(self) -> bool:
        trained = getattr(self.model, "trained", None)  # TVM's own models do not say: never ranked by them
        return bool(trained is not None and trained())

    def _ranked(self, cands: list, want: int) -> list:
        """The model's ranked round of `want` from the pool (ranked_pick), each pick that fails the deferred checks
        replaced by the best-scored one left."""
        scores = self.model.predict(self.ctx, cands)
        picked = ranked_pick(scores, want, self.rng)
        taken = set(picked)
        rest = (cands[i] for i in sorted(range(len(cands)), key=lambda i: -float(scores[i])) if i not in taken)
        return self._checked([cands[i] for i in picked], rest, want)

    def _checked(self, picks: list, rest, want: int) -> list:
        """Up to `want` of `picks` that pass the deferred checks, in order, then of `rest` as picks fail."""
        out: list = []
        while picks:
            with ThreadPoolExecutor(self.threads) as ex:
                passed = list(ex.map(lambda c: self.check.passes(c.sch), picks))
            self.verify_rejected += passed.count(False)
            out += [c for c, ok in zip(picks, passed) if ok]
            picks = [c for _, c in zip(range(want - len(out)), rest)]
        return out

    def _one(self, seed: int, postprocs: list, checked: bool = False):
        """One schedule that passes `postprocs` (and, `checked`, the ProposalCheck), a slot of the round, or None
        after MAX_REPLAYS replays."""
        rng = random.Random(seed)
        for _ in range(MAX_REPLAYS):
            drawn = self.draws.draw(rng)
            if drawn is None:
                return None
            s, tiling = drawn
            self.replayed += 1
            decisions = {t.inst: tiling[i] for i, t in enumerate(self.draws.limits[s].tiles)}
            sch = replay(self.ctx.mod, self.traces[s], decisions, postprocs, rng.getrandbits(31) + 1)
            if sch is not None and (not checked or self.check.passes(sch)):
                return sch
        return None

    def notify_runner_results(self, measure_candidates, results) -> None:
        pass

    def clone(self) -> "ValidReplay":
        return ValidReplay(self.seed, self.threads, self.pool, self.model, self.verify_in_build)

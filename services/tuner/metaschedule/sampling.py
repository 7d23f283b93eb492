"""Valid CUDA first rounds: tile decisions drawn within the target's thread limits before any replay.

MetaSchedule's replay-trace strategy replays a design space's whole trace with random decisions, then runs the
postprocessors; on CUDA convolutions 70-95 % of those samples break the thread-extent bounds that
MultiLevelTiling annotates on the tiled block ([warp size, max threads per block]), and each costs a full
replay (10-30 ms of CPU) before validity.GPUPrecheck rejects it. Those bounds depend on the tile decisions
alone: the block's threadIdx loop is the fuse of one split level of its tiled loops, so its extent is a
product of sampled factors. `ThreadBounds` reads that dataflow off the design space's trace once; `ValidReplay`
draws perfect tilings, keeps only those whose products are within the bounds (arithmetic, microseconds) and
replays just those, then runs the context's postprocessors (GPUPrecheck, then TVM's, VerifyGPUCode last) as
replay-trace does. A decision vector is rejected here only when the bound it breaks is one VerifyGPUCode
checks on the same block, so what the check accepts is what replay-trace would accept; tests/test_validity.py
asserts that on sampled tasks.
"""
from __future__ import annotations

import math
import random
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import tvm_ffi
from tvm.ir.utils import derived_object
from tvm.s_tir import Schedule, Trace
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.meta_schedule.search_strategy import PySearchStrategy

_LOW, _HIGH = "meta_schedule.thread_extent_low_inclusive", "meta_schedule.thread_extent_high_inclusive"
# draws of decision vectors per candidate before a slot is given up (replay-trace gives up after 100 replays;
# a rejected draw here costs microseconds)
MAX_DRAWS = 2000
# replays per candidate slot before it is given up, as replay-trace's max_fail_count
MAX_REPLAYS = 100


@dataclass
class _Tile:
    inst: object  # the SamplePerfectTile instruction
    extent: int
    n: int
    max_innermost: int


@dataclass
class ThreadBounds:
    """The tile instructions of one design space and, per annotated block, the factors whose product is its
    threads: [(low, high, [(tile index, position), ...]), ...]."""

    tiles: list[_Tile] = field(default_factory=list)
    bounds: list[tuple[int, int, list[tuple[int, int]]]] = field(default_factory=list)

    @classmethod
    def of(cls, trace) -> "ThreadBounds":
        out = cls()
        factor_of: dict = {}  # a sampled factor's Var -> (tile index, position)
        loop_factors: dict = {}  # a LoopRV -> the factors whose product is its extent (None: unknown)
        loop_block: dict = {}  # a LoopRV -> the block whose loops it came from
        threads: dict = {}  # a block -> factors bound to threadIdx (None: unknown)
        ann: dict = {}  # a block -> {low/high: int}
        for inst in trace.insts:
            kind = inst.kind.name
            if kind == "SamplePerfectTile":
                if inst not in trace.decisions:
                    continue
                decision = trace.decisions[inst]
                idx = len(out.tiles)
                out.tiles.append(_Tile(inst, math.prod(int(d) for d in decision), int(inst.attrs[0]),
                                       int(inst.attrs[1])))
                for pos, v in enumerate(inst.outputs):
                    factor_of[v] = (idx, pos)
            elif kind == "GetLoops":
                for loop in inst.outputs:
                    loop_block[loop] = inst.inputs[0]
            elif kind == "Split":
                block = loop_block.get(inst.inputs[0])
                for loop, f in zip(inst.outputs, inst.inputs[1:]):
                    loop_factors[loop] = [factor_of[f]] if f in factor_of else None
                    loop_block[loop] = block
            elif kind == "Fuse":
                parts = [loop_factors.get(loop) for loop in inst.inputs]
                fused = inst.outputs[0]
                loop_factors[fused] = None if any(p is None for p in parts) else [f for p in parts for f in p]
                loop_block[fused] = loop_block.get(inst.inputs[0])
            elif kind == "Bind" and str(inst.attrs[0]).startswith("threadIdx"):
                block = loop_block.get(inst.inputs[0])
                if block is None:
                    continue
                factors = loop_factors.get(inst.inputs[0])
                have = threads.get(block, [])
                threads[block] = None if factors is None or have is None else have + factors
            elif kind == "Annotate" and str(inst.attrs[0]) in (_LOW, _HIGH):
                value = inst.inputs[1]
                if hasattr(value, "value"):
                    ann.setdefault(inst.inputs[0], {})[str(inst.attrs[0])] = int(value.value)
        for block, b in ann.items():
            factors = threads.get(block)
            if _LOW in b and _HIGH in b and factors:
                out.bounds.append((b[_LOW], b[_HIGH], factors))
        return out

    def draw(self, rng: random.Random) -> tuple[list[list[int]] | None, int]:
        """(perfect tilings of every tile instruction within the thread bounds, or None after MAX_DRAWS tries;
        the tries)."""
        for tries in range(1, MAX_DRAWS + 1):
            tiling = [perfect_tile(rng, t.extent, t.n, t.max_innermost) for t in self.tiles]
            if self.fits(tiling):
                return tiling, tries
        return None, MAX_DRAWS

    def fits(self, tiling: list[list[int]]) -> bool:
        for low, high, factors in self.bounds:
            if not low <= math.prod(tiling[i][p] for i, p in factors) <= high:
                return False
        return True


def _prime_factors(n: int) -> list[int]:
    out, p = [], 2
    while p * p <= n:
        while n % p == 0:
            out.append(p)
            n //= p
        p += 1
    if n > 1:
        out.append(n)
    return out


def perfect_tile(rng: random.Random, extent: int, n: int, max_innermost: int) -> list[int]:
    """n factors whose product is `extent`, the innermost at most `max_innermost` (as SamplePerfectTile draws:
    the innermost among the small enough divisors, each prime factor of the rest at a random outer position)."""
    limit = extent if max_innermost <= 0 else max_innermost
    inner = rng.choice([d for d in range(1, min(extent, limit) + 1) if extent % d == 0])
    out = [1] * n
    out[-1] = inner
    for p in _prime_factors(extent // inner):
        out[rng.randrange(n - 1) if n > 1 else 0] *= p
    return out


@derived_object
class ValidReplay(PySearchStrategy):
    """Replay-trace whose tile decisions are drawn within the thread bounds (see the module's doc); each
    round proposes up to num_trials_per_iter distinct valid schedules."""

    def __init__(self, seed: int = -1, threads: int = 1):
        super().__init__()
        self.seed, self.threads = seed, max(1, threads)
        self.ctx = None
        self.drawn = self.replayed = self.valid = 0  # what it cost: decision draws, replays, candidates

    def _initialize_with_tune_context(self, context) -> None:
        self.ctx = context

    def pre_tuning(self, max_trials, num_trials_per_iter, design_spaces, database=None, cost_model=None) -> None:
        self.max_trials, self.per_iter, self.proposed = max_trials, num_trials_per_iter, 0
        self.spaces = [(sp.trace, ThreadBounds.of(sp.trace)) for sp in design_spaces]
        self.rng = random.Random(None if self.seed < 0 else self.seed)
        self.seen: set[int] = set()
        self.postprocs = list(self.ctx.space_generator.postprocs)

    def post_tuning(self) -> None:
        pass

    def generate_measure_candidates(self):
        want = min(self.per_iter, self.max_trials - self.proposed)
        if want <= 0:
            return None
        seeds = [self.rng.getrandbits(31) for _ in range(want)]
        with ThreadPoolExecutor(self.threads) as pool:
            schs = list(pool.map(self._one, seeds))
        out = []
        for sch in schs:
            if sch is None:
                continue
            key = tvm_ffi.structural_hash(sch.mod)
            if key in self.seen:
                continue
            self.seen.add(key)
            out.append(ms.MeasureCandidate(sch, ms.arg_info.ArgInfo.from_entry_func(sch.mod, remove_preproc=True)))
        self.proposed += len(out)
        self.valid += len(out)
        return out or None

    def _one(self, seed: int):
        """One valid schedule (a slot of the round), or None after MAX_REPLAYS replays."""
        rng = random.Random(seed)
        for _ in range(MAX_REPLAYS):
            trace, bounds = self.spaces[rng.randrange(len(self.spaces))]
            tiling, tries = bounds.draw(rng)
            self.drawn += tries
            if tiling is None:
                return None
            decisions = {t.inst: tiling[i] for i, t in enumerate(bounds.tiles)}
            sch = Schedule(self.ctx.mod, seed=rng.getrandbits(31) + 1, debug_mask=0, error_render_level="none")
            self.replayed += 1
            try:
                Trace(trace.insts, decisions).apply_to_schedule(sch, remove_postproc=True)
                sch.enter_postproc()
                if all(p.apply(sch) for p in self.postprocs):
                    return sch
            except Exception:  # noqa: BLE001 -- a sample TVM cannot schedule is a rejected sample
                continue
        return None

    def notify_runner_results(self, measure_candidates, results) -> None:
        pass

    def clone(self) -> "ValidReplay":
        return ValidReplay(self.seed, self.threads)

"""Warm seeds: a new task's first round starts from the best records of the nearest stored workloads of the same
operator kind (services.tuner.similarity chooses them), their decisions replayed in the task's own design spaces.

A stored trace's decisions (its tiles, unroll steps, compute locations, ...) are taken in order onto a design space
of the task whose sampling instructions are the same in kind and attributes, and that space's trace is replayed
with them, each tile (SamplePerfectTile) re-fitted to the loop it splits: from the innermost factor outwards each
keeps what of it divides the extent left (its gcd with it), and the outermost takes the rest, so the product is
the new extent and no inner factor grows (the innermost stays within its max_innermost_factor). A convolution of
more spatial dimensions seeds one of fewer (services.tuner.similarity: a 2-D image model's records an audio model's
1-D convolutions): its merged axes' tiles are multiplied level by level into one (folded_decisions). A seed is thus a
draw of the task's own space (evolution breeds from it as from any), and where the space pads an awkward extent
(padding.PadAwkwardEinsum) the source's tiles are re-fitted to the padded extent: a transformer's 128-token tiles
keep their inner factors on ViT's 208 padded rows, where on 197 (prime) they keep none. A space the tiles fit
exactly is taken first, then a padded one, then the others. The context's postprocessors run as on every sampled
candidate; a trace that fits no space, raises or is rejected is skipped and counted, never an error."""
from __future__ import annotations

import logging
import math
from typing import Iterator

import tvm_ffi
from tvm import tirx
from tvm.s_tir import meta_schedule as ms

from shared import store
from shared.messages import JobTask, WorkloadShape
from services.tuner.metaschedule.ir_codec import load_ir
from services.tuner.metaschedule.padding import is_padded
from services.tuner.metaschedule.records import candidate_key, ranked, tuning_record
from services.tuner.metaschedule.sampling import candidate, prime_factors, replay, sampled
from services.tuner.similarity import folded_dims, nearest, op_kind, source_kinds

log = logging.getLogger("sharetune.tuner.seeds")

NEAREST = 3  # workloads a task's seeds come from
PER_WORKLOAD = 4  # best records tried of each
MAX_SEEDS = 8  # seeds in one task's first round, at most ...
# A stored workload this near (services.tuner.similarity.distance: the sum of |log| shape ratios; 1.0 is e.g. one
# dimension 2.7x apart) counts as one the central cost model knows: a judgement, not a measured optimum
NEAR_DISTANCE = 1.0


def seed_cap(first_round: int) -> int:
    """... and at most a quarter of the round: the rest is the task's own search."""
    return min(MAX_SEEDS, max(0, first_round) // 4)


def workload_shape(mod, wkey: str, task_name: str, target: str, share: int) -> WorkloadShape | None:
    """The workload's operator kind and its PrimFunc's buffer parameters; None when a shape is not static (or
    the module holds no PrimFunc)."""
    if sum(1 for f in mod.functions.values() if isinstance(f, tirx.PrimFunc)) != 1:
        return None
    params, dtypes = [], []
    try:
        infos = ms.arg_info.ArgInfo.from_entry_func(mod, remove_preproc=True)
    except Exception:  # noqa: BLE001 - no entry function, or a parameter that is not a buffer
        return None
    for info in infos:
        shape = getattr(info, "shape", None)
        if shape is None:
            return None
        dims = []
        for d in shape:
            if isinstance(d, tirx.IntImm):
                d = int(d)
            if not isinstance(d, int):
                return None
            dims.append(d)
        params.append(dims)
        dtypes.append(str(info.dtype))
    return WorkloadShape(wkey=wkey, op=op_kind(task_name), target=target, share=share, params=params, dtypes=dtypes)


def _refit(factors: list[int], extent: int, keep) -> list[int]:
    """Tile factors re-fitted to a new extent: from the innermost out, each inner one becomes `keep(factor, what is
    left of the extent)` (a divisor of it), and the outermost takes the rest."""
    out = [1] * len(factors)
    rest = extent
    for i in range(len(factors) - 1, 0, -1):
        out[i] = keep(max(1, int(factors[i])), rest)
        rest //= out[i]
    out[0] = rest
    return out


def refit_tile(factors: list[int], extent: int) -> list[int]:
    """Inner factors keep what of them divides the extent left (their gcd with it)."""
    return _refit(factors, extent, math.gcd)


def _shape(insts) -> list[tuple[str, str]]:
    return [(inst.kind.name, str(inst.attrs)) for inst in insts]


def _levelwise(tilings: list[list[int]], max_innermost: int) -> list[int]:
    """Tilings of several loops merged into one of their combined extent: level by level, the product (a thread
    level keeps its threads); an innermost factor over the space's limit gives its excess to the outermost."""
    out = [math.prod(int(t[i]) for t in tilings) for i in range(len(tilings[0]))]
    while max_innermost > 0 and out[-1] > max_innermost:
        p = prime_factors(out[-1])[0]
        out[-1] //= p
        out[0] *= p
    return out


def folded_decisions(source: list, decisions, own: list, k: int) -> tuple[dict, set] | None:
    """A convolution's decisions (`source`, its sampled instructions; `decisions`, its trace's) onto the sampled
    instructions `own` of a convolution with k fewer spatial dimensions, or None when they do not line up. Its
    tilings are a spatial run (N, C, then the spatial axes) and a reduction run (input channels, then the kernel
    axes), told apart by their levels: the first k + 1 spatial axes' tilings become one (_levelwise), and so do
    the first k + 1 kernel axes'; every other instruction takes the source's decision in order, matched in kind
    and attributes. Also the instructions of the merged tilings (re-fitted by nearest_fit)."""
    def split(insts):
        tiles = [i for i in insts if i.kind.name == "SamplePerfectTile"]
        levels = [int(i.attrs[0]) for i in tiles]
        s = next((n for n, lv in enumerate(levels) if lv != levels[0]), len(levels)) if levels else 0
        rest = [i for i in insts if i.kind.name != "SamplePerfectTile"]
        return tiles[:s], tiles[s:], rest, len(set(levels[s:])) == 1 and (not levels or levels[0] not in levels[s:])

    src_s, src_r, src_rest, src_ok = split(source)
    own_s, own_r, own_rest, own_ok = split(own)
    if not (src_ok and own_ok and k > 0 and len(own_s) >= 3 and len(own_r) >= 2 and len(src_s) == len(own_s) + k
            and len(src_r) == len(own_r) + k and _shape(src_rest) == _shape(own_rest)
            and _shape(src_s[:1] + src_r[:1]) == _shape(own_s[:1] + own_r[:1])):
        return None
    tile = [[int(d) for d in decisions[i]] for i in src_s + src_r]
    sp, rd = tile[:len(src_s)], tile[len(src_s):]
    cap = int(own_s[0].attrs[1])
    merged = sp[:2] + [_levelwise(sp[2:3 + k], cap)] + sp[3 + k:] + rd[:1] + [_levelwise(rd[1:2 + k], cap)] + rd[2 + k:]
    out = dict(zip(own_s + own_r, merged))
    out.update({o: decisions[i] for o, i in zip(own_rest, src_rest)})
    return out, {own_s[2], own_r[1]}


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def nearest_fit(factors: list[int], extent: int) -> list[int]:
    """Inner factors become the divisor of the extent left nearest them (by ratio; the smaller on a tie): for merged
    tilings, whose products (7 x 7 = 49 threads) share no factor with a padded extent (800) and would keep none by
    their gcd."""
    return _refit(factors, extent, lambda f, rest: min(_divisors(rest), key=lambda d: (abs(math.log(d / f)), d)))


def transfer(trace, ctx: ms.TuneContext, spaces, fold: int = 0) -> ms.MeasureCandidate | None:
    """A stored trace's decisions replayed in one of the task's design spaces `spaces` (the module's doc; `fold`:
    the spatial dimensions the trace's convolution has more than the task's), the postprocessors run; None when it
    fits no space or does not apply in any (an instruction raises: a compute location the workload lacks; or a
    postprocessor rejects the schedule)."""
    source = sampled(trace)
    shape = _shape(source)
    found = []
    padded = bool(fold) and any(is_padded(space.trace) for space in spaces)  # a folded seed's only question
    for space in spaces:
        own = sampled(space.trace)
        if fold:
            decisions, merged = folded_decisions(source, trace.decisions, own, fold) or (None, set())
        else:
            same = _shape(own) == shape
            decisions, merged = {o: trace.decisions[i] for o, i in zip(own, source)} if same else None, set()
        if decisions is None:
            continue
        cand, refitted = _replayed(space.trace, decisions, ctx, merged)
        refitted |= fold > 0
        if cand is not None and (not refitted or (fold and not padded)):  # no better one to come
            return cand
        if cand is not None:
            found.append((not is_padded(space.trace), len(found), cand))
    return min(found)[2] if found else None


def _replayed(space_trace, decisions: dict, ctx: ms.TuneContext,
              merged: set = frozenset()) -> tuple[ms.MeasureCandidate | None, bool]:
    """(the space's trace replayed with `decisions`, tiles re-fitted (those of `merged` by nearest_fit),
    postprocessed, as a candidate or None; whether a tile was re-fitted)."""
    refitted = False

    def refit(sch, inst, inputs, attrs, decision):
        nonlocal refitted
        if inst.kind.name != "SamplePerfectTile" or decision is None:
            return decision
        extent = sch.get(inputs[0]).extent
        if not isinstance(extent, tirx.IntImm):
            return decision
        given = [int(d) for d in decision]
        fitted = (nearest_fit if inst in merged else refit_tile)(given, int(extent))
        refitted |= fitted != given
        return fitted

    try:
        sch = replay(ctx.mod, space_trace, decisions, ctx.space_generator.postprocs, seed=1, refit=refit)
        if sch is None:
            return None, refitted
        # the seed must replay on this workload as evolution (from the database) replays it: without its
        # postprocessing, which the postprocessors then redo; a trace whose replay differs is no seed
        again = replay(ctx.mod, sch.trace, dict(sch.trace.decisions), ctx.space_generator.postprocs, seed=1)
        if again is None or not tvm_ffi.structural_equal(again.mod, sch.mod):
            return None, refitted
        return candidate(sch), refitted
    except Exception as err:  # noqa: BLE001 - another workload's decisions may fail anywhere in the replay
        log.debug("decisions do not apply to %s: %s", ctx.task_name, err)
        return None, refitted


class SeedSource:
    """Seeds for the first rounds of one shard's tasks, from the store's index of similar workloads."""

    def __init__(self, redis, target_kind: str, target: str, share: int,
                 shapes: dict[str, WorkloadShape | None] | None = None, within: set[str] | None = None,
                 late: bool = False):
        self.redis, self.kind, self.target, self.share = redis, target_kind, target, share
        self.late = late  # a task whose first round found no seed looks again once that round has landed
        self.shapes = shapes or {}  # task_id -> its workload's shape (workload_shape), for `knows`
        self.within = within  # an isolated job's workload keys: seeds only from these (None: the whole store)
        self.applied = 0  # traces that applied to the new task's workload
        self.skipped = 0  # traces that did not
        self.padded = 0  # of those applied, into a padded space (padding.PadAwkwardEinsum)

    def knows(self, task: JobTask) -> bool:
        """Whether the store has measured this task's workload or one within NEAR_DISTANCE of it. A cost model
        trained on other workloads only (another network's operators) guides a first round no better than
        sampling the design space does, and evolving against it costs more search per candidate: such a
        task's first round samples, as on a fresh store."""
        if store.has_records(self.redis, task.wkey):
            return True
        shape = self.shapes.get(task.task_id)
        if shape is None:
            return False
        near = nearest(shape, self.stored(shape.op), 1)
        return bool(near) and near[0][0] <= NEAR_DISTANCE

    def due(self, started: bool, landed: int, looks: list[int]) -> bool:
        """Whether a task's next round starts with seeds: its first round does; with `late`, so does its first round
        after that one landed if no round has found a seed yet (`looks`: the seeds each earlier look found). In a
        cold job a task's first round is often drawn before a sibling of its kind has a record (wav2vec2-conv's
        heavier 1-D convolution at 5 s, its sibling's first results at ~20 s): its next round can start from the
        sibling's best. A resumed task (started, never looked in this process) gets none."""
        if not started:
            return True
        return self.late and landed >= 1 and len(looks) == 1 and looks[0] == 0

    def seeded_round(self, ctx: ms.TuneContext, task: JobTask, records, fresh: list, room: int) -> tuple[list, int]:
        """(the round's candidates with the seeds first, how many seeds): the nearest stored workloads' best traces
        re-fitted to this task (seed_cap of the round at most), none the store already holds. They are measured,
        recorded and counted like the search's own; the search strategy is told their results as it is of every
        round's (its trial counters have room to spare)."""
        cap = seed_cap(room)
        if cap == 0:
            return fresh, 0
        have = {candidate_key(task.wkey, c) for c in fresh}
        picked = []
        for cand, source in self.candidates(ctx, task):
            key = candidate_key(task.wkey, cand)
            if key not in have:
                have.add(key)
                picked.append((cand, key, source))
            if len(picked) >= cap:
                break
        known = records.known(task.wkey, [k for _, k, _ in picked])
        picked = [(c, k, src) for c, k, src in picked if k not in known]
        for _, key, source in picked:
            records.seeded[key] = source
        return ([c for c, _, _ in picked] + fresh)[:room], len(picked)

    def stored(self, op: str) -> list[WorkloadShape]:
        """The store's workloads of this operator kind (or one that folds to it: similarity.source_kinds) with valid
        records that may seed this job."""
        shapes = [s for kind in source_kinds(op) for s in store.similar_workloads(self.redis, self.kind, kind)]
        return shapes if self.within is None else [s for s in shapes if s.wkey in self.within]

    def candidates(self, ctx: ms.TuneContext, task: JobTask) -> Iterator[tuple[ms.MeasureCandidate, str]]:
        """(candidate, source workload key), the best record of each of the nearest workloads first, then each
        one's second best, and so on; lazily: the caller stops when it has enough."""
        shape = workload_shape(ctx.mod, task.wkey, task.name, self.target, self.share)
        if shape is None:
            return
        near = nearest(shape, self.stored(shape.op), NEAREST)
        spaces = _Lazy(ctx.generate_design_space)
        sources = []
        for _, src in near:
            recs = ranked(store.records(self.redis, src.wkey), full_only=True)[:PER_WORKLOAD]
            if recs:
                sources.append((src.wkey, recs, None, folded_dims(shape.op, src.op)))
        for rank in range(PER_WORKLOAD):
            for i, (wkey, recs, wl, fold) in enumerate(sources):
                if rank >= len(recs):
                    continue
                if wl is None:
                    wl = ms.database.Workload(load_ir(store.workload(self.redis, wkey).mod))
                    sources[i] = (wkey, recs, wl, fold)
                try:
                    trace = tuning_record(recs[rank].trace, wl).trace
                except Exception:  # noqa: BLE001 - a record that no longer decodes is as good as absent
                    self.skipped += 1
                    continue
                cand = transfer(trace, ctx, spaces, fold)
                if cand is None:
                    self.skipped += 1
                    continue
                self.applied += 1
                self.padded += is_padded(cand.sch.trace)
                yield cand, wkey


class _Lazy:
    """The task's design spaces, generated when a trace first needs them."""

    def __init__(self, make):
        self.make, self.made = make, None

    def __iter__(self):
        if self.made is None:
            self.made = list(self.make())
        return iter(self.made)

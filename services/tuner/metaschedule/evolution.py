"""Evolutionary CUDA rounds whose every mutant is within the target's limits before it is replayed.

MetaSchedule's EvolutionarySearch mutates traces and replays each mutant through the postprocessors to learn
whether it is valid; on CUDA convolutions ~75 % of mutants break the thread-extent or shared-memory bounds
(the limits sampling.TileLimits reads off the design space), each after a full replay, and its initial
population draws random replays until 16 pass. Here a schedule is its decisions (a genome: one value per
sampled instruction of its design space): a mutation moves one prime factor between two levels of one tiling,
or changes one categorical choice (unrolling, cooperative fetch width), and is checked against the limits
arithmetically before anything is replayed. Only mutants within the limits are replayed and scored by the
cost model; the population keeps the best scored (elitist), and the round proposes the best unmeasured ones
plus a few random valid draws (epsilon-greedy), as EvolutionarySearch does.

Where no block is marked for tensor cores (RewriteTensorize, which TVM runs after the check, then has nothing to
do), a schedule is scored with every postprocessor but TVM's VerifyGPUCode, which lowers it through ~20 passes (a
third of a round's CPU when it checked every mutant) and only says yes or no: the cost model's features do not
need it. It checks the schedules a round is about to propose, best first, until the round is full; one it
rejects is dropped and never scored again. So every proposed candidate has passed TVM's whole chain. With
`verify_in_build` the builders run that check on the module they lower (services/measurer/metaschedule/gpu_limits.py)
and the search stops running it once it has turned none of its first proposals down (sampling.ProposalCheck).

A task's replays are kept across its rounds, so the measured parents are not replayed again.

With `screen` on, each generation breeds twice as many mutants as its population (arithmetic only) and replays
and scores the half of its population's size that a linear model of the decisions ranks best: the model is fit,
per design space, on the schedules the round has scored so far (log2 tile factors, one-hot categorical choices
-> the cost model's score), so a generation costs a quarter of the replays and feature extractions.
"""
from __future__ import annotations

import logging
import math
import random
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from tvm.ir.utils import derived_object
from tvm.s_tir.meta_schedule.search_strategy import PySearchStrategy

from services.tuner.metaschedule.sampling import (ProposalCheck, SpaceDraws, TileLimits, candidate, deferred_check,
                                                  distinct, prime_factors, replay, sampled)

log = logging.getLogger("sharetune.tuner.evolution")

# generations a round breeds after its initial population (EvolutionarySearch's genetic_num_iters is 4; with
# every mutant valid, fewer generations score as many valid schedules)
GENERATIONS = 3
# tries for one child before its slot is given up: a mutant that breaks the limits or repeats a schedule
MUTATION_TRIES = 10
# replayed schedules a task keeps across its rounds (beyond this, a round starts with none)
CACHE = 4096
# the smallest population a round breeds: a round proposing fewer candidates than the population breeds only as
# many as it proposes (a light task's round of 8 scored ~4 times its candidates instead of ~32 times)
MIN_POPULATION = 16
# the share of a round drawn at random instead of by the cost model (EvolutionarySearch's eps_greedy)
EPS_GREEDY = 0.05
# of a mutation, the chance it changes a tiling (else a categorical choice), as the CUDA mutators weigh them
TILE_MUTATION = 0.9
# with screening: the ridge penalty of the decisions' linear model, and the fewest scored schedules of a design
# space it is fit on (below that its mutants are ranked by the space's mean score)
SCREEN_RIDGE = 1.0
SCREEN_MIN_ROWS = 16

Genome = tuple  # one decision per sampled instruction of a design space: a tuple of ints (tiling) or an int


@dataclass
class _Space:
    trace: object
    limits: TileLimits
    sampled: list  # the trace's instructions with decisions, in order
    tile_at: dict  # position in `sampled` -> index in limits.tiles
    signature: tuple  # what a stored trace of this space looks like, decisions aside


def _signature(insts) -> tuple:
    out = []
    for inst in insts:
        if inst.kind.name == "EnterPostproc":
            break
        out.append((inst.kind.name, str(inst.attrs)))
    return tuple(out)


def genome_of(trace) -> Genome:
    """A trace's decisions in instruction order (postprocessing aside)."""
    return tuple(tuple(int(x) for x in trace.decisions[inst]) if inst.kind.name == "SamplePerfectTile"
                 else int(trace.decisions[inst]) for inst in sampled(trace))


@derived_object
class ValidEvolution(PySearchStrategy):
    """Evolutionary search over decisions within the limits (see the module's doc)."""

    def __init__(self, seed: int = -1, threads: int = 1, population: int = 128, screen: bool = False,
                 verify_in_build: bool = False):
        super().__init__()
        self.seed, self.threads, self.population = seed, max(1, threads), max(8, population)
        self.screen, self.verify_in_build = screen, verify_in_build
        self.ctx = None
        self.replayed = 0  # what it cost: schedules replayed (self.proposed: candidates)
        self.verify_rejected = 0  # proposals the verifiers turned down

    def _initialize_with_tune_context(self, context) -> None:
        self.ctx = context

    def pre_tuning(self, max_trials, num_trials_per_iter, design_spaces, database=None, cost_model=None) -> None:
        self.max_trials, self.per_iter, self.proposed = max_trials, num_trials_per_iter, 0
        self.database, self.cost_model = database, cost_model
        shared = int(self.ctx.target.attrs.get("max_shared_memory_per_block", 0))
        self.spaces = []
        for sp in design_spaces:
            limits = TileLimits.of(sp.trace, self.ctx.mod, shared)
            sampled = [inst for inst in sp.trace.insts if inst in sp.trace.decisions]
            tiles = {t.inst: i for i, t in enumerate(limits.tiles)}
            self.spaces.append(_Space(sp.trace, limits, sampled,
                                      {k: tiles[inst] for k, inst in enumerate(sampled) if inst in tiles},
                                      _signature(sp.trace.insts)))
        self.draws = SpaceDraws([space.limits for space in self.spaces])
        self.rng = random.Random(None if self.seed < 0 else self.seed)
        self.sent: set[tuple[int, Genome]] = set()  # what this search proposed
        self.postprocs, verifiers = deferred_check(list(self.ctx.space_generator.postprocs), design_spaces)
        self.check = ProposalCheck(verifiers, self.verify_in_build)
        self.replays: dict[tuple[int, Genome], object] = {}  # key -> its candidate (None: TVM refused it)
        self.verified: set[tuple[int, Genome]] = set()  # keys whose schedule passed the verifiers

    def post_tuning(self) -> None:
        pass

    def notify_runner_results(self, measure_candidates, results) -> None:
        pass

    def clone(self) -> "ValidEvolution":
        return ValidEvolution(self.seed, self.threads, self.population, self.screen, self.verify_in_build)

    # -- a round ---------------------------------------------------------------------------------------------
    def generate_measure_candidates(self):
        want = min(self.per_iter, self.max_trials - self.proposed)
        if want <= 0:
            return None
        try:
            return self._round(want)
        except Exception:  # noqa: BLE001 -- a trace shape this search does not know: the round samples instead
            log.exception("task %s: evolution within the limits failed; this round samples", self.ctx.task_name)
            keys = self._random_verified(want, set())
            self.sent.update(keys)
            self.proposed += len(keys)
            return distinct([self.replays[k] for k in keys]) or None

    def _round(self, want: int) -> list | None:
        if len(self.replays) > CACHE:
            self.replays.clear()
            self.verified.clear()
        size = min(self.population, max(MIN_POPULATION, want))
        measured, parents = self._measured(size // 2)
        pool: dict[tuple[int, Genome], tuple] = {}  # (space, genome) -> (candidate, score)
        self._score(pool, parents + self._random(size - len(parents)))
        population = self._fittest(pool, size)
        for _ in range(GENERATIONS):
            if self.screen:
                children = screened(self.spaces, pool, self._children(population, pool, 2 * len(population)),
                                    max(1, len(population) // 2))
            else:
                children = self._children(population, pool, len(population))
            self._score(pool, children)
            population = self._fittest(pool, size)
        fresh = [k for k in self._fittest(pool, len(pool)) if k not in measured and k not in self.sent]
        rejected = self.verify_rejected
        picked = self._passing(fresh, want - int(round(want * EPS_GREEDY)))
        picked += self._random_verified(want - len(picked), set(picked) | measured | self.sent)
        if not picked:  # the task then samples (TaskSearch): say why its evolution came up empty
            log.warning("task %s: an evolutionary round of %d proposed nothing: %d scored, %d measured of them, "
                        "%d fresh, %d turned down by the verifiers", self.ctx.task_name, want, len(pool),
                        len(measured & set(pool)), len(fresh), self.verify_rejected - rejected)
        self.sent.update(picked)
        self.proposed += len(picked)
        return distinct([self.replays[k] for k in picked]) or None

    def _measured(self, parents: int) -> tuple[set, list]:
        """(every stored schedule's key for this workload; the best ones', up to `parents`, to breed from)."""
        if self.database is None or not self.database.has_workload(self.ctx.mod):
            return set(), []
        records = self.database.get_top_k(self.database.commit_workload(self.ctx.mod), 1 << 16)
        keys, best = set(), []
        for rec in records:
            key = self._key_of(rec.trace)
            if key is None:
                continue
            if key not in keys and len(best) < parents:
                best.append(key)
            keys.add(key)
        return keys, best

    def _key_of(self, trace) -> tuple[int, Genome] | None:
        """(the design space a stored trace was drawn from, its genome), or None when it fits none."""
        sig = _signature(trace.insts)
        for s, space in enumerate(self.spaces):
            if space.signature == sig:
                return s, genome_of(trace)
        return None

    def _random(self, n: int) -> list[tuple[int, Genome]]:
        """Up to n random schedules' keys: tilings drawn within the limits, replayed (into the replay cache)."""
        if n <= 0:
            return []
        seeds = [self.rng.getrandbits(31) for _ in range(n)]
        with ThreadPoolExecutor(self.threads) as pool:
            schs = list(pool.map(self._random_one, seeds))
        out = []
        for sch in schs:
            key = None if sch is None else self._key_of(sch.trace)
            if key is not None:
                self.replays[key] = candidate(sch)
                out.append(key)
        return out

    def _passing(self, keys: list, n: int) -> list[tuple[int, Genome]]:
        """The first n of `keys` whose schedule passes the verifiers, checked in order, a batch at a time; a
        key that fails is dropped from the replay cache (never scored again)."""
        out: list[tuple[int, Genome]] = []
        at = 0
        while len(out) < n and at < len(keys):
            batch = [k for k in keys[at: at + n - len(out)] if self.replays.get(k) is not None]
            at += n - len(out)
            with ThreadPoolExecutor(self.threads) as ex:
                passed = list(ex.map(self._verify, batch))
            out += [k for k, ok in zip(batch, passed) if ok]
        return out

    def _verify(self, key: tuple[int, Genome]) -> bool:
        if key not in self.verified:
            sch = self.replays[key].sch
            if not self.check.passes(sch):
                self.replays[key] = None
                self.verify_rejected += 1
                return False
            self.verified.add(key)
        return True

    def _random_verified(self, n: int, taken: set) -> list[tuple[int, Genome]]:
        """Up to n random schedules that pass the verifiers and are not in `taken` (a few draws at most)."""
        out: list[tuple[int, Genome]] = []
        for _ in range(3):
            if len(out) >= n:
                break
            fresh = [k for k in dict.fromkeys(self._random(2 * (n - len(out)))) if k not in taken and k not in out]
            out += self._passing(fresh, n - len(out))
        return out

    def _random_one(self, seed: int):
        rng = random.Random(seed)
        drawn = self.draws.draw(rng)
        if drawn is None:
            return None
        space, tiling = self.spaces[drawn[0]], drawn[1]
        self.replayed += 1
        return replay(self.ctx.mod, space.trace, {t.inst: tiling[i] for i, t in enumerate(space.limits.tiles)},
                      self.postprocs, rng.getrandbits(31) + 1)

    def _score(self, pool: dict, keys: list) -> None:
        """Score the keys not in the pool yet with the cost model (replaying those not replayed yet), into the
        pool; a key TVM cannot schedule is left out."""
        keys = [k for k in dict.fromkeys(keys) if k not in pool]
        new = [k for k in keys if k not in self.replays]
        with ThreadPoolExecutor(self.threads) as ex:
            for k, sch in zip(new, ex.map(self._replay_key, new)):
                self.replays[k] = None if sch is None else candidate(sch)
        valid = [k for k in keys if self.replays.get(k) is not None]
        if not valid:
            return
        cands = [self.replays[k] for k in valid]
        scores = self.cost_model.predict(self.ctx, cands) if self.cost_model is not None else \
            [self.rng.random() for _ in valid]
        for k, score in zip(valid, scores):
            pool[k] = (self.replays[k], float(score))

    def _replay_key(self, key: tuple[int, Genome]):
        s, genome = key
        space = self.spaces[s]
        self.replayed += 1
        decisions = {inst: (list(d) if isinstance(d, tuple) else d) for inst, d in zip(space.sampled, genome)}
        return replay(self.ctx.mod, space.trace, decisions, self.postprocs, hash(key) & 0x7FFFFFFF)

    @staticmethod
    def _fittest(pool: dict, n: int) -> list[tuple[int, Genome]]:
        return sorted(pool, key=lambda k: -pool[k][1])[:n]

    def _children(self, population: list, pool: dict, n: int) -> list[tuple[int, Genome]]:
        """n children, each of a parent drawn by its score, mutated once within the limits."""
        if not population:
            return []
        low = min(pool[k][1] for k in population)
        weights = [pool[k][1] - low + 1e-6 for k in population]
        out: list[tuple[int, Genome]] = []
        taken = set(pool)
        for _ in range(n):
            for _ in range(MUTATION_TRIES):
                s, genome = self.rng.choices(population, weights)[0]
                child = self._mutate(self.spaces[s], genome)
                if child is not None and (s, child) not in taken:
                    taken.add((s, child))
                    out.append((s, child))
                    break
        return out

    def _mutate(self, space: _Space, genome: Genome) -> Genome | None:
        """The genome with one prime factor moved between two levels of one tiling (kept within the limits), or
        one categorical choice changed; None when the mutation finds nothing to change or breaks a limit."""
        tiles = [k for k in space.tile_at if len(genome[k]) > 1 and any(f > 1 for f in genome[k])]
        choices = [k for k, inst in enumerate(space.sampled)
                   if inst.kind.name == "SampleCategorical" and len(inst.attrs[0]) > 1]
        out = list(genome)
        if tiles and (not choices or self.rng.random() < TILE_MUTATION):
            k = self.rng.choice(tiles)
            factors = list(genome[k])
            src = self.rng.choice([i for i, f in enumerate(factors) if f > 1])
            prime = self.rng.choice(prime_factors(factors[src]))
            dst = self.rng.choice([i for i in range(len(factors)) if i != src])
            factors[src] //= prime
            factors[dst] *= prime
            tile = space.limits.tiles[space.tile_at[k]]
            if tile.max_innermost > 0 and factors[-1] > tile.max_innermost:
                return None
            out[k] = tuple(factors)
            tiling = [list(out[j]) for j in sorted(space.tile_at, key=space.tile_at.get)]
            return tuple(out) if space.limits.fits(tiling) else None
        if choices:
            k = self.rng.choice(choices)
            n = len(space.sampled[k].attrs[0])
            out[k] = (genome[k] + self.rng.randrange(1, n)) % n
            return tuple(out)
        return None


def decision_vector(space: _Space, genome: Genome) -> list[float]:
    """A genome as numbers a linear model can weigh: a bias, log2 of each tile factor, each categorical choice one-hot,
    any other decision as it is."""
    out = [1.0]
    for inst, d in zip(space.sampled, genome):
        if isinstance(d, tuple):
            out += [math.log2(max(1, f)) for f in d]
        elif inst.kind.name == "SampleCategorical":
            out += [1.0 if d == i else 0.0 for i in range(len(inst.attrs[0]))]
        else:
            out.append(float(d))
    return out


def screened(spaces: list, pool: dict, keys: list, n: int) -> list:
    """The n of `keys` that a ridge model of the decisions, fit per design space on the pool's scores, ranks best
    (a space with too few scored schedules ranks its keys at its mean score, or the pool's)."""
    if len(keys) <= n:
        return keys
    mean = float(np.mean([score for _, score in pool.values()])) if pool else 0.0
    predicted: dict = {}
    for s in sorted({k[0] for k in keys}):
        mine = [k for k in keys if k[0] == s]
        rows = [(decision_vector(spaces[s], g), pool[(s, g)][1]) for (t, g) in pool if t == s]
        if not rows:
            predicted.update((k, mean) for k in mine)
            continue
        x = np.asarray([r[0] for r in rows])
        y = np.asarray([r[1] for r in rows])
        if len(rows) < SCREEN_MIN_ROWS:
            predicted.update((k, float(y.mean())) for k in mine)
            continue
        w = np.linalg.solve(x.T @ x + SCREEN_RIDGE * np.eye(x.shape[1]), x.T @ y)
        got = np.asarray([decision_vector(spaces[s], g) for _, g in mine]) @ w
        predicted.update(zip(mine, map(float, got)))
    return sorted(keys, key=lambda k: -predicted[k])[:n]

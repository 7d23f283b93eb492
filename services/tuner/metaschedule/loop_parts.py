"""What a shard's loop (rounds.py) is given, Shard and SearchParts, and what it reports, ShardRun."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from shared.messages import JobTask
from services.tuner.metaschedule.records import StoreRecords

# seconds of wall time in each phase, and "sample_cpu": the CPU (every thread of this process) the search's
# sampling used, the cost of a valid candidate that bench/time_to_quality.py reports; "evolve_cpu" the part of
# it that evolutionary rounds used; "evolved" and "drawn": the candidates evolutionary rounds and design-space
# sampling proposed
PHASES = ("defaults", "sample", "features", "record", "sample_cpu", "evolve_cpu", "evolved", "drawn")


class Stopped(Exception):
    """The client was asked to stop (shutdown) or lost its lease: the shard goes back to the queue."""


class TurnTaken(Stopped):
    """The client hands its shard back to search the waiting shard `shard` of job `job_id` instead."""

    def __init__(self, job_id: str, shard: int, why: str):
        super().__init__(why)
        self.job_id, self.shard = job_id, shard


@dataclass
class ShardRun:
    """What a shard's loop did, for the job's result and the benchmarks."""

    rounds: int = 0
    trials: int = 0  # measured and recorded (claimed from the job's budget)
    reused: int = 0  # proposed again but already in the store: not measured, not charged
    waited_s: float = 0.0  # let other shards' tasks go first, or their first rounds' budget be left to them
    # where the rest of the client's time went, in seconds: defaults (timing each task's default schedule),
    # sample (MetaSchedule's search: sampling, evolution, the cost model's predictions), features (the
    # measured rows' features for the updater), record (results into the store and the search)
    phase_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    warm_switches: int = 0  # tasks that moved from sampling to evolutionary search
    ahead_rounds: int = 0  # rounds sent while an earlier batch of the same task was still measured
    seeds: int = 0  # warm seeds sent to be measured (first rounds' re-fitted records of nearby workloads)
    late_seeds: int = 0  # of those, in a task's second round (seeds.SeedSource.due)
    floor_s: float | None = None  # the lanes' launch floor its gradients counted from (None: no floor asked)
    per_task: dict[str, int] = field(default_factory=dict)
    # each round sent: [s since the loop began, task, trials claimed, first round (0/1), its priority when picked,
    # the other live shards' highest finite priority, s it waited to be let run, its search's kind ("drawn" or
    # "evolved"), the search's CPU s (the process's, so other threads' work in that time counts too), candidates
    # it proposed]; priorities None for a first round; a search that found nothing new is logged with 0 claimed
    round_log: list = field(default_factory=list)
    pick: tuple | None = None  # (priority, others' top, waited s) of the task the picker let run last

    def clock(self, phase: str, since: float) -> float:
        """Add the time since `since` (time.perf_counter) to `phase`; returns now, the next phase's start."""
        now = time.perf_counter()
        self.phase_s[phase] += now - since
        return now


@dataclass
class Shard:
    """Which shard of which job the loop searches, and the job's round sizes."""

    redis: object
    job_id: str
    shard: int
    tasks: list[JobTask]
    trials_per_iter: int
    max_trials_per_task: int
    first_round: int | None = None  # allocation.first_round_size (default: a full round)


@dataclass
class SearchParts:
    """What the loop drives: `make_context(task, cold)` builds a task's TuneContext; the builder and runner
    (deferred builds, lanes), TVM's database of the shard's workloads, the central cost model, the store's
    records; `defaults(tasks)`: task_id -> seconds of its default schedule, timed before the first rounds;
    `seeds` (seeds.SeedSource): a first round starts with nearby workloads' best records; `floor()`: the lanes'
    launch floor in seconds (defaults.launch_floor), which the gradient's forward term counts from;
    `first_round_floor`: the floor's store key, when the first rounds' sizes count from it too (FirstRounds)."""

    make_context: Callable
    builder: object
    runner: object
    database: object
    cost_model: object
    records: StoreRecords
    defaults: Callable[[list[JobTask]], dict] | None = None
    seeds: object = None
    floor: Callable[[], float | None] | None = None
    first_round_floor: str | None = None

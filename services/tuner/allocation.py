"""Pure logic of sharding one job over several tuner clients: how tasks are split into shards, how the
job's trials are allocated, and when a client should let other shards' tasks go first.

The allocation rule, job-wide across shards and clients (docs/sharding.md, "How trials are allocated"):
1. every task gets its first round before any task gets a second, the task that costs the untuned model the
   most first (`first_round_order`); a budget too small for a full round of every task is shared evenly by
   the first rounds (`first_round_size`), except that a task costing the untuned model under half an equal
   share gets a small one (`first_round_sizes`); a second round leaves in the budget what the job's
   remaining first rounds need (`first_rounds_reserve`);
2. then rounds go by MetaSchedule's task gradient (`gradient`), computed from every shard's history in the
   store, a task's latency being its default schedule's until a candidate beats it
   (metaschedule/defaults.py);
3. a task with >= 1 % of the job's FLOPs x weight never has fewer trials than a task under 0.1 % (`behind`);
4. a task ends early only when its design space is spent (metaschedule/task_search.py, EMPTY_ROUNDS)."""
from __future__ import annotations

import math
from dataclasses import dataclass

from shared.messages import JobTask, ShardState

ALPHA = 0.2  # MetaSchedule's defaults for its gradient-based task scheduler
WINDOW = 3
HEAVY, LIGHT = 0.01, 0.001  # shares of the job's FLOPs (x weight)


def expected_cost(task: JobTask, tasks: list[JobTask]) -> float:
    """What tuning a task is expected to cost, relative to the job: every task gets search rounds
    (a fixed part), and the gradient scheduler sends more trials to the tasks that dominate the model's
    latency (a part proportional to FLOPs x weight)."""
    total = sum(max(t.flops, 1.0) * t.weight for t in tasks) or 1.0
    return 0.5 / len(tasks) + 0.5 * max(task.flops, 1.0) * task.weight / total


def partition(tasks: list[JobTask], n: int) -> list[ShardState]:
    """Split tasks into at most n shards of near-equal expected cost (longest processing time first:
    the heaviest remaining task goes to the lightest shard). Deterministic; never an empty shard."""
    if not tasks:
        return []
    n = max(1, min(int(n), len(tasks)))
    costs = {t.task_id: expected_cost(t, tasks) for t in tasks}
    order = sorted(tasks, key=lambda t: (-costs[t.task_id], t.name, t.task_id))
    loads = [0.0] * n
    members: list[list[str]] = [[] for _ in range(n)]
    for t in order:
        i = min(range(n), key=lambda k: (loads[k], k))
        members[i].append(t.task_id)
        loads[i] += costs[t.task_id]
    return [ShardState(shard=i, task_ids=members[i], expected_cost=round(loads[i], 6)) for i in range(n)]


def first_round_size(trials: int, n_tasks: int, per_iter: int) -> int:
    """How many candidates a task's first round measures. Every task of the job gets its first round
    before any task gets a second (MetaSchedule's round-robin start); when the job's budget cannot give
    every task a full round (trials < tasks x per_iter), first rounds share it evenly, at least one
    candidate each, and what is left goes by the gradient. Ordering full first rounds by some guess of
    which tasks matter (FLOPs x weight, or stock's extraction order) leaves most tasks on their default
    schedule at such budgets, and the few first candidates of a task are the ones that gain the most."""
    if n_tasks <= 0:
        return per_iter
    return max(1, min(per_iter, trials // n_tasks))


# a light task's first round: enough to see whether a sampled schedule beats its default at all
LIGHT_FIRST_ROUND = 8
LIGHT_SHARE = 0.5  # of an equal share of the untuned model's latency


def first_round_sizes(costs: dict[str, float | None], uniform: int) -> dict[str, int]:
    """Each task's first round, once every task's default schedule has been timed. `costs`: task -> weight x
    its default schedule's seconds (None where the default could not be timed); `uniform`: first_round_size.
    A task costing the untuned model under LIGHT_SHARE of an equal share gets at most LIGHT_FIRST_ROUND: layout
    and normalisation kernels near a launch's floor (3-5 us on a GPU) have little to gain, and an even share of
    a few hundred trials spent on each leaves the heavy tasks nothing but their random first rounds. The trials
    saved go by the gradient. A task whose default was not timed keeps `uniform`."""
    known = [c for c in costs.values() if c is not None]
    if not known:
        return {t: uniform for t in costs}
    bar = LIGHT_SHARE * sum(known) / len(costs)
    return {t: min(uniform, LIGHT_FIRST_ROUND) if c is not None and c < bar else uniform for t, c in costs.items()}


def ranked_first_round(uniform: int, share: float) -> int:
    """A task's first round when the central cost model ranks it (sampling.ValidReplay: the model's best of a
    pool several times the round, trained on other jobs' records): `share` of the even round (first_round_size),
    never under LIGHT_FIRST_ROUND nor over the even round. A ranked round's best lands where a random round about
    twice its size does (docs/time_to_quality.md, "How small a ranked first round can be"), so the trials it
    leaves go to evolutionary rounds, which the warm job reaches sooner."""
    return min(uniform, max(LIGHT_FIRST_ROUND, math.ceil(uniform * share)))


def first_round_order(costs: dict[str, float | None], order: list[str]) -> list[str]:
    """A shard's tasks in the order their first rounds go: the largest cost to the untuned model first (weight x
    default seconds), so the tasks the user waits on are measured first; a task whose default was not timed
    goes first (nothing is known of it); ties keep `order` (the partition's FLOPs order)."""
    rank = {t: i for i, t in enumerate(order)}
    return sorted(order, key=lambda t: (-(math.inf if costs.get(t) is None else costs[t]), rank[t]))


HEAD_SHARE = 0.5  # of the untuned model's latency: the tasks holding it have their first rounds served first


def head_tasks(costs: dict[str, float | None]) -> set[str]:
    """The costliest tasks that together hold HEAD_SHARE of the untuned model's latency (`costs`: task -> weight x
    default seconds, None where untimed; the timed ones count). Their first rounds' messages go ahead of every
    other round's in the builders' and lanes' queues (round_priority's `head`): four clients start at once, and
    in arrival order the task the user waits on most is built behind the others' first rounds."""
    known = sorted(((c, t) for t, c in costs.items() if c), key=lambda ct: -ct[0])
    total, held, out = sum(c for c, _ in known), 0.0, set()
    for c, t in known:
        if held >= HEAD_SHARE * total:
            break
        out.add(t)
        held += c
    return out


def first_rounds_reserve(job_task_ids: list[str], had_round: set[str], first_round: int | dict[str, int]) -> int:
    """Trials a second round must leave in the budget: a first round for every task of the job that has
    not had one yet, in any shard (rule 1 across clients: a client done with its first rounds must not spend
    what another client's first rounds still need). `first_round`: one size for all, or each task's."""
    size = first_round.get if isinstance(first_round, dict) else (lambda tid: first_round)
    return sum(size(tid) or 0 for tid in job_task_ids if tid not in had_round)


def gradient(history: list[float], weight: float, alpha: float = ALPHA, window: int = WINDOW,
             stalled: float = 1.0, stalled_rounds: int | None = None, floor: float = 0.0, reach: float = 1.0) -> float:
    """MetaSchedule's task gradient: how much the weighted latency of a task is expected to fall with
    its next round. A task with no round yet comes first (+inf); a task with no valid result last.
    `stalled`: what the forward term (best / rounds) of a task whose last `stalled_rounds` rounds (`window` when
    None) gained nothing is worth (1: MetaSchedule's rule, which keeps a large kernel that stopped improving near
    the top). A task's first round is one of them: at a few hundred trials a heavy task has three or four rounds in
    all, so three flat rounds come too late to matter. `floor`: the seconds no kernel goes under (the lanes'
    launch floor, defaults.launch_floor); the forward term counts what is above it, so a 2.8 us reduction with a
    2.7 us floor has next to nothing left to gain (MetaSchedule's rule, floor 0, gave efficientnet-mbconv's `mean`
    98 of a 384-trial job on an H100, for 0.05 us). `reach` (default_reach) weighs the forward term of a task
    whose default schedule is still faster than anything its search found."""
    n = len(history)
    if n == 0:
        return math.inf
    best = history[-1]
    if best >= 1e9:
        return -1e9
    g1 = (history[n - 1 - window] - best) / window if n >= 1 + window else 0.0
    g2 = max(best - floor, 0.0) / n * reach
    flat = window if stalled_rounds is None else stalled_rounds
    if n >= 1 + flat and history[n - 1 - flat] <= best:
        g2 *= stalled
    return (alpha * g1 + (1 - alpha) * g2) * weight


def flops_shares(tasks: list[JobTask]) -> dict[str, float]:
    total = sum(max(t.flops, 1.0) * t.weight for t in tasks) or 1.0
    return {t.task_id: max(t.flops, 1.0) * t.weight / total for t in tasks}


def behind(task_id: str, shares: dict[str, float], trials: dict[str, int]) -> bool:
    """Whether a task with >= 1 % of the job's FLOPs must go before the gradient's choice: the gradient
    alone (best latency / rounds) lets a tiny task absorb the budget (its latency keeps falling in
    relative terms, and a heavy task with a failed first batch scores -1e9). Such a task goes first while it
    has fewer trials than a task under 0.1 %; it still ends when its space is spent. A wider lead (a batch
    ahead) would put every heavy task first until the budget of a model with a few heavy tasks is spent,
    in whatever order rounds come up, and leave the gradient nothing to order."""
    if shares.get(task_id, 0.0) < HEAVY:
        return False
    most_light = max((trials.get(t, 0) for t, s in shares.items() if s < LIGHT), default=None)
    return most_light is not None and trials.get(task_id, 0) < most_light


def priority(history: list[float], weight: float, is_behind: bool, stalled: float = 1.0,
             stalled_rounds: int | None = None, floor: float = 0.0, reach: float = 1.0) -> float:
    """What orders the next round job-wide: a heavy task left behind first, then the gradient."""
    return math.inf if is_behind else gradient(history, weight, stalled=stalled, stalled_rounds=stalled_rounds,
                                               floor=floor, reach=reach)


def default_reach(default_s: float | None, searched_s: float | None, floor: float = 0.0) -> float:
    """How much of the way from the launch floor to its default schedule a task's search has come: (default -
    floor) / (searched best - floor) while the default is the faster, else 1. A task whose every searched schedule
    is far slower than its default is unlikely to beat it in its next round, though its default's time above the
    floor looks like room to gain: efficientnet-mbconv's squeeze-excite GEMV took 33-42 trials in five runs on two
    cards and none beat its 5.9 us default (best 6.4-9.7); regnety-stage's four such tasks took 91-170 of a
    384-trial job (docs/time_to_quality.md, "Where it stands")."""
    if not default_s or not searched_s or searched_s <= default_s or default_s <= floor:
        return 1.0
    return (default_s - floor) / (searched_s - floor)


def next_task(order: list[str], priorities: dict[str, float], in_flight: set[str]) -> str:
    """The task whose next round a client searches: the one of highest priority (first in `order` on a tie)
    among those whose last batch has come back, or among all of them when every batch is still measured.
    A task still measured waits while another's has landed, so a client keeps the builders and lanes fed
    instead of blocking on one round's last candidates."""
    ready = [t for t in order if t not in in_flight]
    return max(ready or order, key=lambda t: priorities[t])


@dataclass
class Steering:
    """A client's rule for sharing one job-wide budget: run its best task's next round when that task is
    among the `per_shard` x (live shards) best tasks of the whole job and its gradient is at least `min_share`
    of the largest finite gradient among the other live shards' tasks; otherwise wait for those to lower their
    gradients. Ranking alone lets a tiny task in: a model with a few heavy tasks and many light ones has fewer
    unfinished tasks than the ranks allow, so every client would spend the budget on its light tasks while
    the heavy ones are being measured. The owner of the job's best task always proceeds, so clients never wait on
    each other in a circle; `max_wait_s` bounds a wait on figures that stopped changing (it must outlast a
    heavy task's round: search, builds and timing). `stalled` weighs the forward term of a task whose last
    `stalled_rounds` rounds gained nothing (gradient's; TunerSettings.stalled_task_weight, stalled_task_rounds).
    `prorata`: a later round of a task that ranks below the other shards' top gets that share of a full round
    (round_size; TunerSettings.prorata_rounds). `floor_s`: the lanes' launch floor the gradients count from
    (gradient's `floor`; set once the job's defaults are timed, with TunerSettings.latency_floor). `reach`: a task's
    forward term is weighed by how close its search has come to its default schedule (default_reach;
    TunerSettings.default_reach)."""

    per_shard: int = 2
    min_share: float = 0.25
    max_wait_s: float = 60.0
    stalled: float = 1.0
    stalled_rounds: int = WINDOW
    prorata: bool = False
    floor_s: float = 0.0
    reach: bool = False

    def round_size(self, full: int, mine: float | None, top: float | None) -> int:
        """A later round's trials for a task let run at priority `mine` while `top` led the other shards: `full`,
        or with `prorata` full x mine / top, at least PRORATA_MIN. Several clients run rounds at once, so a task a
        quarter as promising as the top one would otherwise take as many trials (on one H100 efficientnet-mbconv's
        `mean`, 0.18 % of its FLOPs, took a whole round of 64 of the 124 left after the first rounds)."""
        if not self.prorata or mine is None or top is None or math.isinf(top) or not 0 < mine < top:
            return full
        return max(min(full, PRORATA_MIN), math.ceil(full * mine / top))

    def may_run(self, mine: float, others: list[float], live_shards: int) -> bool:
        if math.isinf(mine) and mine > 0:
            return True
        ahead = sum(1 for g in others if g > mine)
        if ahead >= self.per_shard * max(1, live_shards):
            return False
        return mine >= self.min_share * (self.top(others) or 0.0)

    @staticmethod
    def top(others: list[float]) -> float | None:
        """The largest finite positive priority among `others` (+inf: a task yet to have a round or left behind,
        and -1e9: one without a valid result, are no measure of what a round pays); None where there is none."""
        return max((g for g in others if 0 < g < math.inf), default=None)


PRORATA_MIN = 8  # the smallest later round a pro-rata share gives a task (LIGHT_FIRST_ROUND's reasoning)
MIN_HOLD_S = 5.0  # a client searches a shard it took at least this long before it takes turns again


def turn_to_take(own_job: str, running: dict[str, int], waiting: list[tuple[str, int, float]], held_s: float,
                 quantum_s: float, passed: bool, blocked: bool, owing: set[int] | None = None,
                 loads: dict[str, float] | None = None) -> tuple[str, int] | None:
    """The waiting shard a client should hand its shard back for, or None to keep searching.

    `running`: how many of each job's shards clients hold; `waiting`: (job, shard, seconds waited) of the
    shards no client holds. Jobs share the clients: the waiting job with the fewest clients (the longest
    waiting among equals) gets this one when this client's job has two more than it (after `MIN_HOLD_S`:
    a job submitted while every client is busy starts within a round or so), or one more once the client has
    held its shard for `quantum_s` (more jobs than clients: they take turns). Within its own job a client
    takes turns only once each task of its shard has had a round (`passed`): at once when its shard can
    measure nothing more (`blocked`) and the waiting shard is one of `owing` (its tasks still owe the first
    rounds that block it; None: any), else after the quantum. A blocked client never hands its shard to one
    that would be as blocked: every such hand-over costs a resume and relieves nothing. With `loads` (each
    running job's share as TunerSettings.fair_measure counts it, SHARETUNE_FAIR_CLIENTS) a client whose job is over
    an equal share also hands its shard, after the quantum, to a job under one that holds no more clients (lagging)."""
    others = [w for w in waiting if w[0] != own_job]
    if others and held_s > MIN_HOLD_S:
        job, shard = neediest(running, others)
        mine, theirs = running.get(own_job, 1), running.get(job, 0)
        if mine > theirs + 1 or (held_s > quantum_s and mine > theirs):
            return job, shard
    if others and loads and held_s > quantum_s:
        behind = lagging(own_job, running, others, loads)
        if behind is not None:
            return behind
    own = sorted((w for w in waiting if w[0] == own_job), key=lambda w: -w[2])
    if own and passed and held_s > quantum_s:
        return own[0][0], own[0][1]
    own = [w for w in own if owing is None or w[1] in owing]
    if own and passed and blocked:
        return own[0][0], own[0][1]
    return None


def neediest(running: dict[str, int], waiting: list[tuple[str, int, float]]) -> tuple[str, int]:
    """Of the waiting shards (job, shard, seconds waited), the one a free client takes: its job holds the fewest
    clients, and among equals it has waited longest. `waiting` must not be empty."""
    job, shard, _ = min(waiting, key=lambda w: (running.get(w[0], 0), -w[2]))
    return job, shard


def lagging(own_job: str, running: dict[str, int], others: list[tuple[str, int, float]],
            loads: dict[str, float]) -> tuple[str, int] | None:
    """The waiting shard of another job a client should take so that the jobs' measurements even out, or None.
    With one client a job, a job measures about as fast as its client's rounds come back (the H100's four-job runs:
    each job's share of the measurements followed its clients' time and its builds' cost). So a job over an equal
    share of the `loads` (with FAIR_SLACK; the trials measured lately or in flight, TunerSettings.fair_measure) gives a
    client to one under it, if that job holds no more clients (the neediest such); its own rounds in flight are
    still measured meanwhile."""
    equal = sum(loads.values()) / max(1, len(loads))
    if equal <= 0 or loads.get(own_job, 0) <= (1 + FAIR_SLACK) * equal:
        return None
    mine = running.get(own_job, 1)
    under = [w for w in others if loads.get(w[0], 0) < (1 - FAIR_SLACK) * equal and running.get(w[0], 0) <= mine]
    return neediest(running, under) if under else None


def owing_first_rounds(shards: list[ShardState], had_round: set[str]) -> set[int]:
    """The shards with a task that has not had its first round (allocation.first_rounds_reserve's debt)."""
    return {sh.shard for sh in shards if any(t not in had_round for t in sh.task_ids)}


def board_of(shards_by_job: dict[str, list[ShardState]], now: float, waited_s: float):
    """(running shards per job, waiting shards as (job, shard, seconds waited)) from every active job's
    shards; a shard counts as waiting once it has waited `waited_s` for a client."""
    from shared.messages import ShardPhase

    running = {job: sum(sh.state == ShardPhase.RUNNING for sh in shs) for job, shs in shards_by_job.items()}
    waiting = [(job, sh.shard, now - sh.queued_at) for job, shs in shards_by_job.items() for sh in shs
               if sh.state == ShardPhase.PENDING and now - sh.queued_at > waited_s]
    return running, waiting


# The message priorities of the broker's Redis transport (kombu: 0, the default, is served first). Builders and
# lanes take a queue's messages in order, so without priorities a job's share of them follows its share of
# the candidates waiting, and the job whose clients send rounds fastest (more tasks a shard, quicker searches)
# crowds out the others.
PRIORITY_STEPS = (0, 3, 6, 9)
FAIR_SLACK = 0.25  # a job within this of an equal share of what is in flight is not held back


def round_priority(mine: float, others: list[float]) -> int:
    """The broker priority of a job's next round while other jobs run: `mine` is this job's count, `others` the
    other active jobs' (TunerSettings.fair_measure: by default the trials each has had measured over the last
    minute or so). A job at or under an equal share (with FAIR_SLACK) goes first (0); one over it, one step back
    per further share over (1.25x: 3, 1.5x: 6, more: 9), so the jobs behind catch up while nothing waits that could
    run (no round is held). Counted in what it has in flight instead, a job with more tasks out at once looks
    further over, and its rounds' waiting behind the others' keeps it there."""
    total = mine + sum(others)
    if not others or total <= 0:
        return 0
    over = mine / (total / (len(others) + 1))
    if over <= 1 + FAIR_SLACK:
        return PRIORITY_STEPS[0]
    return PRIORITY_STEPS[1] if over <= 1.5 else PRIORITY_STEPS[2] if over <= 2 else PRIORITY_STEPS[3]


def message_priority(fair: int, head: bool) -> int:
    """A round's broker priority: its job's fair step (round_priority), and within it a head task's first round
    (head_tasks) one step ahead of the job's other rounds (services.celery_app keeps all ten apart, 0 first)."""
    return fair if head or fair >= PRIORITY_STEPS[-1] else fair + 1

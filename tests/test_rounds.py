"""When a task's search is over: only when its design space is spent, never because one round found
nothing new. Real MetaSchedule search on a CUDA target (no GPU needed to search), fake measurements."""
from __future__ import annotations

import random

import pytest

tvm = pytest.importorskip("tvm")

from services.tuner.metaschedule.intrinsics import load_tensor_intrinsics  # noqa: E402

CUDA = {"kind": "cuda", "arch": "sm_90", "max_threads_per_block": 1024, "max_shared_memory_per_block": 49152,
        "thread_warp_size": 32}


def _task(build, target=None):
    from tvm import relax

    from services.tuner.metaschedule.extract import extract

    bb = relax.BlockBuilder()
    with bb.function("main", build.params):
        with bb.dataflow():
            out = bb.emit_output(build(bb))
        bb.emit_func_output(out)
    (task,) = extract(bb.get(), target or tvm.target.Target(CUDA))
    return task


class _DepthwiseConv:
    """MobileNetV2's depthwise 3x3 conv + ReLU6 (a task with mostly invalid CUDA samples)."""

    def __init__(self):
        from tvm import relax

        self.params = [relax.Var("x", relax.TensorType((1, 96, 56, 56), "float32")),
                       relax.Var("w", relax.TensorType((96, 1, 3, 3), "float32"))]

    def __call__(self, bb):
        from tvm import relax

        x, w = self.params
        y = bb.emit(relax.op.nn.conv2d(x, w, padding=1, groups=96))
        return relax.op.clip(y, 0.0, 6.0)


class _Add:
    """An elementwise task: a handful of schedules in all."""

    def __init__(self):
        from tvm import relax

        self.params = [relax.Var("x", relax.TensorType((4, 8), "float32")),
                       relax.Var("y", relax.TensorType((4, 8), "float32"))]

    def __call__(self, bb):
        from tvm import relax

        return relax.op.add(*self.params)


class _Records:
    """The store's view of measured candidates: keys only."""

    def __init__(self):
        self.measured = {}
        self.progress = {}

    def known(self, wkey, keys):
        return {k: self.measured[k] for k in keys if k in self.measured}


def _loop(task, population, first_round=None, target=None):
    from tvm.s_tir import meta_schedule as ms

    from services.tuner.metaschedule.rounds import SearchParts, Shard, ShardLoop
    from shared.messages import JobTask

    load_tensor_intrinsics("cuda")
    target = target or tvm.target.Target(CUDA)
    job_task = JobTask(task_id="t0", name=task.name, weight=1, wkey="w0", flops=task.flops)

    def make_context(_, cold):
        return ms.TuneContext(
            mod=task.mod, target=target, space_generator="post-order-apply", task_name=task.name, rand_state=0,
            search_strategy="replay-trace" if cold else ms.search_strategy.EvolutionarySearch(population_size=population),
            num_threads=2)

    loop = ShardLoop(Shard(None, "job", 0, [job_task], trials_per_iter=8, max_trials_per_task=1000,
                           first_round=first_round),
                     SearchParts(make_context, None, None, ms.database.MemoryDatabase(), ms.cost_model.RandomModel(),
                                 _Records()))
    return loop, loop.tasks[0], target


def _measure(loop, t, target, fresh):
    """What a lane would do: time the candidates (fake), record them, tell the search."""
    from tvm.s_tir import meta_schedule as ms
    from tvm.s_tir.meta_schedule.runner import RunnerResult

    from services.tuner.metaschedule.records import candidate_key
    from shared.messages import Record

    results = [RunnerResult([random.uniform(1e-5, 1e-4)], None) for _ in fresh]
    t.absorb(fresh, results)
    wl = t.parts.database.commit_workload(t.ctx.mod)
    for c, r in zip(fresh, results):
        t.parts.database.commit_tuning_record(ms.database.TuningRecord(c.sch.trace, wl, r.run_secs, target, c.args_info))
        key = candidate_key(t.job_task.wkey, c)
        loop.records.measured[key] = Record(candidate_key=key, wkey=t.job_task.wkey, trace="", run_secs=r.run_secs,
                                            error=None, target="", args_info=[], share=100)


def test_an_empty_evolutionary_round_on_cuda_does_not_end_the_task():
    """Evolution cannot sample its minimum of valid unmeasured schedules (most CUDA samples fail the GPU
    checks) and comes back empty; the old rule ended the task there. Sampling still finds new ones."""
    loop, t, target = _loop(_task(_DepthwiseConv()), population=16)
    t.restart(cold=False)
    fresh = t.propose(room=8)
    assert fresh == [] and t.dry == 1  # the round the old rule took for an exhausted space
    assert not t.done and t.cold  # the next round samples instead
    fresh = t.propose(room=8)
    assert len(fresh) > 0 and t.dry == 0 and not t.done


def test_a_tiny_space_still_ends_quickly():
    loop, t, target = _loop(_task(_Add()), population=64)
    t.restart(cold=True)
    rounds = 0
    while not t.done:
        rounds += 1
        assert rounds <= 20
        fresh = t.propose(room=8)
        _measure(loop, t, target, fresh)
    assert len(loop.records.measured) < 20  # a handful of schedules, each measured once
    assert t.fixed and rounds == 2  # no sampled decision: the round after its schedules were proposed ends it


def test_first_rounds_share_a_small_budget_evenly():
    from services.tuner.allocation import first_round_size

    assert first_round_size(4, 2, 4) == 2
    assert first_round_size(64, 54, 64) == 1  # every task one candidate before any task a second
    assert first_round_size(256, 54, 64) == 4
    assert first_round_size(20, 54, 64) == 1  # fewer trials than tasks: one each while they last
    assert first_round_size(27 * 64, 27, 64) == 64  # a full round each: the user's round size
    assert first_round_size(10_000, 27, 64) == 64


def test_a_tasks_first_round_measures_its_even_share_then_full_rounds():
    from shared.messages import TaskProgress

    loop, t, target = _loop(_task(_DepthwiseConv()), population=64, first_round=3)
    assert t.room() == 3
    t.restart(cold=True)
    fresh = t.propose(t.room())
    assert len(fresh) == 3
    t.launched(len(fresh), claimed=len(fresh))  # the loop sends the batch
    _measure(loop, t, target, fresh)
    loop.records.progress[t.job_task.task_id] = TaskProgress(task_id="t0", name=t.job_task.name, trials=3)
    assert t.room() == 1000 - 3
    fresh = t.propose(t.room())
    assert 3 < len(fresh) <= 8  # up to trials_per_iter (a sample the store holds is not measured again)


def test_a_round_samples_only_what_it_may_measure():
    """Sampling a valid CUDA schedule costs ~0.3 s of CPU: a first round that measures 3 proposes 3, not the
    job's round size, and the next round proposes the full size again."""
    from shared.messages import TaskProgress

    loop, t, target = _loop(_task(_DepthwiseConv()), population=64, first_round=3)
    t.restart(cold=True, proposes=t.draw_size())
    fresh = t.propose(t.room())
    assert t.drawn == 3 and len(fresh) == 3
    t.launched(len(fresh), claimed=len(fresh))
    _measure(loop, t, target, fresh)
    loop.records.progress[t.job_task.task_id] = TaskProgress(task_id="t0", name=t.job_task.name, trials=3)
    assert t.draw_size() == 8
    assert t.draw_size(room=5) == 5  # the task's last trials, or the job's
    t.restart(cold=True, proposes=t.draw_size())
    fresh = t.propose(t.room())
    assert 3 < t.drawn <= 8 and loop.run_stats.warm_switches == 0  # a resize is not a switch to evolution


def test_a_small_draw_the_store_already_holds_widens_to_full_rounds_without_ending_the_task():
    """A workload an earlier job measured: the first round's small draw finds only known schedules. That is no
    proof of a dry space; the task draws full rounds from then on and still finds new ones."""
    loop, t, target = _loop(_task(_DepthwiseConv()), population=64, first_round=3)
    t.restart(cold=True, proposes=t.draw_size())
    fresh = t.propose(t.room())
    _measure(loop, t, target, fresh)  # what the earlier job measured
    t.restart(cold=True, proposes=3)  # the same draw again (same seed): all of it known
    fresh = t.propose(t.room())
    assert t.drawn == 3 and fresh == [] and t.dry == 0 and not t.done and t.full_draws
    assert t.draw_size(room=3) == 8  # full rounds now
    t.restart(cold=True, proposes=t.draw_size(room=3))
    fresh = t.propose(room=3)
    assert 0 < len(fresh) <= 3


def test_a_second_round_leaves_budget_for_first_rounds_other_clients_still_owe():
    from services.tuner.allocation import first_rounds_reserve

    tasks = [f"t{i}" for i in range(54)]
    assert first_rounds_reserve(tasks, set(tasks), 1) == 0
    assert first_rounds_reserve(tasks, set(tasks[:50]), 1) == 4  # four tasks of another shard not reached yet
    assert first_rounds_reserve(tasks, set(tasks[:50]), 4) == 16


def test_a_space_without_sampled_decisions_is_spent_after_one_round():
    """An elementwise task on a CPU: one schedule and no decision to sample. Its one round proposes it; the
    task is then exhausted at once, not after 5 empty rounds (and says so: fewer trials is no starvation)."""
    cpu = tvm.target.Target({"kind": "llvm", "num-cores": 1})
    loop, t, target = _loop(_task(_Add(), cpu), population=64, target=cpu)
    t.restart(cold=True)
    assert t.fixed
    fresh = t.propose(room=8)
    assert 1 <= len(fresh) <= 8 and t.spent and not t.done
    _measure(loop, t, target, fresh)
    fresh = t.propose(room=8)
    assert fresh == [] and t.done and t.dry == 0


class _Sample:
    """A sampling instruction of a trace (fake): its kind and its choices."""

    def __init__(self, kind: str, choices: int = 0):
        self.kind = type("Kind", (), {"name": kind})()
        self.attrs = [list(range(choices))] if choices else []


class _DrySpace:
    """A design space with a sampled decision (fake; a tiling unless `choices`, then one categorical choice of that
    many): a dry round of a tiled space is no proof that it is spent."""

    def __init__(self, choices: int = 0):
        inst = _Sample("SampleCategorical", choices) if choices else _Sample("SamplePerfectTile")
        self.trace = type("Trace", (), {"decisions": {inst: 0}})()


class _DryContext:
    """A search whose strategies both come back empty, every round."""

    def __init__(self, choices: int = 0):
        self.choices = choices

    def generate_design_space(self):
        return [_DrySpace(self.choices)]

    def pre_tuning(self, *args):
        pass

    def post_tuning(self):
        pass

    def generate_measure_candidates(self):
        return None

    def notify_runner_results(self, candidates, results):
        pass


def test_a_space_of_categorical_choices_is_spent_once_each_schedule_went_out():
    """A batch norm's space samples one thread count of 6: the task is spent when its sixth schedule is sent or
    measured, not after EMPTY_ROUNDS dry rounds of evolution and sampling. A tiled space is not countable."""
    from services.tuner.metaschedule.rounds import SearchParts, SearchState, Shard, ShardLoop
    from services.tuner.metaschedule.task_search import countable_schedules
    from shared.messages import JobTask, TaskProgress

    def task(choices: int, trials: int = 0):
        job_task = JobTask(task_id="t0", name="norm", weight=1, wkey="w0", flops=1.0)
        t = ShardLoop(Shard(None, "job", 0, [job_task], trials_per_iter=8, max_trials_per_task=64),
                      SearchParts(lambda _, cold: _DryContext(choices), None, None, None, None, _Records())).tasks[0]
        if trials:
            t.parts.records.progress["t0"] = TaskProgress(task_id="t0", name="norm", trials=trials)
        t.restart(cold=True)
        return t

    assert countable_schedules([_DrySpace(6), _DrySpace(3)]) == 9
    assert countable_schedules([_DrySpace(6), _DrySpace()]) is None
    first = task(6)
    assert first.schedules == 6 and not first.fixed
    first.launched(5, claimed=5)
    assert not first.done  # one schedule has not gone out
    first.launched(6, claimed=6)
    assert first.state == SearchState.EXHAUSTED
    measured = task(6, trials=6)
    assert measured.propose(room=8) == [] and measured.state == SearchState.EXHAUSTED and measured.dry == 0
    tiled = task(0, trials=6)
    assert tiled.schedules is None and tiled.propose(room=8) == [] and not tiled.done and tiled.dry == 1
    reduction = _loop(_task(_Sum()), population=16)[1]
    reduction.restart(cold=True)
    assert reduction.schedules is not None and reduction.schedules > 8  # thread counts and unrolls, all categorical
    conv = _loop(_task(_DepthwiseConv()), population=16)[1]
    conv.restart(cold=True)
    assert conv.schedules is None


class _Sum:
    """A row sum: every decision of its CUDA spaces is a categorical choice."""

    def __init__(self):
        from tvm import relax

        self.params = [relax.Var("x", relax.TensorType((32, 64), "float32"))]

    def __call__(self, bb):
        from tvm import relax

        return relax.op.sum(self.params[0], axis=[1])


def test_a_tasks_search_moves_through_its_states():
    """SAMPLING while the cost model is cold, EVOLVING once it is trained and knows the task; a dry round makes
    it try the other strategy (and it does not evolve again until a round found something); EMPTY_ROUNDS dry
    rounds in a row end it EXHAUSTED, as does a fixed space once every schedule of it was sent; AT_LIMIT once
    it has no room left."""
    from services.tuner.metaschedule.rounds import EMPTY_ROUNDS, SearchParts, SearchState, Shard, ShardLoop
    from shared.messages import JobTask, TaskProgress

    loop, t, _ = _loop(_task(_DepthwiseConv()), population=16)
    trained = []
    loop.cost_model.trained = lambda: bool(trained)
    assert t.state == SearchState.NEW and not t.done
    t.begin([1e-3], None, cold_start=True)  # a resumed task: it had its first round
    assert t.state == SearchState.SAMPLING and t.started and t.best_s == 1e-3
    t.prepare(8)
    assert t.state == SearchState.SAMPLING  # the model is still cold
    trained.append(True)
    t.prepare(8)
    assert t.state == SearchState.EVOLVING and loop.run_stats.warm_switches == 1
    assert t.propose(room=8) == [] and t.dry == 1  # evolution finds no 16 valid CUDA schedules here
    assert t.state == SearchState.SAMPLING
    t.prepare(8)
    assert t.state == SearchState.SAMPLING  # evolution just came up empty: sample first
    assert t.propose(room=8) and t.dry == 0
    t.prepare(8)
    assert t.state == SearchState.EVOLVING and loop.run_stats.warm_switches == 2

    cpu = tvm.target.Target({"kind": "llvm", "num-cores": 1})
    _, fixed, _ = _loop(_task(_Add(), cpu), population=64, target=cpu)
    fixed.restart(cold=True)
    fresh = fixed.propose(room=8)
    assert fixed.spent and fixed.state == SearchState.SAMPLING
    fixed.launched(len(fresh), claimed=len(fresh))
    assert fixed.state == SearchState.EXHAUSTED and fixed.done

    job_task = JobTask(task_id="t0", name="dry", weight=1, wkey="w0", flops=1.0)
    dry = ShardLoop(Shard(None, "job", 0, [job_task], trials_per_iter=8, max_trials_per_task=16),
                    SearchParts(lambda task, cold: _DryContext(), None, None, None, None, _Records())).tasks[0]
    dry.restart(cold=True)
    states = []
    for _ in range(EMPTY_ROUNDS):
        assert not dry.done and dry.propose(room=8) == []
        states.append(dry.state)
    assert states == [SearchState.EVOLVING, SearchState.SAMPLING] * 2 + [SearchState.EXHAUSTED]
    assert dry.dry == EMPTY_ROUNDS

    limited = ShardLoop(Shard(None, "job", 0, [job_task], trials_per_iter=8, max_trials_per_task=16),
                        SearchParts(lambda task, cold: _DryContext(), None, None, None, None, _Records())).tasks[0]
    limited.parts.records.progress["t0"] = TaskProgress(task_id="t0", name="dry", trials=16)
    assert limited.room() == 0
    limited.finish()
    assert limited.state == SearchState.AT_LIMIT and limited.done


def test_a_task_near_a_launchs_floor_gets_a_small_first_round_and_the_costliest_goes_first():
    from services.tuner.allocation import LIGHT_FIRST_ROUND, first_round_order, first_round_sizes, first_rounds_reserve

    # a depthwise conv at 31 us, two convs, four normalisation kernels at ~3.5 us, one default not timed
    costs = {"dw": 31e-6, "conv": 13e-6, "conv_b": 6e-6, "bn": 3.5e-6, "bn1": 3.4e-6, "bn2": 3.2e-6, "mean": 3.6e-6,
             "odd": None}
    sizes = first_round_sizes(costs, 42)
    # equal share: 63.7 us / 8 tasks = 8 us; under half of it (4 us) is light
    assert {t for t, n in sizes.items() if n == LIGHT_FIRST_ROUND} == {"bn", "bn1", "bn2", "mean"}
    assert sizes["dw"] == sizes["conv"] == sizes["conv_b"] == sizes["odd"] == 42
    assert first_round_sizes(costs, 5)["bn"] == 5  # never more than the even share
    assert first_round_sizes({"a": None, "b": None}, 42) == {"a": 42, "b": 42}  # nothing timed: even shares
    assert first_round_sizes({"a": 4e-6, "b": 4.1e-6}, 42) == {"a": 42, "b": 42}  # equal tasks: none is light
    # the reserve counts each task's own first round
    assert first_rounds_reserve(list(costs), {"dw", "conv"}, sizes) == 42 * 2 + 8 * 4
    # first rounds: the costliest to the untuned model first, an untimed one before all, ties in the given order
    order = ["conv", "bn", "odd", "dw", "mean", "conv_b", "bn1", "bn2"]
    assert first_round_order(costs, order) == ["odd", "dw", "conv", "conv_b", "mean", "bn", "bn1", "bn2"]
    assert first_round_order({}, ["b", "a"]) == ["b", "a"]


def test_first_round_sizes_are_fixed_once_every_tasks_default_is_in_the_store(redis_conn):
    """Each client times its own shard's defaults: until the store holds them all, a first round drawn is judged
    against the defaults timed so far (a task whose own default is untimed gets the even share); once they are
    all in, the sizes are fixed, the same for every client."""
    import uuid

    from shared import store
    from shared.messages import DefaultTiming
    from services.tuner.allocation import LIGHT_FIRST_ROUND
    from services.tuner.metaschedule.job_wide import FirstRounds
    from services.tuner.metaschedule.loop_parts import Shard
    from shared.messages import JobTask

    job = "firstrounds-" + uuid.uuid4().hex[:8]
    tasks = [JobTask(task_id=f"t{i}", name=f"task{i}", weight=w, wkey=f"{job}-w{i}", flops=1.0)
             for i, w in enumerate((1, 1, 3))]
    store.put_tasks(redis_conn, job, tasks, {})
    shard = Shard(redis=redis_conn, job_id=job, shard=0, tasks=tasks, trials_per_iter=64, max_trials_per_task=1000,
                  first_round=40)
    rounds = FirstRounds(shard)
    store.put_default(redis_conn, DefaultTiming(wkey=tasks[0].wkey, run_secs=[30e-6]))
    store.put_default(redis_conn, DefaultTiming(wkey=tasks[1].wkey, run_secs=[3e-6]))
    assert rounds.sizes() is None and rounds.size("t2") == 40  # t2's default is not timed yet
    assert rounds.size("t1") == LIGHT_FIRST_ROUND and rounds.size("t0") == 40  # 3 us against 30: light already
    assert rounds.head() == {"t0"}  # from what is timed so far
    # t2 weighs 3 x 3 us: 9 of 42 us, not under half an equal share (7 us); t1's 3 us is
    store.put_default(redis_conn, DefaultTiming(wkey=tasks[2].wkey, run_secs=[3e-6]))
    assert rounds.sizes() == {"t0": 40, "t1": LIGHT_FIRST_ROUND, "t2": 40}
    assert rounds.head() == {"t0"}  # 30 of 42 us: its first round's messages go ahead


def test_first_round_sizes_count_from_the_launch_floor_when_asked_and_wait_for_it(redis_conn):
    """With the floor's store key, a task's cost is its default's time above the launch floor: with a 3.6 us floor
    efficientnet-mbconv's 5.6 us tasks are light beside its 31 us convolution, where counted from zero they took
    the even share; the sizes wait for the floor as for a default, and a task at the floor is light, not untimed."""
    import uuid

    from shared import store
    from shared.messages import DefaultTiming, JobTask
    from services.tuner.allocation import LIGHT_FIRST_ROUND, first_round_order, first_round_sizes
    from services.tuner.metaschedule.job_wide import FirstRounds
    from services.tuner.metaschedule.loop_parts import Shard

    job = "floorrounds-" + uuid.uuid4().hex[:8]
    defaults = {"conv1": 31e-6, "conv4": 13.4e-6, "conv3": 10.1e-6, "se": 5.6e-6, "conv": 5.6e-6, "bn": 4.4e-6,
                "bn1": 4.0e-6, "bn2": 3.9e-6, "mean": 3.5e-6}  # its nine tasks' defaults on an H200
    tasks = [JobTask(task_id=n, name=n, weight=1, wkey=f"{job}-{n}", flops=1.0) for n in defaults]
    store.put_tasks(redis_conn, job, tasks, {})
    shard = Shard(redis=redis_conn, job_id=job, shard=0, tasks=tasks, trials_per_iter=64, max_trials_per_task=1000,
                  first_round=42)
    for t in tasks:
        store.put_default(redis_conn, DefaultTiming(wkey=t.wkey, run_secs=[defaults[t.name]]))
    plain, floored = FirstRounds(shard), FirstRounds(shard, floor_wkey=f"launch-floor:{job}")
    assert {t for t, n in plain.sizes().items() if n == LIGHT_FIRST_ROUND} == {"bn", "bn1", "bn2", "mean"}
    assert floored.sizes() is None  # every default is in, the floor is not: not fixed yet
    store.put_default(redis_conn, DefaultTiming(wkey=f"launch-floor:{job}", run_secs=[3.6e-6]))
    assert floored.costs()["mean"] == 0.0 and floored.costs()["se"] == pytest.approx(2.0e-6)
    assert {t for t, n in floored.sizes().items() if n == LIGHT_FIRST_ROUND} == {"se", "conv", "bn", "bn1", "bn2",
                                                                                 "mean"}
    assert floored.sizes()["conv1"] == floored.sizes()["conv3"] == 42
    # a cost of 0 is a task at the floor: light, and last in the order, never taken for an untimed one
    assert first_round_sizes({"a": 0.0, "b": 9e-6}, 42) == {"a": LIGHT_FIRST_ROUND, "b": 42}
    assert first_round_order({"a": 0.0, "b": 9e-6, "c": None}, ["a", "b", "c"]) == ["c", "b", "a"]
    # a floor that could not be timed is kept as a failed timing: the sizes stop waiting and count from zero
    other = FirstRounds(shard, floor_wkey=f"launch-floor:{job}-none")
    store.put_default(redis_conn, DefaultTiming(wkey=f"launch-floor:{job}-none", error="no launch floor: x"))
    assert other.sizes() == plain.sizes()


def test_a_ranked_first_round_is_a_share_of_the_even_one_never_under_a_light_tasks():
    from services.tuner.allocation import LIGHT_FIRST_ROUND, ranked_first_round

    assert ranked_first_round(64, 0.5) == 32
    assert ranked_first_round(64, 0.3) == 20  # rounded up
    assert ranked_first_round(12, 0.5) == LIGHT_FIRST_ROUND
    assert ranked_first_round(5, 0.5) == 5  # never over the even round
    assert ranked_first_round(64, 1.0) == 64


class _Model:
    def __init__(self, trained: bool):
        self.is_trained = trained

    def trained(self) -> bool:
        return self.is_trained


def test_whether_a_jobs_first_rounds_are_ranked_is_decided_once_by_its_first_client(redis_conn, tmp_path):
    """A CUDA job started while the central model is trained sizes its first rounds at the ranked share; a client
    that starts later (or resumes) sizes them alike whatever the model says then. A CPU job, a pool of 1 or a
    share of 1 keeps the even round and records no decision."""
    import uuid

    from shared import store
    from shared.messages import JobSpec
    from shared.settings import TunerSettings
    from services.tuner.search import ShardJob, first_round_of

    settings = TunerSettings(work_dir=str(tmp_path))

    def job(target: str) -> ShardJob:
        spec = JobSpec(job_id=f"ranked-{uuid.uuid4().hex[:8]}", target=target, trials=384, trials_per_iter=64)
        store.create_job(redis_conn, spec, b"not a model: never read")
        return ShardJob(spec.job_id, 0, spec, None, [], {}, 64)

    warm = job("cuda")
    assert first_round_of(redis_conn, warm, settings, _Model(True)) == 32
    assert first_round_of(redis_conn, warm, settings, _Model(False)) == 32  # a second client: the same decision
    assert store.job_hash(redis_conn, warm.job_id).ranked_first_rounds is True
    cold = job("cuda")
    assert first_round_of(redis_conn, cold, settings, _Model(False)) == 64
    assert first_round_of(redis_conn, cold, settings, _Model(True)) == 64  # trained since: still the job's even round
    assert store.job_hash(redis_conn, cold.job_id).ranked_first_rounds is False
    cpu = job("llvm")
    assert first_round_of(redis_conn, cpu, settings, _Model(True)) == 64
    for off in (TunerSettings(work_dir=str(tmp_path), ranked_first_round_share=1.0),
                TunerSettings(work_dir=str(tmp_path), first_round_pool=1)):
        other = job("cuda")
        assert first_round_of(redis_conn, other, off, _Model(True)) == 64
        assert store.job_hash(redis_conn, other.job_id).ranked_first_rounds is None
    assert store.job_hash(redis_conn, cpu.job_id).ranked_first_rounds is None


def test_a_round_ahead_proposes_none_of_the_tasks_candidates_still_in_flight():
    """Searched before the task's batch lands: the draw's schedules in flight are not proposed again, a draw that
    finds only them does not count as dry, and the task's room counts them as spent."""
    loop, t, target = _loop(_task(_DepthwiseConv()), population=64, first_round=3)
    t.restart(cold=True, proposes=3)
    fresh = t.propose(t.room())
    t.launched(len(fresh), claimed=len(fresh))
    t.pending_add(fresh)  # what the loop does with rounds ahead
    assert t.room() == 1000 - len(fresh)
    t.restart(cold=True, proposes=3)  # the same draw again (same seed): all of it in flight
    assert t.propose(t.room()) == [] and t.dry == 0 and not t.done and not t.full_draws
    t.pending_drop(fresh)  # the batch landed
    assert t.room() == 1000


def test_a_round_ahead_goes_to_the_task_with_fewest_in_flight_then_the_largest_gradient_once_all_wait():
    from services.tuner.metaschedule.rounds import InFlight, SearchParts, Shard, ShardLoop
    from shared.messages import JobTask

    tasks = [JobTask(task_id=f"t{i}", name=f"n{i}", weight=1, wkey=f"w{i}", flops=1.0) for i in range(3)]
    loop = ShardLoop(Shard(None, "job", 0, tasks, trials_per_iter=8, max_trials_per_task=64),
                     SearchParts(None, None, None, None, None, None), rounds_ahead=1)
    loop.picker.priorities = lambda: ({}, {"t0": 1.0, "t1": 3.0, "t2": 2.0}.get)
    for t in loop.tasks:
        t.started = True

    def waiting():
        return InFlight([], [], [_Pending()], 8)

    loop.flights = {t.task_id: [waiting()] for t in loop.tasks}
    assert loop._ahead() is None  # no round of theirs back yet: a round ahead would be a blind draw
    for t in loop.tasks:
        t.landed = 1
    loop.flights = {"t0": [waiting()], "t1": [waiting()]}
    assert loop._ahead() is None  # t2 is ready: the picker's turn, as without rounds ahead
    loop.flights["t2"] = [waiting()]
    assert loop._ahead().task_id == "t1"  # every task waits: the largest gradient
    loop.flights["t1"].append(waiting())
    assert loop._ahead().task_id == "t2"  # the fewest rounds in flight first
    loop.flights["t0"].append(waiting())
    loop.flights["t2"].append(waiting())
    assert loop._ahead() is None  # each at its limit: the picker waits for a batch
    loop.flights = {"t0": [waiting()], "t1": [waiting()], "t2": [waiting()]}
    loop.rounds_ahead = 0
    assert loop._ahead() is None  # off: a task waits for its batch


class _Pending:
    def __init__(self):
        self.landed = False

    def done(self):
        return self.landed

    def result(self):
        from tvm.s_tir.meta_schedule.runner import RunnerResult

        return RunnerResult([1e-5], None)


class _Lanes:
    """Builds every candidate and measures nothing until told: each batch stays in flight."""

    def __init__(self):
        self.futures = []

    def build(self, inputs):
        from tvm.s_tir.meta_schedule.builder import BuilderResult

        return [BuilderResult(f"a{len(self.futures)}-{i}", None) for i in range(len(inputs))]

    def run(self, inputs):
        fs = [_Pending() for _ in inputs]
        self.futures += fs
        return fs


class _Budget:
    def left(self):
        return 1000

    def reserve(self, tasks):
        return 0

    def claim(self, n, first_round_of=None):
        return n


def test_a_round_ahead_is_sent_while_the_first_is_in_flight_and_both_are_joined_in_order():
    """The loop's own steps, deterministic (real sampling, fake lanes): a round ahead goes out while the task's
    batch is measured, with none of its candidates, at most rounds_ahead of them; both batches are joined in the
    order sent, and then nothing is pending."""
    from types import SimpleNamespace

    from services.tuner.metaschedule.records import candidate_key

    loop, t, _ = _loop(_task(_DepthwiseConv()), population=64)
    lanes, joined = _Lanes(), []
    loop.builder = loop.runner = lanes
    loop.budget, loop.rounds_ahead = _Budget(), 1
    loop.cost_model = SimpleNamespace(update_rows=lambda ctx, cands, results, brief: None)
    loop.records.record_round = lambda ctx, cands, built, results, claimed: joined.append(len(cands))
    loop.picker.priorities = lambda: ({}, lambda tid: 1.0)
    t.may_evolve = lambda: False  # sampling rounds (the random model is never trained)
    t.restart(cold=True)
    t.started, t.landed = True, 1  # its first round came back
    assert loop._round(t) and len(loop.flights["t0"]) == 1
    first = {candidate_key("w0", c) for c in loop.flights["t0"][0].candidates}
    assert loop._ahead() is t
    assert loop._round(t, ahead=True) and len(loop.flights["t0"]) == 2 and loop.run_stats.ahead_rounds == 1
    second = {candidate_key("w0", c) for c in loop.flights["t0"][1].candidates}
    assert second and not first & second and t.pending == first | second
    assert loop._ahead() is None  # one round ahead at most
    for f in lanes.futures:
        f.landed = True
    loop._touch()
    assert joined == [len(first), len(second)] and "t0" not in loop.flights and t.pending == set() and t.landed == 3
    # the round log: both later rounds of the task, what they claimed, no picker figures for a round ahead
    log = loop.run_stats.round_log
    assert [(r[1], r[2], r[3]) for r in log] == [(t.job_task.name, len(first), 0), (t.job_task.name, len(second), 0)]
    assert log[1][4:6] == [None, None] and log[0][0] <= log[1][0]
    assert [r[7] for r in log] == ["drawn", "drawn"] and all(r[9] >= r[2] for r in log)
    # a search that finds nothing new sends nothing, and is logged with what it cost
    t.propose, t.last_search = (lambda room: []), ["evolved", 8.9, 0]
    assert loop._round(t) and "t0" not in loop.flights
    assert [log[-1][i] for i in (1, 2, 3)] == [t.job_task.name, 0, 0] and log[-1][7:] == ["evolved", 8.9, 0]


def test_a_client_takes_turns_within_its_job_only_after_a_round_of_its_own_unless_blocked():
    """A resumed shard's tasks have all had their first rounds, but on a loaded host its search can outlast the
    quantum: handed back before a round, two clients passed two shards to each other with nothing measured."""
    from services.tuner.metaschedule.rounds import SearchParts, Shard, ShardLoop
    from shared.messages import JobTask

    asked = []
    loop = ShardLoop(Shard(None, "job", 0, [JobTask(task_id="t0", name="n", weight=1, wkey="w", flops=1.0)],
                           trials_per_iter=8, max_trials_per_task=64),
                     SearchParts(None, None, None, None, None, None),
                     check=lambda passed, blocked=False: asked.append((passed, blocked)))
    loop.check(True)
    loop.check(True, blocked=True)  # a shard that can measure nothing more yields at once, round or not
    loop.run_stats.rounds = 1
    loop.check(True)
    loop.check(False)
    assert asked == [(False, False), (True, True), (True, False), (False, False)]


def test_a_first_round_in_flight_holds_neither_the_budget_nor_the_other_clients(redis_conn):
    """A first round another client claimed is not reserved again (its trials left the budget when claimed), and
    until it lands its task ranks by its default schedule's time, not as a task yet to have a round (+inf): the
    job's second rounds start as soon as a task has landed, not after the job's last first round."""
    import math
    import uuid

    from shared import store
    from shared.messages import DefaultTiming, JobTask, ShardState
    from services.tuner.allocation import Steering, gradient
    from services.tuner.metaschedule.job_wide import FirstRounds, JobBudget, RoundPicker
    from services.tuner.metaschedule.loop_parts import Shard, ShardRun

    job = "inflight-" + uuid.uuid4().hex[:8]
    tasks = [JobTask(task_id=f"t{i}", name=f"task{i}", weight=1, wkey=f"{job}-w{i}", flops=1.0) for i in range(4)]
    store.put_tasks(redis_conn, job, tasks, {})
    store.put_shards(redis_conn, job, [ShardState(shard=i, task_ids=[f"t{i}"]) for i in range(4)], 100)
    for t, us in zip(tasks, (40, 30, 25, 20)):  # none under half an equal share: first rounds of 16 each
        store.put_default(redis_conn, DefaultTiming(wkey=t.wkey, run_secs=[us * 1e-6]))
    try:
        shard = Shard(redis=redis_conn, job_id=job, shard=0, tasks=tasks[:1], trials_per_iter=16, max_trials_per_task=100,
                      first_round=16)
        budget, first = JobBudget(shard), FirstRounds(shard)
        assert budget.reserve([]) == 64  # four first rounds of 16 owed
        assert store.claim_trials(redis_conn, job, 0, 16, first_round_of="t0") == 16
        assert store.claim_trials(redis_conn, job, 1, 16, first_round_of="t1") == 16
        assert store.claim_trials(redis_conn, job, 1, 4) == 4  # a later round marks nothing
        assert store.first_rounds_claimed(redis_conn, job) == {"t0", "t1"}
        assert budget.reserve([]) == 32  # t2's and t3's: t1's is claimed, though not measured yet
        store.push_history(redis_conn, job, "t0", 25e-6)  # t0 landed; t1 is still measured
        _, prio = RoundPicker(shard, Steering(), lambda *a, **k: None, ShardRun(), first).priorities()
        assert prio("t0") == gradient([25e-6], 1)
        assert prio("t1") == gradient([30e-6], 1)  # its default stands in until it lands
        assert prio("t2") == prio("t3") == math.inf  # no first round yet: theirs come first
        # first rounds sized from a 30 us floor: t1's cost is 0, its default still stands in (not +inf), as it is
        store.put_default(redis_conn, DefaultTiming(wkey=f"{job}-floor", run_secs=[30e-6]))
        floored = FirstRounds(shard, f"{job}-floor")
        assert floored.costs()["t1"] == 0.0
        _, prio = RoundPicker(shard, Steering(), lambda *a, **k: None, ShardRun(), floored).priorities()
        assert prio("t1") == gradient([30e-6], 1)
        # shard 1's client died with t1's first round in flight: its refund makes t1 owed its first round again
        assert store.refund_claim(redis_conn, job, 1, ["t1"]) == 20
        assert store.first_rounds_claimed(redis_conn, job) == {"t0"} and budget.reserve([]) == 48
        assert store.refund_claim(redis_conn, job, 0, ["t0"]) == 16 and store.first_rounds_claimed(redis_conn, job) == {
            "t0"}  # t0's round came back (it is in the history): not owed again
    finally:
        store.deactivate_job(redis_conn, job)  # not a real job: keep the stack's clients and reaper off it


def test_a_later_round_below_the_top_task_gets_its_pro_rata_share_only_when_asked():
    """With pro-rata rounds, a task the picker let run at an eighth of the other shards' top priority measures
    PRORATA_MIN, not a full round; without, a full round (up to what its search finds)."""
    from types import SimpleNamespace

    from services.tuner.allocation import PRORATA_MIN, Steering

    claimed = {}
    for prorata in (False, True):
        loop, t, _ = _loop(_task(_DepthwiseConv()), population=64)
        loop.builder = loop.runner = _Lanes()
        loop.budget = _Budget()
        loop.cost_model = SimpleNamespace(update_rows=lambda ctx, cands, results, brief: None)
        loop.picker.steering = Steering(prorata=prorata)
        t.per_iter = 32
        t.may_evolve = lambda: False
        t.restart(cold=True)
        t.started, t.landed = True, 1
        loop.run_stats.pick = (1.0, 8.0, 0.0)
        assert loop._round(t)
        claimed[prorata] = loop.run_stats.round_log[-1][2]
        assert loop.run_stats.round_log[-1][4:6] == [1.0, 8.0] and loop.run_stats.pick is None
    assert claimed[True] <= PRORATA_MIN < claimed[False]



def test_a_search_trailing_its_default_is_weighed_only_when_asked(redis_conn):
    """A task's client writes its searched best beside the history (which counts the default too); with
    Steering(reach=True) the job-wide priority of a task whose search trails its default is its gradient weighed by
    default_reach; without it, the gradient alone."""
    import uuid

    from tvm.s_tir.meta_schedule.runner import RunnerResult

    from shared import store
    from shared.messages import DefaultTiming, JobTask, ShardState
    from services.tuner.allocation import Steering, default_reach, gradient
    from services.tuner.metaschedule.job_wide import FirstRounds, RoundPicker
    from services.tuner.metaschedule.loop_parts import Shard, ShardRun
    from services.tuner.metaschedule.rounds import SearchParts, ShardLoop

    job = "reach-" + uuid.uuid4().hex[:8]
    tasks = [JobTask(task_id=f"t{i}", name=f"task{i}", weight=1, wkey=f"{job}-w{i}", flops=1.0) for i in range(2)]
    store.put_tasks(redis_conn, job, tasks, {})
    store.put_shards(redis_conn, job, [ShardState(shard=i, task_ids=[f"t{i}"]) for i in range(2)], 100)
    for t, us in zip(tasks, (5.85, 30.0)):
        store.put_default(redis_conn, DefaultTiming(wkey=t.wkey, run_secs=[us * 1e-6]))
    try:
        shard = Shard(redis=redis_conn, job_id=job, shard=0, tasks=tasks[:1], trials_per_iter=8, max_trials_per_task=64)
        cold_model = type("Cold", (), {"trained": lambda self: False})()
        t = ShardLoop(shard, SearchParts(lambda task, cold: _DryContext(), None, None, None, cold_model,
                                         _Records())).tasks[0]
        t.begin([], 5.85e-6, cold_start=True)
        t.absorb([None, None], [RunnerResult([9.1e-6], None), RunnerResult([8.8e-6], None)])
        assert t.best_s == 5.85e-6 and t.searched_s == pytest.approx(8.8e-6)  # the default stands; the search's kept
        t.publish_best()
        assert store.history(redis_conn, job)["t0"] == [5.85e-6]
        assert store.searched(redis_conn, job) == {"t0": t.searched_s}
        first = FirstRounds(shard)
        for reach in (False, True):
            steering = Steering(reach=reach, floor_s=3.98e-6)
            _, prio = RoundPicker(shard, steering, lambda *a, **k: None, ShardRun(), first).priorities()
            weight = default_reach(5.85e-6, t.searched_s, 3.98e-6) if reach else 1.0
            assert prio("t0") == pytest.approx(gradient([5.85e-6], 1, floor=3.98e-6, reach=weight))
        assert weight < 0.5
    finally:
        store.deactivate_job(redis_conn, job)

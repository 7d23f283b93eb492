"""Screened timing: a candidate is timed briefly and gets the full timing only under its bar (its task's best
so far plus a margin); no task's reported or exported best is a brief figure; the cost model weighs brief
rows less. Real TVM builds and timings on this CPU where a lane would time."""
from __future__ import annotations

import pytest

tvm = pytest.importorskip("tvm")


@pytest.fixture(scope="module")
def built():
    from services.measurer.metaschedule.build import build, trivial_kernel
    from services.measurer.metaschedule.targets import cpu_target

    target = cpu_target(1)
    mod = trivial_kernel(target)
    from tvm.s_tir.meta_schedule.arg_info import ArgInfo

    from services.tuner.metaschedule.lane_runner import _plain

    args = [_plain(a.as_json()) for a in ArgInfo.from_prim_func(mod["main"])]
    return build(mod, target), target, args


def _cand(args, bar):
    from shared.messages import Candidate

    return Candidate(candidate_id="c", mod="", args_info=args, full_below_s=bar)


def test_a_candidate_over_its_bar_gets_only_the_brief_timing(built):
    from services.measurer.metaschedule.timing import time_module
    from shared.messages import TimingConfig

    rt, target, args = built
    timing = TimingConfig(number=3, repeat=2, min_repeat_ms=20, brief_ms=2)
    slow = time_module(rt, _cand(args, 1e-12), target, timing)  # no kernel beats a picosecond
    assert slow.error is None and slow.timing == "brief" and 1 <= len(slow.run_secs) <= 3
    near = time_module(rt, _cand(args, 10.0), target, timing)  # well under a 10 s bar
    assert near.timing == "full" and len(near.run_secs) == 2  # the full timing's repeats, nothing else
    unscreened = time_module(rt, _cand(args, None), target, timing)
    assert unscreened.timing == "full" and len(unscreened.run_secs) == 2


def test_the_bar_is_the_best_so_far_plus_the_margin():
    from shared.ranking import SCREEN_MARGIN, screen_bar

    assert screen_bar(None) is None and screen_bar(float("inf")) is None and screen_bar(0.0) is None
    assert screen_bar(2e-6) == pytest.approx(2e-6 * (1 + SCREEN_MARGIN))


def _store(brief_secs, full_secs):
    """A workload with a brief record (`brief_secs`) and a fully timed one (`full_secs`)."""
    from fakes import store_with_records

    return store_with_records([("brief", 8, brief_secs, "brief"), ("full", 4, full_secs, "full")])[0]


class _FullRunner:
    """Times what it is given fully, at the figures it was told (a lane would time them for real)."""

    def __init__(self, secs):
        self.secs, self.asked, self.references = secs, [], []

    def measure_now(self, candidates, one_lane=False):
        from shared.messages import MeasureResult

        self.asked += [c.candidate_id for c in candidates]
        self.references += [c.reference_key for c in candidates]
        assert all(c.full_below_s is None for c in candidates)  # no bar: the full timing
        return {c.candidate_id: MeasureResult(candidate_id=c.candidate_id, run_secs=self.secs, timing="full")
                for c in candidates}


def test_a_brief_best_is_timed_fully_before_it_counts(tmp_path):
    from services.tuner.metaschedule.records import export_json_database, full_timing_of_bests, ranked
    from services.tuner.search import _best_record
    from shared import store

    r = _store([1.0, 1.0, 1.0], [2.0, 2.0, 2.0])
    assert ranked(store.records(r, "w"))[0].candidate_key == "brief"
    assert _best_record(r, "w").candidate_key == "full"  # a brief figure is never the reported best
    runner = _FullRunner([0.5, 0.5, 0.5])
    assert full_timing_of_bests(r, runner, ["w"]) == {"timed": 1, "failed": 0}
    assert runner.asked == ["brief"] and runner.references == ["w"]  # its output checked, as a round's would be
    rec = next(x for x in store.records(r, "w") if x.candidate_key == "brief")
    assert rec.timing == "full" and rec.run_secs == [0.5] * 3 and rec.brief_run_secs == [1.0] * 3
    assert _best_record(r, "w").candidate_key == "brief"
    export_json_database(r, ["w"], str(tmp_path / "db"))
    first = (tmp_path / "db" / "database_tuning_record.json").read_text().splitlines()
    assert len(first) == 2


def test_a_brief_best_that_is_slower_when_timed_fully_leaves_the_next_best(tmp_path):
    from services.tuner.metaschedule.records import full_timing_of_bests
    from services.tuner.search import _best_record
    from shared import store

    r = _store([1.0, 1.0, 1.0], [2.0, 2.0, 2.0])
    unchecked = _FullRunner([3.0, 3.0, 3.0])
    unchecked.check_outputs = False  # TunerSettings.check_outputs off (search.lane_runner sets it)
    assert full_timing_of_bests(r, unchecked, ["w"])["timed"] == 1
    assert unchecked.references == [None]
    assert _best_record(r, "w").candidate_key == "full"
    assert all(x.timing == "full" for x in store.records(r, "w"))


def test_brief_rows_train_with_less_weight():
    import numpy as np

    from services.tuner.updater import BRIEF_WEIGHT, train
    from shared.messages import TrainingRow

    rng = np.random.default_rng(0)
    rows = [TrainingRow(group="g", features=rng.uniform(size=4).tolist(), cost_s=float(c), brief=i % 2 == 1)
            for i, c in enumerate(rng.uniform(1, 2, size=40))]
    assert 0 < BRIEF_WEIGHT < 1
    assert train(rows, rounds=3)  # trains on both kinds of rows


def test_index_arguments_are_filled_within_bounds():
    """A `take` (an embedding's lookup, the transformer's `take` of one of 3 heads) timed with TVM's own fill
    reads far out of bounds (an illegal address on a GPU), and with values up to 7 past an axis of 3 (the
    CPU lane's child segfaulted): integer arguments are zero, in bounds of any axis; floats TVM's fill."""
    from tvm.s_tir.meta_schedule.runner.utils import alloc_argument_common

    from services.measurer.metaschedule.timing import random_fill_fn

    args_info = [["TENSOR", "int64", [4, 16]], ["TENSOR", "int32", [32]], ["TENSOR", "bool", [8]],
                 ["TENSOR", "float32", [64]]]
    idx64, idx32, flags, x = alloc_argument_common(random_fill_fn(), tvm.cpu(), args_info, 1)[0]
    assert not idx64.numpy().any() and not idx32.numpy().any() and not flags.numpy().any()
    assert x.numpy().std() > 0


def test_a_tuners_timing_floor_replaces_only_the_floor_of_its_lane_kinds_timing():
    from services.tuner.search import timing_for

    assert timing_for("llvm").min_repeat_ms == 100 and timing_for("llvm", 20).min_repeat_ms == 20
    gpu = timing_for("cuda", 5)
    assert (gpu.number, gpu.repeat, gpu.min_repeat_ms) == (3, 3, 5)
    assert timing_for("cuda").min_repeat_ms == 50


def test_a_gpu_timing_settles_at_10_ms_unless_the_tuner_says_otherwise():
    from services.tuner.search import timing_for

    assert timing_for("cuda").settle_ms == 10 and timing_for("cuda", settle_ms=0).settle_ms == 0
    assert timing_for("llvm").settle_ms == 0  # a CPU lane's one repeat has nothing to agree with


def test_a_full_timing_keeps_its_short_window_only_where_the_repeats_agree():
    """The decision alone, on given figures: agreeing repeats at settle_ms are kept, disagreeing ones are taken
    again at min_repeat_ms; no settling with one repeat, settle_ms 0, or a settle window not shorter."""
    from services.measurer.metaschedule.timing import full_costs
    from shared.messages import TimingConfig

    def evaluator(figures: dict[int, list[float]]):
        asked = []

        def evaluate(floor_ms, repeat):
            asked.append((floor_ms, repeat))
            return figures[floor_ms][-repeat:]
        return evaluate, asked

    timing = TimingConfig(repeat=3, min_repeat_ms=50, settle_ms=10, settle_spread=0.01)
    # the short window's first repeat (cold, after the lane's pause) is run and dropped
    steady, asked = evaluator({10: [1.3, 1.000, 1.005, 1.002], 50: [9.0, 9.0, 9.0]})
    assert full_costs(steady, timing) == ([1.000, 1.005, 1.002], 10) and asked == [(10, 4)]
    noisy, asked = evaluator({10: [1.0, 1.0, 1.3, 1.0], 50: [1.0, 1.01, 1.0]})
    assert full_costs(noisy, timing) == ([1.0, 1.01, 1.0], 50) and asked == [(10, 4), (50, 3)]
    for plain in (timing.model_copy(update={"settle_ms": 0}), timing.model_copy(update={"repeat": 1}),
                  timing.model_copy(update={"settle_ms": 50})):
        again, asked = evaluator({10: [1.0, 1.0, 1.0, 1.0], 50: [2.0, 2.0, 2.0]})
        assert full_costs(again, plain)[1] == 50 and asked == [(50, plain.repeat)]


def test_a_full_timing_that_cannot_beat_its_tasks_best_keeps_its_short_window():
    """Disagreeing repeats at settle_ms are kept where even the fastest is slower than the task's best; a candidate
    whose fastest repeat beats the best, one with nothing to beat, or the setting off, is taken again at the floor."""
    from services.measurer.metaschedule.timing import full_costs
    from shared.messages import TimingConfig
    from shared.ranking import best_behind, screen_bar

    asked = []

    def evaluate(floor_ms, repeat):
        asked.append(floor_ms)
        return {10: [2.0, 1.2, 1.5, 1.3], 50: [1.1, 1.1, 1.1]}[floor_ms][-repeat:]

    timing = TimingConfig(repeat=3, min_repeat_ms=50, settle_ms=10, settle_spread=0.01)
    assert full_costs(evaluate, timing, best_s=1.15) == ([1.2, 1.5, 1.3], 10) and asked == [10]
    for best_s, t in ((1.25, timing), (None, timing), (1.15, timing.model_copy(update={"settle_above_best": False}))):
        asked.clear()
        assert full_costs(evaluate, t, best_s=best_s) == ([1.1, 1.1, 1.1], 50) and asked == [10, 50]
    assert best_behind(screen_bar(1.15)) == pytest.approx(1.15) and best_behind(None) is None


def test_the_tuner_setting_turns_keeping_short_windows_above_the_best_off():
    from services.tuner.search import timing_for

    assert timing_for("cuda").settle_above_best and not timing_for("cuda", settle_above_best=False).settle_above_best


def test_a_lane_says_at_which_window_it_took_a_full_timing(built):
    """Real timings on this CPU: either window may be kept (how steady this host is), and the result names it."""
    from services.measurer.metaschedule.timing import time_module
    from shared.messages import TimingConfig

    rt, target, args = built
    settled = time_module(rt, _cand(args, None), target, TimingConfig(repeat=3, min_repeat_ms=20, settle_ms=2))
    assert settled.timing == "full" and len(settled.run_secs) == 3 and settled.window_ms in (2, 20)
    plain = time_module(rt, _cand(args, None), target, TimingConfig(repeat=3, min_repeat_ms=20))
    assert plain.window_ms == 20
    brief = time_module(rt, _cand(args, 1e-12), target, TimingConfig(repeat=3, min_repeat_ms=20, settle_ms=2))
    assert brief.timing == "brief" and brief.window_ms is None


def test_a_sent_bar_tightens_to_the_live_best_and_no_bar_stays_none():
    from shared.ranking import SCREEN_MARGIN, live_bar

    assert live_bar(5e-6, 2e-6) == pytest.approx(2e-6 * (1 + SCREEN_MARGIN))  # a better candidate came meanwhile
    assert live_bar(2e-6, 4e-6) == 2e-6  # never looser than the bar it was sent with
    # sent with nothing to beat: screened once the round has a fully timed best
    assert live_bar(None, 1e-6) == pytest.approx(1e-6 * (1 + SCREEN_MARGIN))
    assert live_bar(None, None) is None
    assert live_bar(3e-6, None) == 3e-6


def test_lanes_keep_a_tasks_live_best_and_tighten_the_bars_still_to_come(redis_conn):
    import uuid

    from services.measurer.worker import keep_live_bests, tightened
    from shared import store
    from shared.messages import Candidate, MeasureBatch, MeasureResult
    from shared.ranking import SCREEN_MARGIN

    key = f"livebest-test:{uuid.uuid4().hex[:8]}"

    def batch(*bars):
        return MeasureBatch(batch_id=uuid.uuid4().hex, job_id="livebest-test", target="", candidates=[
            Candidate(candidate_id=f"c{i}", mod="", args_info=[], full_below_s=b, bar_key=key if b else None)
            for i, b in enumerate(bars)])

    first = batch(10e-6, 10e-6)
    assert tightened(redis_conn, first) == first  # nothing measured yet
    keep_live_bests(redis_conn, first, [
        MeasureResult(candidate_id="c0", run_secs=[4e-6, 4e-6, 4e-6], timing="full"),
        MeasureResult(candidate_id="c1", run_secs=[3e-6], timing="brief")])  # a brief figure never counts
    assert store.live_bests(redis_conn, [key]) == {key: pytest.approx(4e-6)}
    keep_live_bests(redis_conn, first, [MeasureResult(candidate_id="c1", run_secs=[6e-6] * 3, timing="full")])
    assert store.live_bests(redis_conn, [key]) == {key: pytest.approx(4e-6)}  # only ever lower
    later = tightened(redis_conn, batch(10e-6, None))
    assert later.candidates[0].full_below_s == pytest.approx(4e-6 * (1 + SCREEN_MARGIN))
    assert later.candidates[1].full_below_s is None  # not screened (no bar key): the full timing, always
    first_round = MeasureBatch(batch_id=uuid.uuid4().hex, job_id="livebest-test", target="", candidates=[
        Candidate(candidate_id="c9", mod="", args_info=[], full_below_s=None, bar_key=key)])
    assert tightened(redis_conn, first_round).candidates[0].full_below_s == pytest.approx(4e-6 * (1 + SCREEN_MARGIN))


def test_measurements_outside_the_search_take_the_whole_floor(redis_conn, lane_share):
    """Re-timing, brief bests and default schedules (measure_now) decide what is exported: no settling there;
    a search round's batch carries the job's timing. Batches captured as the lanes would get them."""
    from services.tuner.metaschedule.lane_runner import BatchRules, CandidateStash, JobLanes, LaneRunner, TimeSplit
    from shared.messages import Candidate, MeasureBatch, TimingConfig

    sent = []
    timing = TimingConfig(repeat=3, min_repeat_ms=50, settle_ms=10)
    runner = LaneRunner(lambda task, payload, queue, priority=0: sent.append(MeasureBatch(**payload)), redis_conn,
                        JobLanes("settle-job", "cpu", lane_share, '{"kind": "llvm"}'), CandidateStash(), TimeSplit(),
                        BatchRules(timing))
    runner.family = ""  # to the lanes, not through builders: the batch is what a lane gets either way
    cand = Candidate(candidate_id="c0", mod="", args_info=[])
    runner.dispatch([cand])
    assert sent and all(b.timing == timing for b in sent)
    asked = []
    runner.dispatch = lambda cands, one_lane=False, ahead=None, timing=None: asked.append(timing) or {}
    assert runner.measure_now([]) == {}
    assert asked[0].settle_ms == 0 and asked[0].min_repeat_ms == 50


def test_the_benches_count_full_timings_by_their_window():
    from sharetune.experiments.throughput import full_windows
    from shared.messages import Record

    def rec(timing="full", window=None, run_secs=(1e-5,), error=None):
        return Record(candidate_key="k", wkey="w", trace="{}", target="cuda", args_info=[], share=100, timing=timing,
                      window_ms=window, run_secs=list(run_secs) if run_secs else None, error=error)

    recs = [rec(window=10), rec(window=10), rec(window=50), rec(), rec("brief"), rec(window=10, run_secs=None, error="x")]
    assert full_windows(recs) == {"10 ms": 2, "50 ms": 1, "-": 1}


def _adds(value: float):
    from tvm import te

    a = te.placeholder((64,), name="a")
    b = te.compute((64,), lambda i: a[i] + value, name="b")
    return tvm.IRModule({"main": te.create_prim_func([a, b])})


def test_a_fully_timed_candidate_whose_output_is_not_its_references_is_a_wrong_result(built):
    """A real build and run on this CPU: the candidate computes a + 1; checked against a reference that computes
    a + 1 it is timed as usual, against one that computes a + 2 it is answered with an error and no timing. A
    briefly timed candidate (it cannot become a best) and one without a reference are not checked."""
    from services.measurer.metaschedule.candidate_codec import dump_ir
    from services.measurer.metaschedule.timing import time_module
    from shared.messages import Candidate, ErrorKind, TimingConfig

    rt, target, args = built
    timing = TimingConfig(number=2, repeat=2, min_repeat_ms=2, brief_ms=1)

    def cand(reference, bar=None):
        return Candidate(candidate_id="c", mod="", args_info=args, full_below_s=bar,
                         reference=dump_ir(reference) if reference is not None else None)

    same = time_module(rt, cand(_adds(1.0)), target, timing)
    assert same.error is None and same.timing == "full" and same.output_checked
    wrong = time_module(rt, cand(_adds(2.0)), target, timing)
    assert wrong.run_secs is None and wrong.error_kind == ErrorKind.RUN
    assert wrong.error.startswith("wrong result: argument 1: differs from the default schedule's output by up to 1")
    brief = time_module(rt, cand(_adds(2.0), bar=1e-12), target, timing)
    assert brief.timing == "brief" and not brief.output_checked
    unchecked = time_module(rt, cand(None), target, timing)
    assert unchecked.error is None and not unchecked.output_checked


def test_outputs_differ_beyond_reordered_sums_or_where_numbers_turn_nan():
    import numpy as np

    from services.measurer.metaschedule.timing import outputs_differ

    ref = np.linspace(-50, 50, 101, dtype="float32")
    assert outputs_differ([ref + 0.04], [ref]) is None  # within 1e-3 of the largest magnitude (50)
    assert "up to 0.1" in outputs_differ([ref + 0.1], [ref])
    nan = ref.copy()
    nan[3] = np.nan
    assert "1 of 101 elements NaN or infinite" in outputs_differ([nan], [ref])
    assert outputs_differ([nan], [nan]) is None  # the reference's own NaN (e.g. log of a negative input)
    half = ref.astype("float16")
    assert outputs_differ([half + np.float16(0.25)], [half]) is None  # 16-bit floats: 1e-2
    assert "2 of 3 elements differ" in outputs_differ([np.array([1, 5, 6])], [np.array([1, 2, 3])])


def test_a_lane_gives_each_candidate_its_stored_reference_and_none_it_lacks(redis_conn):
    import uuid

    from services.measurer.worker import with_references
    from shared import store
    from shared.messages import Candidate, MeasureBatch

    wkey = f"ref-test:{uuid.uuid4().hex[:8]}"
    store.put_reference(redis_conn, wkey, "packed-default")
    store.put_reference(redis_conn, wkey, "another")  # the first one written is kept
    batch = MeasureBatch(batch_id=uuid.uuid4().hex, job_id="ref-test", target="", candidates=[
        Candidate(candidate_id="c0", mod="", args_info=[], reference_key=wkey),
        Candidate(candidate_id="c1", mod="", args_info=[], reference_key=wkey + ":none"),
        Candidate(candidate_id="c2", mod="", args_info=[])])
    got = with_references(redis_conn, batch).candidates
    assert [c.reference for c in got] == ["packed-default", None, None]


def test_the_launch_floor_is_timed_once_per_target_on_the_lanes_and_kept(redis_conn, monkeypatch):
    """defaults.launch_floor: a trivial kernel, scheduled as a task's default is, measured like a candidate; the
    store keeps it, so the next client of any job on that target reads it; a failed timing is no floor."""
    import tvm

    from services.tuner.metaschedule.defaults import launch_floor
    from shared.messages import ErrorKind, MeasureResult

    class Lanes:
        def __init__(self, result):
            self.result, self.asked = result, []

        def measure_now(self, candidates):
            self.asked += candidates
            return {c.candidate_id: self.result(c.candidate_id) for c in candidates}

    target = tvm.target.Target({"kind": "llvm", "num-cores": 3})
    failing = Lanes(lambda cid: MeasureResult(candidate_id=cid, error="run failed: x", error_kind=ErrorKind.RUN))
    assert launch_floor(redis_conn, failing, target) is None and len(failing.asked) == 1
    timed = Lanes(lambda cid: MeasureResult(candidate_id=cid, run_secs=[2.7e-6, 2.8e-6, 2.6e-6]))
    assert launch_floor(redis_conn, timed, target) == pytest.approx(2.7e-6)
    assert timed.asked[0].args_info and timed.asked[0].mod  # a module the lanes build and run like any candidate
    again = Lanes(lambda cid: pytest.fail("timed twice"))
    assert launch_floor(redis_conn, again, target) == pytest.approx(2.7e-6) and not again.asked
    # a floor kernel that cannot be built: no floor, kept as a failed timing (first rounds waiting for it go on)
    from shared import store
    from services.tuner.metaschedule import defaults, lane_runner

    monkeypatch.setattr(lane_runner, "module_candidate", lambda *a: (_ for _ in ()).throw(RuntimeError("no build")))
    other = tvm.target.Target({"kind": "llvm", "num-cores": 5})
    assert launch_floor(redis_conn, again, other) is None and not again.asked
    kept = store.default_timing(redis_conn, defaults.FLOOR_WKEY + str(other))
    assert kept is not None and not kept.run_secs and "no build" in kept.error


def test_the_launch_floor_goes_to_the_lanes_in_the_defaults_batch_when_asked(redis_conn):
    """defaults.measure_defaults(floor=True): where the store has no floor for the target, the floor's kernel joins
    the tasks' defaults in one batch (a client's start waits for one round trip to the lanes, not two); launch_floor
    then reads it from the store; without `floor` the batch holds the defaults alone."""
    import tvm

    from services.tuner.metaschedule.defaults import launch_floor, measure_defaults, floor_module
    from shared.messages import JobTask, MeasureResult

    class Lanes:
        def __init__(self):
            self.batches = []

        def measure_now(self, candidates):
            self.batches.append([c.candidate_id for c in candidates])
            return {c.candidate_id: MeasureResult(candidate_id=c.candidate_id,
                                                  run_secs=[2e-6 if "launch-floor" in c.candidate_id else 9e-6])
                    for c in candidates}

    task = JobTask(task_id="copy", name="copy", weight=1, wkey="wk-floor-batch")
    target = tvm.target.Target({"kind": "llvm", "num-cores": 7})
    lanes = Lanes()
    assert measure_defaults(redis_conn, lanes, [task], {"copy": floor_module()}, target, floor=True) == \
        {"copy": pytest.approx(9e-6)}
    assert len(lanes.batches) == 1 and len(lanes.batches[0]) == 2
    assert launch_floor(redis_conn, lanes, target) == pytest.approx(2e-6) and len(lanes.batches) == 1
    other = tvm.target.Target({"kind": "llvm", "num-cores": 9})
    alone = Lanes()
    measure_defaults(redis_conn, alone, [task.model_copy(update={"wkey": "wk-floor-alone"})], {"copy": floor_module()},
                     other)
    assert alone.batches == [[c for c in alone.batches[0] if "launch-floor" not in c]] and len(alone.batches[0]) == 1

"""Timing a built candidate on its lane's device: arguments filled, screened against its task's best, the
evaluator's figures; and what a lost CUDA context leaves behind. Failures come back as data."""
from __future__ import annotations

import time
from collections import OrderedDict

import tvm
from tvm.s_tir.meta_schedule.runner.config import EvaluatorConfig
from tvm.s_tir.meta_schedule.runner.utils import alloc_argument_common, run_evaluator_common

from services.measurer.metaschedule.candidate_codec import clip_error
from services.measurer.metaschedule.targets import device_for
from shared.messages import Candidate, ErrorKind, MeasureResult, TimingConfig


# Device objects of a CUDA context that a fault ended. They are never freed: freeing one calls into the dead
# context, whose error, thrown from a destructor, aborts the process before its lane can report the fault.
KEPT_AFTER_FAULT: list = []


def cuda_context_alive() -> bool:
    """After an unexplained run error: does this lane's CUDA context still work? (A sticky fault makes
    every later call fail.)"""
    probe = None
    try:
        dev = tvm.cuda(0)
        probe = tvm.runtime.empty((1,), "float32", dev)
        probe.copyfrom(__import__("numpy").zeros(1, "float32"))
        dev.sync()
        return True
    except Exception:  # noqa: BLE001
        KEPT_AFTER_FAULT.append(probe)
        return False


def _host_fill(shape, dtype, rng=None):
    """Floats uniform in [-1, 1) (from `rng`, NumPy's global one by default); integers and booleans zero: an
    integer input may index another (an embedding's `take`, a gather, the transformer's `take` of one of three
    heads), and zero is in bounds of every axis, where any other value may read past a short one."""
    import numpy as np

    shape, dtype = tuple(int(s) for s in shape), str(dtype)
    if dtype.startswith("float"):
        return (rng or np.random).uniform(-1, 1, size=shape).astype(dtype)
    return np.zeros(shape, dtype=dtype)


def _random_fill(arr) -> None:
    arr.copyfrom(_host_fill(arr.shape, arr.dtype))


def random_fill_fn():
    """Floats: TVM's own fill (fast, on the device). Integers and booleans: zeros (_random_fill), because
    TVM's fill spans the whole integer range, and an index tensor filled so reads far out of bounds: an
    illegal address on a GPU, which ends the lane's CUDA context, for every candidate of such a task."""
    f = tvm.get_global_func("tvm.contrib.random.random_fill_for_measure", allow_missing=True)
    if f is None:
        return _random_fill

    def fill(arr) -> None:
        (f if str(arr.dtype).startswith(("float", "bfloat")) else _random_fill)(arr)

    return fill


def time_module(rt_mod, candidate: Candidate, target, timing: TimingConfig) -> MeasureResult:
    """Time a built candidate. With a bar (`candidate.full_below_s`) it is screened first: one launch
    (does it run at all), then about `timing.brief_ms` of kernel time in three repeats; only when their
    median is under the bar does it get the full timing. Without a bar: the full timing."""
    from shared.ranking import best_behind, rank_secs

    t1 = time.perf_counter()
    args = None
    try:
        dev = device_for(target)
        args = alloc_argument_common(random_fill_fn(), dev, candidate.args_info, 1)
        result = "full"
        checked = False
        if candidate.full_below_s is not None:
            costs = brief_costs(rt_mod, dev, args, timing.brief_ms, candidate.full_below_s)
            if rank_secs(costs) >= candidate.full_below_s:
                result = "brief"
        window = None
        if result == "full":
            def evaluate(floor_ms: int, repeat: int) -> list[float]:
                config = EvaluatorConfig(number=timing.number, repeat=repeat, min_repeat_ms=floor_ms,
                                         enable_cpu_cache_flush=False)
                return run_evaluator_common(rt_mod, dev, config, args)

            costs, window = full_costs(evaluate, timing, best_behind(candidate.full_below_s))
            checked, wrong = checked_output(rt_mod, candidate, target, dev)
            if wrong is not None:
                return MeasureResult(candidate_id=candidate.candidate_id, error=f"wrong result: {wrong}",
                                     error_kind=ErrorKind.RUN, run_s=time.perf_counter() - t1)
    except Exception as err:  # noqa: BLE001
        if target.kind.name == "cuda" and not cuda_context_alive():
            KEPT_AFTER_FAULT.extend([args, rt_mod])
        return MeasureResult(candidate_id=candidate.candidate_id, error=f"run failed: {clip_error(err)}",
                             error_kind=ErrorKind.RUN, run_s=time.perf_counter() - t1)
    return MeasureResult(candidate_id=candidate.candidate_id, run_secs=costs, run_s=time.perf_counter() - t1,
                         timing=result, window_ms=window, output_checked=checked)


# a candidate whose module rewrites a weight's layout reads that weight in another layout than the reference
# (the rewrite is removed for timing), so its output is not comparable on random inputs
LAYOUT_REWRITE_MARK = "layout_rewrite_preproc"
REFERENCES_KEPT = 16  # tasks whose reference outputs a lane process keeps (the inputs and outputs, host memory)
_references: OrderedDict = OrderedDict()


def _check_inputs(args_info: list) -> list:
    """The arguments a check runs on, the same for every candidate of a task (_host_fill from a fixed seed)."""
    import numpy as np

    rng = np.random.default_rng(0)
    return [_host_fill(shape, dtype, rng) for _, dtype, shape in args_info]


def _run_on(rt_mod, dev, host: list) -> list:
    """`rt_mod` run once on device copies of `host`; every argument back on the host."""
    arrays = [tvm.runtime.tensor(x, dev) for x in host]
    rt_mod.get_function(rt_mod.entry_name)(*arrays)
    dev.sync()
    return [a.numpy() for a in arrays]


def reference_outputs(packed: str, target, dev, args_info: list) -> tuple[list, list] | None:
    """(the check's inputs, every argument after the reference ran on them) for a task's reference (its
    default-scheduled module, packed), built and run once and kept for the task's next candidates: the reference
    may be a plain loop nest that takes far longer than a tuned kernel. None where it does not build or run (the
    candidate is then timed unchecked)."""
    from services.measurer.metaschedule.build import build
    from services.measurer.metaschedule.candidate_codec import load_ir

    key = (hash(packed), str(target))
    if key not in _references:
        try:
            inputs = _check_inputs(args_info)
            _references[key] = (inputs, _run_on(build(load_ir(packed), target), dev, inputs))
        except Exception:  # noqa: BLE001 - no reference, no check: never a reason to fail a candidate
            if target.kind.name == "cuda" and not cuda_context_alive():
                raise
            _references[key] = None
        while len(_references) > REFERENCES_KEPT:
            _references.popitem(last=False)
    _references.move_to_end(key)
    return _references[key]


def _rewrites_layout(packed: str) -> bool:
    """Whether a candidate's module (packed, shared.packed_json) rewrites a weight's layout; True where it cannot
    be read (then it goes unchecked)."""
    from shared.packed_json import unpack_json_text

    if not packed:
        return False
    try:
        return LAYOUT_REWRITE_MARK in unpack_json_text(packed)
    except Exception:  # noqa: BLE001
        return True


def checked_output(rt_mod, candidate: Candidate, target, dev) -> tuple[bool, str | None]:
    """After a full timing: (whether the candidate's output was compared with its reference's, both run on the same
    fixed inputs; why they differ, or None)."""
    if not candidate.reference or _rewrites_layout(candidate.mod):
        return False, None
    ref = reference_outputs(candidate.reference, target, dev, candidate.args_info)
    if ref is None:
        return False, None
    inputs, want = ref
    try:
        got = _run_on(rt_mod, dev, inputs)
    except Exception:  # noqa: BLE001 - a check that could not run leaves the candidate unchecked, not failed,
        if target.kind.name == "cuda" and not cuda_context_alive():  # unless the GPU context is gone
            raise
        return False, None
    return True, outputs_differ(got, want)


def outputs_differ(got: list, want: list) -> str | None:
    """Why `got` (a candidate's arguments after it ran) is not `want` (the reference's), or None. Floats may
    differ by what summing in another order does: 1e-3 of the largest magnitude (1e-2 for 16-bit floats); a NaN or
    infinity where the reference has a number is a difference; other types must be equal."""
    import numpy as np

    for i, (g, w) in enumerate(zip(got, want)):
        if g.dtype.kind not in "fc":
            if not np.array_equal(g, w):
                return f"argument {i}: {int(np.sum(g != w))} of {g.size} elements differ from the default schedule's"
            continue
        gf, wf = g.astype("float64"), w.astype("float64")
        odd = ~np.isfinite(gf) & np.isfinite(wf)
        if odd.any():
            return (f"argument {i}: {int(odd.sum())} of {g.size} elements NaN or infinite where the default "
                    "schedule's are not")
        both = np.isfinite(gf) & np.isfinite(wf)
        if not both.any():
            continue
        scale = max(1.0, float(np.abs(wf[both]).max()))
        err = float(np.abs(gf[both] - wf[both]).max())
        if err > (1e-2 if g.dtype.itemsize <= 2 else 1e-3) * scale:
            return (f"argument {i}: differs from the default schedule's output by up to {err:.3g} "
                    f"(largest value {scale:.3g})")
    return None


def full_costs(evaluate, timing: TimingConfig, best_s: float | None = None) -> tuple[list[float], int]:
    """A full timing's figures and the floor a repeat they were taken at: `evaluate(floor_ms, repeat)` runs the
    repeats. First at `settle_ms`, kept where the repeats agree within `settle_spread`, or (`settle_above_best`)
    where the fastest is slower than `best_s`, the task's best so far (None: nothing to beat); else again at
    `min_repeat_ms`. A kernel timed steadily needs no longer window: on the H200, kernels of 20 us and more repeat
    within 0.06 % at 50 ms; one that cannot change its task's best is ranked among the rest as well at 10 ms (the
    lane's long windows go to candidates that may be the new best). The short window's first repeat is run and
    dropped: the first after the lane's pause between candidates runs slow (the slowest in 47 % of the H200's spreads over 5 %; ~5 % slow on a CPU),
    and would leave a steady kernel unsettled (docs/benchmarks.md, "Timing on a busy host")."""
    from shared.ranking import repeat_spread

    if timing.settle_ms and timing.repeat >= 2 and timing.settle_ms < timing.min_repeat_ms:
        quick = evaluate(timing.settle_ms, timing.repeat + 1)[1:]
        spread = repeat_spread(quick)
        if spread is not None and spread <= timing.settle_spread:
            return quick, timing.settle_ms
        if timing.settle_above_best and best_s is not None and quick and min(quick) > best_s:
            return quick, timing.settle_ms
    return evaluate(timing.min_repeat_ms, timing.repeat), timing.min_repeat_ms


BRIEF_REPEATS = 3
MAX_BRIEF_NUMBER = 10_000


def brief_costs(rt_mod, dev, args, brief_ms: float, bar_s: float) -> list[float]:
    """One launch (after the evaluator's own warm-up call); a launch at three times the bar or more is out as it
    stands (a slow kernel's one launch is estimate enough). Else BRIEF_REPEATS repeats of as many launches
    as fill about `brief_ms` of kernel time together. Per-launch seconds."""
    import math

    probe = run_evaluator_common(rt_mod, dev, EvaluatorConfig(number=1, repeat=1, min_repeat_ms=0,
                                                              enable_cpu_cache_flush=False), args)[0]
    if probe >= 3 * bar_s:
        return [probe]
    per_repeat = brief_ms / 1e3 / BRIEF_REPEATS
    number = max(1, min(MAX_BRIEF_NUMBER, math.ceil(per_repeat / max(probe, 1e-9))))
    return run_evaluator_common(rt_mod, dev, EvaluatorConfig(number=number, repeat=BRIEF_REPEATS, min_repeat_ms=0,
                                                             enable_cpu_cache_flush=False), args)

"""The one statistic a candidate is ranked by, wherever it is ranked, recorded as best, exported,
re-timed or shown: the median of its repeats (a neighbour's burst on a shared GPU lifts one repeat,
not the median)."""
from __future__ import annotations

import statistics


def rank_secs(run_secs) -> float:
    return float(statistics.median(float(getattr(s, "value", s)) for s in run_secs))


def repeat_spread(run_secs) -> float | None:
    """(max - min) / median of one timing's repeats; None with fewer than two. A lane preempted while it times
    a kernel of a few microseconds counts the wait as the kernel's time: the spread widens."""
    if not run_secs or len(run_secs) < 2:
        return None
    secs = [float(getattr(s, "value", s)) for s in run_secs]
    mid = statistics.median(secs)
    return (max(secs) - min(secs)) / mid if mid > 0 else None


# a kernel shorter than this takes about as long as its launch: its timing is the one a busy lane's CPU disturbs
# (on the H200, repeats under 20 us spread by 33-51 % at p90, those over by 0.06 %)
SHORT_KERNEL_S = 20e-6


def spread_summary(spreads: list[float]) -> dict[str, float]:
    """How many timings, and the median and 90th percentile of their repeats' spreads ({} for none)."""
    if not spreads:
        return {}
    ranked = sorted(spreads)
    return {"timings": len(ranked), "p50": round(ranked[len(ranked) // 2], 4),
            "p90": round(ranked[min(len(ranked) - 1, int(0.9 * len(ranked)))], 4)}


def default_secs(timing) -> float | None:
    """A workload's default-schedule seconds from its DefaultTiming (None: not timed, or it failed)."""
    return rank_secs(timing.run_secs) if timing is not None and timing.error is None and timing.run_secs else None


# Screened timing (JobSpec.timing "screen"): a candidate gets the full timing when its brief one is within
# this fraction of its task's best so far. A shared GPU's brief figures wander by ~10 %; a candidate that
# could be a new best is never judged on them.
SCREEN_MARGIN = 0.25


def screen_bar(best_s: float | None) -> float | None:
    """The brief median under which a candidate of a task whose best so far is `best_s` gets the full
    timing (None: nothing to beat yet, so every candidate gets it)."""
    import math

    return best_s * (1.0 + SCREEN_MARGIN) if best_s is not None and 0 < best_s < math.inf else None


def best_behind(bar_s: float | None) -> float | None:
    """The task's best so far that a screening bar was made from (screen_bar's inverse; None for None)."""
    return bar_s / (1.0 + SCREEN_MARGIN) if bar_s is not None else None


def live_bar(sent_bar_s: float | None, live_best_s: float | None) -> float | None:
    """A screened candidate's bar when it is timed: the bar it was sent with (None: its task had nothing to
    beat when the round was sent), tightened to the margin over its task's best fully timed so far by any lane
    (candidates of the same round found it meanwhile). Only candidates sent for screening (with a bar key)
    are asked; without a live best the sent bar stands."""
    fresh = screen_bar(live_best_s)
    if sent_bar_s is None or fresh is None:
        return fresh if sent_bar_s is None else sent_bar_s
    return min(sent_bar_s, fresh)


def model_estimate(tasks) -> float | None:
    """The model's latency as its tasks' latencies times their weights, from (weight, best, default) per task: a
    task's best, or its default schedule's time where that is faster or nothing was measured yet (what the compiled
    model runs). None while a task has neither."""
    total = 0.0
    for weight, best, default in tasks:
        known = [x for x in (best, default) if x is not None]
        if not known:
            return None
        total += weight * min(known)
    return total if tasks else None

"""The one statistic a candidate is ranked by, wherever it is ranked, recorded as best, exported,
re-timed or shown: the median of its repeats (a neighbour's burst on a shared GPU lifts one repeat,
not the median)."""
from __future__ import annotations

import statistics


def rank_secs(run_secs) -> float:
    return float(statistics.median(float(getattr(s, "value", s)) for s in run_secs))


def default_secs(timing) -> float | None:
    """A workload's default-schedule seconds from its DefaultTiming (None: not timed, or it failed)."""
    return rank_secs(timing.run_secs) if timing is not None and timing.error is None and timing.run_secs else None

"""The one statistic a candidate is ranked by, wherever it is ranked, recorded as best, exported,
re-timed or shown: the median of its repeats (a neighbour's burst on a shared GPU lifts one repeat,
not the median)."""
from __future__ import annotations

import statistics


def rank_secs(run_secs) -> float:
    return float(statistics.median(float(getattr(s, "value", s)) for s in run_secs))

"""When a job's search ends before its budget is spent: its time limit has passed since tuning started
(JobOptions.time_limit_s), or its patience ran out: the model's estimated latency (shared.ranking.model_estimate)
has not improved by min_gain_pct over `patience` trials (JobOptions.patience), counted from when every task has had
a round: before that a round of one task (tens of trials) that does not move the estimate says nothing about the
others, and replayed over the H100/H200 panel tunings, a patience counted from the start stopped them at up to
1.8x their final estimate (sharetune.experiments.stopping). Pure rules; the tuner's
job_wide.SearchStop reads the store and stops the search for every client (store.stop_search, store.mark_estimate:
`marked` done atomically), and sharetune.experiments.stopping replays them over recorded tunings."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StopRules:
    time_limit_s: float | None = None
    patience: int | None = None
    min_gain_pct: float = 1.0

    @property
    def any(self) -> bool:
        return self.time_limit_s is not None or self.patience is not None

    @property
    def gain(self) -> float:
        """What counts as an improvement, as a fraction of the estimate at the last one."""
        return self.min_gain_pct / 100.0

    def over_time(self, now: float, started_at: float) -> str | None:
        """Why the search ends, when the time limit has passed since `started_at`; else None."""
        if self.time_limit_s is not None and now - started_at >= self.time_limit_s:
            return f"time limit: {self.time_limit_s:g} s of tuning passed"
        return None

    def marked(self, mark: tuple[float, int] | None, estimate_s: float, trials: int) -> tuple[float, int]:
        """Patience's mark (the estimate at the last improvement, the trials then) after an estimate at `trials`:
        moved when there is none yet or the estimate is below it by the gain."""
        if mark is None or estimate_s < mark[0] * (1.0 - self.gain):
            return estimate_s, trials
        return mark

    def out_of_patience(self, trials: int, mark_s: float, mark_trials: int) -> str | None:
        """Why the search ends, when `trials` (the job's, recorded) are `patience` past the last improvement (the
        estimate `mark_s` at `mark_trials`); else None."""
        if self.patience is not None and trials - mark_trials >= self.patience:
            return (f"patience: the model's estimated latency ({mark_s * 1e6:.1f} us at trial {mark_trials}) did not "
                    f"improve by {self.min_gain_pct:g} % in {trials - mark_trials} trials")
        return None

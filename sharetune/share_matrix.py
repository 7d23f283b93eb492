"""The tuned-at x served-at latency matrix: its pure logic (no TVM, no processes).

A model tuned at one share of a device is served at every share; ``latency_us[t][s]`` is the latency of
the model tuned at ``shares[t]`` served at ``shares[s]`` (None where the cell failed). From that:

* each column normalised to its best (1.0 = the best tuned model for that serving share);
* the robust share: the tuning share whose model stays within ``tolerance`` (5 %) of each column's best
  over the widest contiguous range of serving shares;
* the knee: the smallest serving share past which serving latency stops improving by more than
  ``tolerance``;
* a 95 % interval on each cell, bootstrapped over its serving rounds: the diagonal (tuned at the share it
  is served at) is said to win or lose only where the intervals separate, else it is "within noise";
* the cross costs users ask about: serving at the full share a model tuned at a smaller one, and the
  other way round.

Shares are whole percentages of a device, as a job's ``share``. On a CPU a share must be a whole number of
the host's cores, with the rounding of a CPU lane's share (shared.lanes.cpu).
"""
from __future__ import annotations

import math
from typing import Any, Literal, Sequence

from pydantic import BaseModel, ConfigDict, Field, model_validator

from shared import lanes
from shared.errors import ShareError
from shared.lanes.cpu import cores_for_share, share_of_cores  # noqa: F401 - cores_for_share: for callers

TOLERANCE = 0.05
BOOT_SEED = 0  # fixed: the same rounds always give the same interval
BOOT_RESAMPLES = 2000
NOISE = "within noise"


# ---- the share list ------------------------------------------------------------------------------


def parse_shares(spec: str | Sequence[int], kind: str = "gpu", host_cores: int | None = None) -> list[int]:
    """'10,25,50,100' (or a list of ints) -> sorted distinct percentages, at least two of them, each one
    that a lane of `kind` can be placed at on a host of `host_cores` (on a CPU: a whole number of cores)."""
    if isinstance(spec, str):
        items = [s.strip().removesuffix("%").strip() for s in spec.split(",")]
        if not spec.strip() or any(not s for s in items):
            raise ShareError(f"not a share list: {spec!r} (expected e.g. '25,50,100')")
        try:
            values = [int(s) for s in items]
        except ValueError:
            raise ShareError(f"not a share list: {spec!r}: shares are whole percentages, e.g. '25,50,100'") from None
    else:
        values = list(spec)
        if any(not isinstance(v, int) or isinstance(v, bool) for v in values):
            raise ShareError(f"shares are whole percentages, got {values!r}")
    bad = [v for v in values if not 1 <= v <= 100]
    if bad:
        raise ShareError(f"share(s) {', '.join(map(str, bad))} outside 1..100 %")
    dupes = sorted({v for v in values if values.count(v) > 1})
    if dupes:
        raise ShareError(f"share(s) {', '.join(map(str, dupes))} given more than once")
    if len(values) < 2:
        raise ShareError(f"a share matrix needs at least two shares, got {values!r}")
    lanes.kind(kind).check_shares(values, lanes.Host(host_cores or 0))
    return sorted(values)


def shares_from_cores(cores: str | Sequence[int], host_cores: int) -> list[int]:
    """'1,2' (core counts) -> the CPU shares of lanes of that many cores on this host."""
    if isinstance(cores, str):
        try:
            counts = [int(c) for c in cores.split(",")]
        except ValueError:
            raise ShareError(f"not a core-count list: {cores!r} (expected e.g. '1,2')") from None
    else:
        counts = list(cores)
    bad = [c for c in counts if not 1 <= c <= host_cores]
    if bad:
        raise ShareError(f"core count(s) {', '.join(map(str, bad))} outside 1..{host_cores} (this host's cores)")
    return parse_shares([share_of_cores(c, host_cores) for c in counts], "cpu", host_cores)


# ---- the tuning budget ---------------------------------------------------------------------------

TRIALS_PER_TASK = 32
MIN_TRIALS = 256


def default_trials(n_tasks: int) -> int:
    """A share's trial budget scales with the model: 32 a task, at least 256."""
    return max(MIN_TRIALS, TRIALS_PER_TASK * max(1, n_tasks))


def fit_trials(n_tasks: int, n_shares: int, seconds: float, *, per_iter: int = 64, clients: int = 4,
               trial_s: float = 0.25, round_s: float = 10.0, share_fixed_s: float = 35.0, step: int = 8) -> int:
    """The largest per-share budget (a multiple of `step`) whose estimated tuning time, over `n_shares`
    shares one after another, fits `seconds`; 0 when not even the rounds fit. Estimate per share:
    fixed (plan, lane wait, compile) + each client's rounds x round_s (every task at least once) +
    trials x trial_s (builds and runs). The defaults are H200 figures (DESIGN.md: ~2.8 CPU-s a CUDA
    build on 16 cores, ~16 s an evolutionary round, cheaper cold sampling rounds, ~22 s compile)."""
    per_share = seconds / max(1, n_shares) - share_fixed_s
    best = 0
    trials = step
    while True:
        rounds = n_tasks if trials < per_iter * n_tasks else math.ceil(trials / per_iter)
        if math.ceil(rounds / clients) * round_s + trials * trial_s > per_share:
            return best
        best, trials = trials, trials + step


# ---- the matrix ----------------------------------------------------------------------------------

Matrix = list[list[float | None]]


def _ok(v) -> bool:
    return v is not None and math.isfinite(v) and v > 0


def column_best(latency_us: Matrix) -> list[float | None]:
    n = len(latency_us[0]) if latency_us else 0
    best = []
    for s in range(n):
        col = [row[s] for row in latency_us if _ok(row[s])]
        best.append(min(col) if col else None)
    return best


def normalise(latency_us: Matrix) -> Matrix:
    """Each cell over its column's best: 1.0 is the best tuned model for that serving share."""
    best = column_best(latency_us)
    return [[row[s] / best[s] if _ok(row[s]) and best[s] else None for s in range(len(row))] for row in latency_us]


def good_range(norm_row: list[float | None], tolerance: float = TOLERANCE) -> tuple[int, int] | None:
    """The widest contiguous run of columns (first, last index) within tolerance of the column's best;
    the earliest such run on a tie. None when no cell is within tolerance."""
    best, start = None, None
    for s, v in enumerate(norm_row + [None]):
        if v is not None and v <= 1 + tolerance:
            start = s if start is None else start
        elif start is not None:
            if best is None or s - start > best[1] - best[0] + 1:
                best = (start, s - 1)
            start = None
    return best


def robust_choice(shares: list[int], latency_us: Matrix, tolerance: float = TOLERANCE) -> tuple[int | None, list[dict]]:
    """The tuning share whose model stays within tolerance of each column's best over the widest range
    of serving shares. Ties: more columns within tolerance in all, then the lower mean normalised
    latency over the served shares where it has a figure, then the smaller share (cheaper lanes)."""
    norm = normalise(latency_us)
    rows = []
    for t, share in enumerate(shares):
        rng = good_range(norm[t], tolerance)
        cells = [v for v in norm[t] if v is not None]
        rows.append({
            "tuned_share": share,
            "range": [shares[rng[0]], shares[rng[1]]] if rng else None,
            "range_len": rng[1] - rng[0] + 1 if rng else 0,
            "within": sum(1 for v in cells if v <= 1 + tolerance),
            "mean_norm": sum(cells) / len(cells) if cells else None,
            "complete": len(cells) == len(shares),
        })
    candidates = [r for r in rows if r["range_len"]]
    if not candidates:
        return None, rows
    pick = min(candidates, key=lambda r: (-r["range_len"], -r["within"], r["mean_norm"], r["tuned_share"]))
    return pick["tuned_share"], rows


def knee(shares: list[int], latency_us: Matrix, tolerance: float = TOLERANCE) -> int | None:
    """The smallest serving share past which latency stops improving: no larger share serves the
    column's best more than `tolerance` faster than it. None when no column has a figure."""
    best = column_best(latency_us)
    known = [(share, b) for share, b in zip(shares, best) if b is not None]
    for i, (share, b) in enumerate(known):
        if all(later >= (1 - tolerance) * b for _, later in known[i + 1:]):
            return share
    return None


def diagonal_report(shares: list[int], latency_us: Matrix) -> list[dict]:
    """Per serving share: is the model tuned at that share the best there, and by how much (or how far
    from the best when not)."""
    out = []
    for s, share in enumerate(shares):
        col = [(t, row[s]) for t, row in enumerate(latency_us) if _ok(row[s])]
        diag = latency_us[s][s] if s < len(latency_us) else None
        if not col or not _ok(diag):
            out.append({"served_share": share, "diagonal_wins": None})
            continue
        others = [v for t, v in col if t != s]
        best_other = min(others) if others else None
        out.append({
            "served_share": share,
            "diagonal_wins": best_other is None or diag <= best_other,
            # > 0: the diagonal is this much faster than the best other tuning; < 0: slower by that much
            "margin_vs_best_other": (best_other - diag) / best_other if best_other else None,
            "best_tuned_share": shares[min(col, key=lambda c: c[1])[0]],
        })
    return out


# ---- noise: bootstrap intervals over the serving rounds ------------------------------------------

Interval = list[float]  # [low, high] in µs


def bootstrap_ci(samples: Sequence[float], level: float = 0.95, resamples: int = BOOT_RESAMPLES,
                 seed: int = BOOT_SEED) -> Interval | None:
    """The `level` percentile interval of the median, bootstrapped over `samples` (one per serving
    round); None with fewer than two samples (no spread to resample)."""
    import numpy as np

    x = np.asarray([v for v in samples if v is not None and math.isfinite(v)], dtype=float)
    if x.size < 2:
        return None
    rng = np.random.default_rng(seed)
    medians = np.median(x[rng.integers(0, x.size, size=(resamples, x.size))], axis=1)
    lo, hi = np.quantile(medians, [(1 - level) / 2, (1 + level) / 2])
    return [float(lo), float(hi)]


Verdict = bool | Literal["within noise"] | None


def compare(a: Interval | None, b: Interval | None) -> Verdict:
    """a against b, lower is better: True when a's interval lies wholly below b's, False when wholly
    above, "within noise" when they overlap or either is missing (no claim without an interval)."""
    if not a or not b:
        return NOISE
    if a[1] < b[0]:
        return True
    if a[0] > b[1]:
        return False
    return NOISE


def diagonal_wins(shares: list[int], latency_us: Matrix, ci95_us: list[list[Interval | None]]) -> dict[str, Verdict]:
    """Per serving share: True when the model tuned at that share is faster than every other tuning with
    separated intervals, False when some other tuning is faster with separated intervals, else
    "within noise"; None when the diagonal cell failed or nothing else was served there."""
    out: dict[str, Verdict] = {}
    for s, share in enumerate(shares):
        others = [t for t in range(len(shares)) if t != s and _ok(latency_us[t][s])]
        if not _ok(latency_us[s][s]) or not others:
            out[str(share)] = None
            continue
        verdicts = [compare(ci95_us[s][s], ci95_us[t][s]) for t in others]
        out[str(share)] = True if all(v is True for v in verdicts) else False if False in verdicts else NOISE
    return out


def cross_costs(shares: list[int], latency_us: Matrix, ci95_us: list[list[Interval | None]]) -> dict[str, list[dict]]:
    """What a mismatch costs. `serve_full`: each model tuned at a smaller share served at the largest
    share, against the model tuned there; `tuned_full`: the model tuned at the largest share served at each
    smaller share, against the model tuned at that share. slowdown > 1: the mismatch is slower;
    `separated` says whether the two cells' intervals separate (else the difference is noise)."""
    full = len(shares) - 1

    def cost(t: int, s: int, ref: int) -> dict:
        a, b = latency_us[t][s], latency_us[ref][s]
        ok = _ok(a) and _ok(b)
        verdict = compare(ci95_us[t][s], ci95_us[ref][s]) if ok else None
        return {"tuned_share": shares[t], "served_share": shares[s], "reference_tuned_share": shares[ref],
                "slowdown": a / b if ok else None, "separated": verdict in (True, False)}

    return {"serve_full": [cost(t, full, full) for t in range(full)],
            "tuned_full": [cost(full, s, s) for s in range(full)]}


class ShareMatrix(BaseModel):
    """One model's matrix and what it recommends; JSON written and read through this model."""

    model_config = ConfigDict(extra="forbid")

    model: str
    device: str  # "cpu" | "gpu"
    shares: list[int]
    cores: list[int] | None = None  # CPU only: the core count of each share
    tasks_tuned: int | Literal["all"] = "all"  # every task of the model, or its k heaviest
    trials_per_share: int | None = None
    latency_us: Matrix  # [tuned][served]: the median of the serving rounds
    ci95_us: list[list[Interval | None]] = []  # [tuned][served]: bootstrap 95 % interval of that median
    rounds_us: list[list[list[float]]] | None = None  # [tuned][served]: each serving round's figure
    normalised: Matrix = []
    tolerance: float = TOLERANCE
    recommended_share: int | None = None
    knee_share: int | None = None
    rows: list[dict[str, Any]] = []  # per tuned share: its good range and figures
    diagonal: list[dict[str, Any]] = []
    diagonal_wins: dict[str, Verdict] = {}  # served share -> True | False | "within noise" | None
    advice: dict[str, Any] = {}  # recommended share, knee, cross costs (cross_costs)
    errors: dict[str, str] = {}  # "tuned@served" or "tuned@*" -> why the cell is empty
    info: dict[str, Any] = Field(default_factory=dict)  # jobs, trials, timings, device facts

    @model_validator(mode="after")
    def _square(self):
        n = len(self.shares)
        if len(self.latency_us) != n or any(len(row) != n for row in self.latency_us):
            raise ValueError(f"latency_us must be {n} x {n} for shares {self.shares}")
        return self

    @classmethod
    def build(cls, model: str, device: str, shares: list[int], latency_us: Matrix, tolerance: float = TOLERANCE,
              rounds_us: list[list[list[float]]] | None = None, ci95_us: list[list[Interval | None]] | None = None,
              **extra) -> "ShareMatrix":
        """Everything derived from the latencies; intervals from `rounds_us` unless given."""
        latency_us = [[float(v) if _ok(v) else None for v in row] for row in latency_us]
        if ci95_us is None:
            ci95_us = [[bootstrap_ci(rounds_us[t][s]) if rounds_us and _ok(v) else None for s, v in enumerate(row)]
                       for t, row in enumerate(latency_us)]
        recommended, rows = robust_choice(shares, latency_us, tolerance)
        knee_share = knee(shares, latency_us, tolerance)
        advice = {"recommended_share": recommended, "knee_share": knee_share,
                  **cross_costs(shares, latency_us, ci95_us)}
        return cls(model=model, device=device, shares=shares, latency_us=latency_us, ci95_us=ci95_us,
                   rounds_us=rounds_us, normalised=normalise(latency_us), tolerance=tolerance,
                   recommended_share=recommended, knee_share=knee_share, rows=rows,
                   diagonal=diagonal_report(shares, latency_us), diagonal_wins=diagonal_wins(shares, latency_us, ci95_us),
                   advice=advice, **extra)

    @property
    def complete(self) -> bool:
        return all(v is not None for row in self.latency_us for v in row)

    def labels(self) -> list[str]:
        return [f"{c}c" for c in self.cores] if self.cores else [f"{s}%" for s in self.shares]

    def advice_lines(self) -> list[str]:
        """The answer in words: which share to tune at, where serving stops paying, what a mismatch costs."""
        rec = next((r for r in self.rows if r["tuned_share"] == self.recommended_share), None)
        rng = (f" (within {self.tolerance:.0%} of each column's best served at {rec['range'][0]}..{rec['range'][1]} %)"
               if rec and rec["range"] else "")
        lines = [f"recommended tuning share: {self.recommended_share} %{rng}; knee of serving latency: {self.knee_share} %"]
        for key, what in (("serve_full", "served at {s} %, the model tuned at {t} % is {how} the one tuned at {r} %"),
                          ("tuned_full", "served at {s} %, the model tuned at {t} % is {how} the one tuned at {r} %")):
            for c in self.advice.get(key, []):
                if c["slowdown"] is None:
                    continue
                x = c["slowdown"]
                how = f"{x:.2f}x slower than" if x >= 1 else f"{1 / x:.2f}x faster than"
                noise = "" if c["separated"] else " (within noise)"
                lines.append(what.format(s=c["served_share"], t=c["tuned_share"], r=c["reference_tuned_share"], how=how)
                             + noise)
        return lines

    def table(self) -> str:
        """The matrix as text: median latency in µs, its 95 % interval, and over the column's best."""
        label = self.labels()
        width = 30
        lines = [f"{self.model} ({self.device}, tasks tuned: {self.tasks_tuned}, {self.trials_per_share} trials a share): "
                 "rows tuned at, columns served at; median us [95 % CI] (x column best)",
                 "tuned \\ served".ljust(16) + "".join(f"{lab:>{width}}" for lab in label)]
        for t, row in enumerate(self.latency_us):
            cells = []
            for s, v in enumerate(row):
                ci = self.ci95_us[t][s] if self.ci95_us else None
                band = f" [{ci[0]:.0f}-{ci[1]:.0f}]" if ci else ""
                cells.append(f"{v:.1f}{band} ({self.normalised[t][s]:4.2f})" if v is not None else "failed")
            lines.append(f"{label[t]:<16}" + "".join(f"{c:>{width}}" for c in cells))
        lines += self.advice_lines()
        for d in self.diagonal:
            if d["diagonal_wins"] is None:
                continue
            verdict = self.diagonal_wins.get(str(d["served_share"]), NOISE)
            m = d["margin_vs_best_other"]
            how = "no other tuning to compare" if m is None else (
                f"{m:.1%} faster than the best other tuning" if m >= 0
                else f"{-m:.1%} slower than tuning at {d['best_tuned_share']} %")
            word = {True: "wins", False: "loses"}.get(verdict, "is within noise")
            lines.append(f"served at {d['served_share']} %: tuned-at-same-share {word}, {how}")
        for key, err in self.errors.items():
            lines.append(f"failed {key}: {err}")
        return "\n".join(lines)

"""Tune at the share you serve at: tune a model at each share, serve each tuned model at every share,
and return the tuned-at x served-at latency matrix. Two halves: the matrix's pure logic (no TVM, no
processes; the first half, tested on recorded matrices) and the run that fills it (the second half).

    from sharetune.experiments.share_matrix import matrix
    report = matrix("tiny", [50, 100], device="cpu", trials=8, trials_per_iter=4)  # starts its own local stack
    report = matrix("resnet18", [25, 50, 100], device="gpu")  # every task, 32 trials a task, 64 a round
    report = matrix("resnet18", [25, 50, 100], device="gpu", trials=1024, replicates=Replicates(tunings=3))

The matrix: a model tuned at one share of a device (once, or several times with other search seeds) is
served at every share; ``latency_us[t][s]`` is the latency of the model tuned at ``shares[t]`` served at
``shares[s]`` (the median over its tunings; None where the cell failed). From that:

* each column normalised to its best (1.0 = the best tuned model for that serving share);
* the robust share: the tuning share whose model stays within ``tolerance`` (5 %) of each column's best
  over the widest contiguous range of serving shares;
* the knee: the smallest serving share past which serving latency stops improving by more than
  ``tolerance``;
* a 95 % interval on each cell over its tunings and serving rounds (share_stats): the diagonal (tuned at the
  share it is served at) is said to win or lose only where the interval of its margin excludes 0, else it is
  "within noise"; advice per serving share from that verdict;
* the cross costs users ask about: serving at the full share a model tuned at a smaller one, and the
  other way round.

Shares are whole percentages of a device, as a job's ``share``. On a CPU a share must be a whole number of
the host's cores, with the rounding of a CPU lane's share (shared.lanes.cpu).

The run: one isolated job per share and seed on lanes of that share, one after another (so a share's
measurements never overlap another share's, and no tuning starts from another's records), every task of the
model unless told otherwise; each finished tuning kept on disk for a resumed run (share_tunings). Serving:
for each share one fresh process placed at that share (CPU: affinity to that many cores + TVM_NUM_THREADS;
GPU: CUDA_VISIBLE_DEVICES + CUDA_MPS_ACTIVE_THREAD_PERCENTAGE set before CUDA starts) times every tuned model,
warm, interleaved, median of rounds. Where a verdict is beyond noise, each task's schedules are built and
timed at every share (why_it_differs, task_timing). A failed job or cell is recorded, never fatal."""
from __future__ import annotations

import functools
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Sequence

from pydantic import BaseModel, ConfigDict, Field, model_validator

from shared import lanes
from shared import lanes as lane_kinds
from shared.errors import ShareError
from shared.lanes.cpu import cores_for_share, share_of_cores  # noqa: F401 - cores_for_share: for callers
from shared.settings import StackSettings
from sharetune.experiments.share_stats import (NOISE, WINS, Verdict, bootstrap_ci, cell_figure,  # noqa: F401 - callers
                                               compare, hierarchical_ci, intervals_statement, serving_advice,
                                               serving_verdicts, tunings_of)
from sharetune.experiments.share_tunings import (KeptTunings, Replicates, ShareTuning, TuningRun, label,
                                                 tuning_plan)
from sharetune.experiments.task_timing import launch_words
from sharetune.stack.local import Stack

TOLERANCE = 0.05


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


# a matrix run's time on a GPU host, for planning it (bench/share_matrix.py)
STACK_S = 45.0  # stack start with up to 11 lanes, H200 (bench/results: 23-40 s with 4-8 lanes)
SERVE_S = 20.0  # one serving process: start, load, 30 rounds of every tuned model
WHY_S = 120.0  # where a verdict is beyond noise: the tunings' task kernels built and timed at each share
COMPILE_S = 40.0  # a kept tuning's module compiled again on a later machine (four at once)
MIN_PER_TASK_FOR_10 = 8  # trials a task that four shares must still give before 10 % is added


def plan_budget(shares: str, cores: str | None, device: str, trials: int | None, tunings: int, per_iter: int,
                n_tasks: int, seconds: float) -> tuple[list[int], int]:
    """Shares and trials a tuning for one model given `seconds` of a run for it (`tunings` a share): `shares` a
    list, or "auto" (25, 50, 100, and 10 when four shares still give each task MIN_PER_TASK_FOR_10 trials; on a
    CPU one core and the whole host), `cores` a CPU run's core counts instead; `trials` given, or what fits."""
    host = os.cpu_count() or 1
    if cores:
        chosen = shares_from_cores(cores, host)
    elif shares == "auto" and device == "cpu":
        chosen = shares_from_cores([1, host], host)
    elif shares == "auto":
        four = fit_trials(n_tasks, 4 * tunings, seconds - SERVE_S * 4 - 10, per_iter=per_iter)
        chosen = [10, 25, 50, 100] if four >= MIN_PER_TASK_FOR_10 * n_tasks else [25, 50, 100]
    else:
        chosen = parse_shares(shares, device, host)
    if trials:
        return chosen, trials
    fit = fit_trials(n_tasks, len(chosen) * tunings, seconds - SERVE_S * len(chosen) - 10, per_iter=per_iter)
    # not even one trial a task fits: still try with that much; the deadline records what was skipped
    return chosen, min(default_trials(n_tasks), max(fit, n_tasks))


def per_model(spec: str | int, model: str) -> int:
    """A count given for every model ("3") or by model ("resnet18=4,5": 4 for resnet18, 5 for the others);
    ValueError naming the problem otherwise."""
    default, named = None, {}
    for part in str(spec).split(","):
        name, eq, value = part.strip().rpartition("=")
        if not value.strip().isdigit() or int(value) < 1 or (eq and not name.strip()):
            raise ValueError(f"{spec!r}: expected a positive count, or model=count pairs and one bare count")
        if eq:
            named[name.strip()] = int(value)
        else:
            default = int(value)
    if model in named:
        return named[model]
    if default is None:
        raise ValueError(f"{spec!r} gives no count for {model} (add a bare count for the other models)")
    return default


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


# ---- noise: intervals over tunings and serving rounds (sharetune.experiments.share_stats) -----------

Interval = list[float]  # [low, high] in µs


def diagonal_wins(shares: list[int], latency_us: Matrix, ci95_us: list[list[Interval | None]]) -> dict[str, Verdict]:
    """From the cells' intervals alone (a matrix recorded without its rounds; with rounds the verdicts decide):
    per serving share, True when the model tuned at that share is faster than every other tuning with
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


def cross_costs(shares: list[int], latency_us: Matrix, ci95_us: list[list[Interval | None]],
                verdicts: list[dict] | None = None) -> dict[str, list[dict]]:
    """What a mismatch costs. `serve_full`: each model tuned at a smaller share served at the largest
    share, against the model tuned there; `tuned_full`: the model tuned at the largest share served at each
    smaller share, against the model tuned at that share. slowdown > 1: the mismatch is slower;
    `separated` says whether the difference is beyond noise: by the serving verdict's comparison of the two
    (paired by seed where it could be) when `verdicts` are given, else by the two cells' intervals."""
    full = len(shares) - 1
    compared = {(c["tuned_share"], v["served_share"]): c["verdict"] for v in verdicts or [] for c in v.get("against", [])}

    def cost(t: int, s: int, ref: int) -> dict:
        a, b = latency_us[t][s], latency_us[ref][s]
        ok = _ok(a) and _ok(b)
        if (shares[t], shares[s]) in compared and ref == s:
            separated = ok and compared[(shares[t], shares[s])] in ("wins", "loses")
        else:
            separated = ok and compare(ci95_us[t][s], ci95_us[ref][s]) in (True, False)
        return {"tuned_share": shares[t], "served_share": shares[s], "reference_tuned_share": shares[ref],
                "slowdown": a / b if ok else None, "separated": separated}

    return {"serve_full": [cost(t, full, full) for t in range(full)],
            "tuned_full": [cost(full, s, s) for s in range(full)]}


TuningRounds = list[list[list[list[float]]]]  # [tuned][served][tuning]: each serving round's figure


def _us(x: float) -> str:
    """A latency as the table shows it: whole µs, three figures under 100 µs."""
    return f"{x:.0f}" if x >= 100 else f"{x:.3g}"


def _by_share(us: dict, here: int, other: int) -> str:
    """A task's two kernels timed alone at every serving share: whether each follows the share or ignores it."""
    mine, theirs = us.get(str(here)) or {}, us.get(str(other)) or {}
    shares = sorted(int(k) for k in mine if k in theirs)
    if not shares or any(mine[str(p)] is None or theirs[str(p)] is None for p in shares):
        return ""
    row = ["/".join(_us(d[str(p)]) for p in shares) for d in (mine, theirs)]
    return f"at {'/'.join(map(str, shares))} %: {row[0]} us vs {row[1]}; "


def as_tuning_rounds(rounds: list | None) -> TuningRounds | None:
    """Serving rounds as [tuned][served][tuning][round]; a matrix of one tuning a cell, as earlier files hold it
    ([tuned][served][round]), lifted to that shape."""
    cells = [cell for row in rounds or [] for cell in row if cell]
    if cells and not isinstance(cells[0][0], list):
        return [[[cell] if cell else [] for cell in row] for row in rounds or []]
    return rounds


class ShareMatrix(BaseModel):
    """One model's matrix and what it recommends; JSON written and read through this model."""

    model_config = ConfigDict(extra="forbid")

    model: str
    device: str  # "cpu" | "gpu"
    shares: list[int]
    cores: list[int] | None = None  # CPU only: the core count of each share
    tasks_tuned: int | Literal["all"] = "all"  # every task of the model, or its k heaviest
    trials_per_share: int | None = None  # of each tuning
    latency_us: Matrix  # [tuned][served]: the median over the cell's tunings of each one's median round
    ci95_us: list[list[Interval | None]] = []  # [tuned][served]: 95 % interval of that figure (`intervals`)
    intervals: str | None = None  # what ci95_us covers, in words
    tunings: list[list[int]] = []  # [tuned][served]: how many tunings (search seeds) the cell's figure has
    rounds_us: TuningRounds | None = None  # [tuned][served][tuning]: each serving round's figure
    seeds_us: list[list[list[int]]] | None = None  # [tuned][served]: the search seed of each of rounds_us' tunings
    normalised: Matrix = []
    tolerance: float = TOLERANCE
    recommended_share: int | None = None
    knee_share: int | None = None
    rows: list[dict[str, Any]] = []  # per tuned share: its good range and figures
    diagonal: list[dict[str, Any]] = []
    diagonal_wins: dict[str, Verdict] = {}  # served share -> True | False | "within noise" | None
    verdicts: list[dict[str, Any]] = []  # per served share: share_stats.serving_verdict
    advice: dict[str, Any] = {}  # recommended share, knee, cross costs (cross_costs), per serving share (serving)
    why: list[dict[str, Any]] = []  # per served share beyond noise: each task's kernels (task_timing.task_picture)
    launch: dict[str, Any] = {}  # how the tuned kernels launch by tuning share (task_timing.launch_summary)
    errors: dict[str, str] = {}  # "tuned@served" or "tuned@*" -> why the cell is empty
    info: dict[str, Any] = Field(default_factory=dict)  # jobs, trials, timings, device facts

    @model_validator(mode="before")
    @classmethod
    def _one_tuning_files(cls, data):
        if isinstance(data, dict) and data.get("rounds_us"):
            data = {**data, "rounds_us": as_tuning_rounds(data["rounds_us"])}
        return data

    @model_validator(mode="after")
    def _square(self):
        n = len(self.shares)
        if len(self.latency_us) != n or any(len(row) != n for row in self.latency_us):
            raise ValueError(f"latency_us must be {n} x {n} for shares {self.shares}")
        return self

    @classmethod
    def build(cls, model: str, device: str, shares: list[int], latency_us: Matrix | None = None,
              tolerance: float = TOLERANCE, rounds_us: list | None = None,
              ci95_us: list[list[Interval | None]] | None = None, seeds_us: list | None = None,
              **extra) -> "ShareMatrix":
        """Everything derived from the latencies (None: each cell's figure from `rounds_us`); intervals and
        verdicts from `rounds_us` ([tuned][served][tuning][round], or one tuning's [tuned][served][round])
        unless intervals are given; `seeds_us` ([tuned][served]: each tuning's search seed) pairs the verdicts'
        margins by seed."""
        rounds = as_tuning_rounds(rounds_us)
        if latency_us is None:
            latency_us = [[cell_figure(cell) for cell in row] for row in rounds or []]
        latency_us = [[float(v) if _ok(v) else None for v in row] for row in latency_us]
        if ci95_us is None:
            ci95_us = [[hierarchical_ci(rounds[t][s]) if rounds and _ok(v) else None for s, v in enumerate(row)]
                       for t, row in enumerate(latency_us)]
        tunings = [[tunings_of(rounds[t][s]) if rounds else int(_ok(v)) for s, v in enumerate(row)]
                   for t, row in enumerate(latency_us)]
        recommended, rows = robust_choice(shares, latency_us, tolerance)
        knee_share = knee(shares, latency_us, tolerance)
        verdicts = serving_verdicts(shares, rounds, seeds_us) if rounds else []
        wins = ({str(v["served_share"]): WINS[v["verdict"]] for v in verdicts} if verdicts
                else diagonal_wins(shares, latency_us, ci95_us))
        advice = {"recommended_share": recommended, "knee_share": knee_share,
                  **cross_costs(shares, latency_us, ci95_us, verdicts), "serving": serving_advice(verdicts, recommended)}
        return cls(model=model, device=device, shares=shares, latency_us=latency_us, ci95_us=ci95_us,
                   intervals=intervals_statement(max((n for row in tunings for n in row), default=0)),
                   tunings=tunings, rounds_us=rounds, seeds_us=seeds_us, normalised=normalise(latency_us),
                   tolerance=tolerance,
                   recommended_share=recommended, knee_share=knee_share, rows=rows,
                   diagonal=diagonal_report(shares, latency_us), diagonal_wins=wins, verdicts=verdicts,
                   advice=advice, **extra)

    def rederived(self) -> "ShareMatrix":
        """The same matrix with every figure, interval and verdict derived again from its serving rounds (by
        this code's statistics); a file written before seeds were recorded gets them from info["seeds"] where
        every cell holds one tuning of each. Without rounds, itself."""
        if not self.rounds_us:
            return self
        seeds = self.seeds_us
        known = self.info.get("seeds") or []
        if seeds is None and known and all(len(cell) == len(known) for row in self.rounds_us for cell in row):
            seeds = [[list(known) for _ in row] for row in self.rounds_us]
        kept = self.model_dump(include={"cores", "tasks_tuned", "trials_per_share", "tolerance", "why", "launch",
                                        "errors", "info"})
        return ShareMatrix.build(self.model, self.device, self.shares, rounds_us=self.rounds_us, seeds_us=seeds,
                                 **kept)

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
        what = "served at {s} %, the model tuned at {t} % is {how} the one tuned at {r} %"
        for key in ("serve_full", "tuned_full"):
            for c in self.advice.get(key, []):
                if c["slowdown"] is None:
                    continue
                x = c["slowdown"]
                how = f"{x:.2f}x slower than" if x >= 1 else f"{1 / x:.2f}x faster than"
                noise = "" if c["separated"] else " (within noise)"
                lines.append(what.format(s=c["served_share"], t=c["tuned_share"], r=c["reference_tuned_share"], how=how)
                             + noise)
        # where tuning at the serving share wins, its verdict line says all
        return lines + [a["says"] for a in self.advice.get("serving", []) if a["verdict"] not in ("wins", None)]

    def table(self) -> str:
        """The matrix as text: the cell's figure in µs, its 95 % interval, its tunings, and over the column's best."""
        label = self.labels()
        width = 34
        most = max((n for row in self.tunings for n in row), default=1)
        lines = [f"{self.model} ({self.device}, tasks tuned: {self.tasks_tuned}, {self.trials_per_share} trials a share, "
                 f"up to {most} tuning(s) a share): rows tuned at, columns served at; median us [95 % CI] "
                 "(x column best) nN: over N tunings",
                 "tuned \\ served".ljust(16) + "".join(f"{lab:>{width}}" for lab in label)]
        for t, row in enumerate(self.latency_us):
            cells = []
            for s, v in enumerate(row):
                ci = self.ci95_us[t][s] if self.ci95_us else None
                band = f" [{_us(ci[0])}-{_us(ci[1])}]" if ci else ""
                n = f" n{self.tunings[t][s]}" if self.tunings and self.tunings[t][s] > 1 else ""
                cells.append(f"{v:.1f}{band} ({self.normalised[t][s]:4.2f}){n}" if v is not None else "failed")
            lines.append(f"{label[t]:<16}" + "".join(f"{c:>{width}}" for c in cells))
        lines += self.said() + [f"failed {key}: {err}" for key, err in self.errors.items()]
        return "\n".join(lines)

    def said(self) -> list[str]:
        """What the matrix says in words: advice, verdicts, why, the kernels' launch by share."""
        launch = [w for w in [launch_words(self.launch)] if w] if self.launch else []
        return self.advice_lines() + self.verdict_lines() + self.why_lines() + launch

    def why_lines(self, top: int = 3) -> list[str]:
        """Where a verdict is beyond noise, the tasks that make most of the gap, with what differs."""
        lines = []
        for w in self.why:
            s, other = w["served_share"], w["against_tuned_share"]
            parts = []
            for task in w["tasks"][:top]:
                gap = task["weighted_gap_us"].get(str(s))
                if gap is not None:
                    same = "the same default kernel" if set(task["schedule"].values()) == {"default"} else None
                    differs = "; ".join(task["differs"][:3]) or same or "same schedule facts"
                    shares = _by_share(task.get("us") or {}, s, other)
                    parts.append(f"{task['task']} x{task['weight']} {gap:+.1f} us ({shares}{differs})")
            lines.append(f"served at {s} %, tuned here vs at {other} %, heaviest gaps: " + ", ".join(parts))
        return lines

    def verdict_lines(self) -> list[str]:
        """Per serving share: the verdict with its margin and interval; from the cells alone where the rounds
        are not kept."""
        if self.verdicts:
            return [v["says"] for v in self.verdicts if v["verdict"] is not None]
        lines = []
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
        return lines



# ==== running it: tune at each share, serve each tuned model at every share ============================

REPO = Path(__file__).resolve().parents[2]
SERVE_ROUNDS = 30  # enough rounds per cell for a bootstrap interval that separates ~2 % differences
PER_ITER = 64  # MetaSchedule's default candidates a round: small rounds hide where the time goes


# ---- where lanes and serving processes go ---------------------------------------------------------


@dataclass
class Placement:
    """How to put a process at a share of one device: its cores (CPU) or GPU + MPS environment."""

    device: str  # a lane kind: "cpu" | "gpu"
    host_cores: int = field(default_factory=lambda: os.cpu_count() or 1)
    gpu_uuid: str | None = None
    mps_env: dict[str, str] = field(default_factory=dict)  # the MPS daemon's pipe and log dirs
    node: str = "local"  # the host's node name (HostSettings.node): CPU lanes are named for it

    @property
    def kind(self) -> lane_kinds.LaneKind:
        return lane_kinds.kind(self.device)

    def lane(self, share: int, index: int = 0) -> lane_kinds.Lane:
        host = lane_kinds.Host(self.host_cores, self.node)
        return self.kind.lane_at(share, host, index, self.gpu_uuid)

    def lanes(self, shares: list[int], max_lanes_per_share: int = 4) -> list[str]:
        """Lane queues for tuning at each share (one entry per worker): as many lanes as fit the device
        at that share, at most `max_lanes_per_share`. Shares are tuned one at a time, so lanes of
        different shares may name the same cores or add up past 100 % of the GPU."""
        out = []
        for p in shares:
            count = max(1, min(max_lanes_per_share, self.kind.lanes_fit(p, lane_kinds.Host(self.host_cores))))
            out += [self.lane(p, i).queue for i in range(count)]
        return out

    def serve_args(self, share: int) -> tuple[list[str], dict[str, str]]:
        """Extra arguments and environment of a serving process at `share`: placed as a lane of that share."""
        lane = self.lane(share)
        env = {**self.kind.environment(lane, self.gpu_uuid), **self.mps_env}
        cores = ["--cores", ",".join(str(c) for c in lane.cores)] if lane.cores else []
        return ["--device", self.device, *cores], env


class ServeOutput(BaseModel):
    """The one JSON line a serving process prints (sharetune.experiments.model_timing)."""

    model_config = ConfigDict(extra="forbid")
    latency_us: dict[str, float]
    errors: dict[str, str]
    max_abs_err: dict[str, float] = {}
    rounds_us: dict[str, list[float]] = {}
    kernel_us: dict[str, dict[str, float]] = {}  # task kernels (task_timing): label -> workload index -> µs
    kernel_errors: dict[str, str] = {}


def serve_at(share: int, modules: dict[str, str], inputs_path: Path, placement: Placement, rounds: int = 10,
             timeout_s: float = 300.0, reference_path: Path | None = None,
             kernels: dict[str, Path] | None = None) -> ServeOutput:
    """Time every module in one fresh process placed at `share`: latency_us, errors (and max abs error
    against the reference output when given), by label; then every task kernel of `kernels` (label -> a
    task_timing.build_kernels folder): kernel_us."""
    extra, env = placement.serve_args(share)
    argv = [sys.executable, "-m", "sharetune.experiments.model_timing", "--inputs", str(inputs_path), "--rounds", str(rounds), *extra]
    if reference_path is not None:
        argv += ["--reference", str(reference_path)]
    for name, path in modules.items():
        argv += ["--module", f"{name}={path}"]
    for name, folder in (kernels or {}).items():
        argv += ["--kernels", f"{name}={folder}"]
    full_env = {**os.environ, **env, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    try:
        proc = subprocess.run(argv, env=full_env, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return ServeOutput(latency_us={}, errors={name: f"serving at {share} % timed out after {timeout_s:.0f} s"
                                                  for name in modules})
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1][:400]
        return ServeOutput(latency_us={}, errors={name: f"serving process at {share} % exited {proc.returncode}: {tail}"
                                                  for name in modules} or {"kernels": f"exited {proc.returncode}: {tail}"})
    return ServeOutput.model_validate_json(lines[-1])




# ---- the matrix -------------------------------------------------------------------------------------


def model_inputs(model: Any, example_inputs=None) -> list:
    """The model's inputs as numpy arrays: its example inputs when known (zoo, torch), else seeded
    random arrays of its Relax inputs' shapes."""
    import numpy as np

    if isinstance(model, str) and not model.endswith(".onnx"):
        from sharetune.zoo import get

        _, example = get(model).build()
        return [t.detach().numpy() for t in example]
    if example_inputs is not None and all(hasattr(t, "detach") for t in example_inputs):
        return [t.detach().numpy() for t in example_inputs]
    from sharetune.intake import to_relax

    rng = np.random.default_rng(0)
    return [rng.standard_normal(shape).astype(dtype) for shape, dtype in to_relax(model, example_inputs).inputs]


class MatrixCells:
    """The matrix as it fills, by tuned-at row and served-at column: each cell's serving rounds for each of the
    row's tunings (by seed) and largest error against PyTorch; why a cell has no figure."""

    def __init__(self, shares: list[int], seeds: list[int]):
        n = len(shares)
        self.shares, self.seeds = shares, seeds
        self.samples: list[list[dict[int, list[float]]]] = [[{} for _ in range(n)] for _ in range(n)]
        self.max_err: list[list[float | None]] = [[None] * n for _ in range(n)]
        self.errors: dict[str, str] = {}

    def rounds(self) -> list[list[list[list[float]]]]:
        """[tuned][served][tuning]: each served tuning's rounds, by seed."""
        return [[[cell[seed] for seed in sorted(cell)] for cell in row] for row in self.samples]

    def cell_seeds(self) -> list[list[list[int]]]:
        """[tuned][served]: the seeds of rounds()' tunings, in its order."""
        return [[sorted(cell) for cell in row] for row in self.samples]

    def matrix(self, model: str, device: str, about: dict, info: dict, checked_against_torch: bool) -> ShareMatrix:
        """The matrix so far; `about`: ShareMatrix's other fields, `info`: the run's facts."""
        return ShareMatrix.build(model, device, self.shares, rounds_us=self.rounds(), seeds_us=self.cell_seeds(),
                                 errors=dict(self.errors),
                                 **about, info={**info, "max_abs_err_vs_torch": self.max_err if checked_against_torch
                                                else None})

    def served(self, column: int, got: ServeOutput) -> None:
        """Column `column` from one serving process's output (every tuned module served at that share)."""
        for t, p in enumerate(self.shares):
            for seed in self.seeds:
                name = label(p, seed)
                if name in got.max_abs_err:
                    self.max_err[t][column] = max(self.max_err[t][column] or 0.0, got.max_abs_err[name])
                if name in got.latency_us:
                    self.samples[t][column][seed] = got.rounds_us.get(name) or [got.latency_us[name]]
                elif name in got.errors:
                    self.errors[f"{p}:{seed}@{self.shares[column]}"] = got.errors[name]


@dataclass(frozen=True)
class Serving:
    """How each tuned model is served: `rounds` interleaved timing rounds a cell in a fresh process per serving
    share, each process given `timeout_s`; `before(...)` is called once before the first (e.g. to stop the lanes:
    a served model has the device, at its share, to itself). `only_complete`: not before every planned tuning is
    finished (a run split across sessions serves all its modules on one machine, in the session that finishes
    them)."""

    rounds: int = 30
    timeout_s: float = 300.0
    before: Callable[[], None] | None = None
    only_complete: bool = False
    why: bool = True  # where a verdict is beyond noise, the per-task picture (why_it_differs)


def run_matrix(client, model: Any, shares: list[int], placement: Placement, work_dir: Path, *,
               trials: int | None = None, trials_per_iter: int = PER_ITER, only_tasks: list[str] | None = None,
               n_tasks: int | None = None, replicates: Replicates = Replicates(), example_inputs=None,
               name: str | None = None, job_timeout_s: float = 1800.0, deadline: float | None = None,
               serve_reserve_s: float = 0.0, serving: Serving = Serving(), log: Callable[[str], None] = print,
               on_partial: Callable[[ShareMatrix], None] | None = None,
               on_job_timeout: Callable[[Any], None] | None = None) -> ShareMatrix:
    """Tune at each share `replicates.tunings` times (lanes of that share must be live in `client`'s stack), each
    an isolated job of its own seed, then serve every tuned model at every share. `deadline` (time.time()) with
    `serve_reserve_s` kept for serving: a tuning that would start past it is skipped and recorded as such. A job
    still running at its timeout cannot be cancelled: `on_job_timeout(job)` may stop it (e.g. stop the tuner
    processes) so that it does not disturb what is measured next. Every task is tuned unless `only_tasks` names
    some; `trials` per tuning defaults to default_trials(tasks) and `n_tasks` (the model's task count, when the
    caller knows it) saves an extraction. Each finished tuning is kept (replicates.kept_dir, default
    work_dir/tunings); with `replicates.resume` a kept one is served without tuning again."""
    device, work_dir = placement.device, Path(work_dir)
    shares = parse_shares(shares, device, placement.host_cores)
    _require_live_lanes(client, device, shares)
    name = name or (model if isinstance(model, str) else type(model).__name__)
    inputs_path, reference_path = _write_inputs(model, example_inputs, work_dir)
    if only_tasks or n_tasks is None:
        n_tasks = len(only_tasks) if only_tasks else len(model_tasks(model, device, example_inputs))
    # a budget too small for a full round of every task is shared evenly by the first rounds (the service's
    # allocation rule, services/tuner/allocation.py): no task is left untuned
    trials = trials or default_trials(n_tasks)
    cells = MatrixCells(shares, replicates.seeds)
    about = {"tasks_tuned": len(only_tasks) if only_tasks else "all", "trials_per_share": trials,
             "cores": [len(placement.lane(p).cores) for p in shares] if placement.kind.runs_on_host_cores else None}
    from sharetune.intake import to_relax
    relax_mod = to_relax(model, example_inputs).mod  # once, not once per tuning (torch.export takes seconds)
    # no untuned baseline: the matrix compares tuned models only, and each compile costs ~20 s on a GPU host;
    # isolated: each tuning searches from an empty store, so tunings are replicates, not a search continued
    submit = functools.partial(client.submit, relax_mod, target=placement.kind.target_kind, trials=trials,
                               trials_per_iter=trials_per_iter, only_tasks=only_tasks, untuned_baseline=False,
                               isolated=True)
    tunings = TuningRun(ShareTuning(name, submit, trials, f"{trials} trials over {n_tasks} tasks", job_timeout_s,
                                    on_job_timeout, log), KeptTunings(replicates.kept_dir or work_dir / "tunings"),
                        only_tasks)
    info = {"trials_per_iter": trials_per_iter, "tasks": n_tasks, "only_tasks": only_tasks, "seeds": replicates.seeds,
            "target": placement.kind.target_kind, "serve_rounds": serving.rounds}

    def snapshot() -> ShareMatrix:
        report = cells.matrix(name, device, about, {"jobs": dict(tunings.jobs), **info}, reference_path is not None)
        report.errors.update(tunings.errors)
        return report

    report_partial = (lambda: on_partial(snapshot())) if on_partial else (lambda: None)
    plan = tuning_plan(shares, replicates.seeds)
    tunings.run(plan, replicates.resume, (deadline, serve_reserve_s), report_partial)
    about["launch"] = tuned_launch(tunings, tunings.tuning.say)  # the kernels' launch facts by share (no GPU)
    if serving.only_complete and len(tunings.tuned) < len(plan):
        tunings.tuning.say(f"{len(tunings.tuned)} of {len(plan)} tunings kept: served once the rest are (--resume)")
        return snapshot()
    modules = served_modules(tunings, relax_mod, work_dir / "compiled")
    serve_every_share(cells, modules, placement, (inputs_path, reference_path), serving, tunings.tuning.say,
                      report_partial)
    report = snapshot()
    if serving.why and modules:
        report.why = why_it_differs(report, cells.samples, tunings, placement, (work_dir, inputs_path))
    return report


def tuned_launch(tunings: TuningRun, say: Callable[[str], None]) -> dict:
    """launch_summary of the finished tunings' kernels (nothing built); {} when it cannot be read, said so."""
    from sharetune.experiments.task_timing import kept_launch_facts, launch_summary

    try:
        return launch_summary(kept_launch_facts([tunings.kept.database(k.key) for k in tunings.tuned.values()]))
    except Exception as err:  # noqa: BLE001 - a summary lost must not lose the matrix
        say(f"launch facts not read: {type(err).__name__}: {err}")
        return {}


def serve_every_share(cells: MatrixCells, modules: dict[str, str], placement: Placement,
                      inputs: tuple[Path, Path | None], serving: Serving, say: Callable[[str], None],
                      after_each: Callable[[], None]) -> None:
    """Every module served at each share of `cells` in a fresh process there, interleaved; `inputs`: the inputs
    file and PyTorch's output for them (None: not checked)."""
    if serving.before is not None and modules:
        serving.before()
    for s, served in enumerate(cells.shares if modules else []):
        t0 = time.time()
        got = serve_at(served, modules, inputs[0], placement, serving.rounds, serving.timeout_s, inputs[1])
        cells.served(s, got)
        say(f"served at {served} % in {time.time() - t0:.0f} s: "
            + ", ".join(f"{k} {v:.1f} us" for k, v in got.latency_us.items())
            + (f"; errors {got.errors}" if got.errors else ""))
        after_each()


def served_modules(tunings: TuningRun, relax_mod, compiled_dir: Path) -> dict[str, str]:
    """Each finished tuning's module by its label, compiled again from its kept database where it is gone (in
    parallel); one that fails to compile is recorded and left out."""
    t0 = time.time()
    by_key, errors = tunings.kept.modules(list(tunings.tuned.values()), relax_mod, compiled_dir)
    gone = [k for k in tunings.tuned.values() if k.module != by_key.get(k.key)]
    if gone:
        tunings.tuning.say(f"{len(gone)} kept tuning(s) compiled again in {time.time() - t0:.0f} s")
    for (share, seed), kept in tunings.tuned.items():
        if kept.key in errors:
            tunings.errors[f"{share}:{seed}@*"] = errors[kept.key]
    return {label(share, seed): by_key[kept.key] for (share, seed), kept in sorted(tunings.tuned.items())
            if kept.key in by_key}


def beyond_noise(report: ShareMatrix) -> list[dict]:
    """Every comparison of a serving share's verdicts whose margin is beyond noise: the tuning at the serving
    share against one other tuning share (served_share, against_tuned_share, verdict, margin, margin_ci95,
    method, per_seed when paired)."""
    out = []
    for v in report.verdicts:
        pairs = [{**c, "against_tuned_share": c["tuned_share"]} for c in v.get("against") or []
                 if c["verdict"] in ("wins", "loses")]
        if v["verdict"] in ("wins", "loses") and v["against_tuned_share"] not in {c["tuned_share"] for c in pairs}:
            pairs.append({k: v.get(k) for k in ("verdict", "margin", "margin_ci95", "against_tuned_share", "method")})
        out += [{"served_share": v["served_share"], **{k: c.get(k) for k in (
            "against_tuned_share", "verdict", "margin", "margin_ci95", "method", "per_seed")}} for c in pairs]
    return out


def standing_seeds(pair: dict, samples: list[list[dict[int, list[float]]]], shares: list[int]) -> dict[int, int | None]:
    """The tuning that stands for each side of a pair beyond noise: paired by seed, one seed for both sides, the
    one whose own margin is nearest the pair's (the share's effect with the search's luck held fixed); else each
    side's tuning nearest its cell's figure."""
    from sharetune.experiments.task_timing import nearest_tuning

    served, other = pair["served_share"], pair["against_tuned_share"]
    if pair.get("per_seed"):
        seed = int(min(pair["per_seed"], key=lambda k: abs(pair["per_seed"][k] - pair["margin"])))
        return {served: seed, other: seed}
    s = shares.index(served)
    return {p: nearest_tuning(list(samples[t][s].values()), list(samples[t][s]))
            for p in (served, other) for t in [shares.index(p)]}


def why_it_differs(report: ShareMatrix, samples: list[list[dict[int, list[float]]]], tunings: TuningRun,
                   placement: Placement, where: tuple[Path, Path], kernel_rounds: int = 10) -> list[dict]:
    """For each comparison beyond noise (beyond_noise): the tuning at the serving share and the one it is against,
    each side stood for by one tuning (standing_seeds; `samples[t][s]`: each seed's rounds); their task kernels
    built (once a tuning, a child process each) and timed at every share in a fresh process there; each task's
    figures and what differs between the two schedules (task_timing.task_picture). `where`: the work dir and
    the inputs file."""
    from sharetune.experiments.task_timing import build_all, task_picture

    pairs = [(pair, standing_seeds(pair, samples, report.shares)) for pair in beyond_noise(report)]
    tuned = tunings.tuned
    needed = {(p, seed) for _, sides in pairs for p, seed in sides.items() if (p, seed) in tuned}
    if not needed:
        return []
    t0 = time.time()
    folders, errors = build_all({label(*k): (tunings.kept.database(tuned[k].key), tuned[k].target) for k in needed},
                                where[0] / "kernels")
    timed: dict[int, dict[str, dict[str, float]]] = {}
    for served in report.shares:
        got = serve_at(served, {}, where[1], placement, kernel_rounds, 600.0, kernels=folders)
        timed[served], errors = got.kernel_us, {**errors, **got.kernel_errors}
    tunings.tuning.say(f"task kernels of {len(needed)} tuning(s) built and timed in {time.time() - t0:.0f} s")
    out = []
    for pair, sides in pairs:
        if not all((p, seed) in tuned and label(p, seed) in folders for p, seed in sides.items()):
            continue
        manifests = {p: json.loads((folders[label(p, seed)] / "kernels.json").read_text()) for p, seed in sides.items()}
        served = [pair["served_share"]] + [p for p in report.shares if p != pair["served_share"]]
        picture = task_picture(tuned[next(iter(sides.items()))].tasks, served, manifests,
                               {s: {p: timed[s].get(label(p, seed), {}) for p, seed in sides.items()} for s in served})
        out.append({k: pair[k] for k in ("served_share", "verdict", "margin", "margin_ci95", "against_tuned_share")}
                   | {"seeds": {str(p): seed for p, seed in sides.items()}, "tasks": picture, "errors": errors})
    return out


def _require_live_lanes(client, device: str, shares: list[int]) -> None:
    live = set(lane_kinds.shares_served(client.lanes(), device))
    missing = [p for p in shares if p not in live]
    if missing:
        raise ShareError(f"no live {device} lane serves share(s) {', '.join(map(str, missing))} %; "
                         f"live {device} shares: {sorted(live) or 'none'}")


def _write_inputs(model: Any, example_inputs, work_dir: Path) -> tuple[Path, Path | None]:
    """The inputs every serving process times the models on, and PyTorch's output for them where there is one."""
    import numpy as np

    work_dir.mkdir(parents=True, exist_ok=True)
    inputs_path = work_dir / "inputs.npz"
    np.savez(inputs_path, **{f"arg{i}": x for i, x in enumerate(model_inputs(model, example_inputs))})
    return inputs_path, _write_reference(model, example_inputs, work_dir / "reference.npy")


def _write_reference(model: Any, example_inputs, path: Path) -> Path | None:
    """PyTorch's output for a zoo or torch model, so every served cell is checked numerically."""
    import numpy as np

    from sharetune.intake import reference_output

    if isinstance(model, str) and not model.endswith(".onnx"):
        from sharetune.zoo import get

        model, example_inputs = get(model).build()
    if not hasattr(model, "eval") or example_inputs is None:
        return None
    np.save(path, reference_output(model, example_inputs), allow_pickle=False)
    return path


def heaviest_tasks(model: Any, k: int, device: str, example_inputs=None) -> list[str]:
    """Names of the model's k heaviest tasks (FLOPs x weight), for only_tasks."""
    return model_tasks(model, device, example_inputs)[:k]


def model_tasks(model: Any, device: str, example_inputs=None) -> list[str]:
    """Names of all the model's tasks, heaviest (FLOPs x weight) first."""
    from services.measurer.metaschedule.targets import cpu_target, gpu_target
    from services.tuner.metaschedule.extract import extract
    from sharetune.intake import to_relax

    from_device = {"llvm": lambda: cpu_target(1), "cuda": gpu_target}  # TVM's half of a lane kind
    target = from_device[lane_kinds.kind(device).target_kind]()
    tasks = extract(to_relax(model, example_inputs).mod, target)
    return [t.name for t in sorted(tasks, key=lambda t: -t.flops * t.weight)]


# ---- outputs ----------------------------------------------------------------------------------------


def write_outputs(reports: list[ShareMatrix], json_path: Path, png_path: Path | None = None) -> str | None:
    """Write the JSON (one matrix, or {"matrices": [...]} for several) and the heatmap; returns the
    heatmap's path, or None when matplotlib is missing (the JSON and the table still tell all)."""
    json_path = Path(json_path)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    if len(reports) == 1:
        body = reports[0].model_dump(mode="json")
    else:  # what the models share, on top, for a reader who wants the headline without a loop
        tuned = {r.tasks_tuned for r in reports}
        body = {"tasks_tuned": tuned.pop() if len(tuned) == 1 else None,
                "trials_per_share": {r.model: r.trials_per_share for r in reports},
                "diagonal_wins": {r.model: r.diagonal_wins for r in reports},
                "verdicts": {r.model: [v.get("says") for v in r.verdicts] for r in reports},
                "matrices": [r.model_dump(mode="json") for r in reports]}
    tmp = json_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(body, indent=1))
    tmp.replace(json_path)  # a reader never sees half a file
    if png_path is None:
        return None
    try:
        return heatmap(reports, png_path)
    except ImportError:
        return None


def read_matrices(path) -> list[ShareMatrix]:
    """The matrices of a result JSON (one model's, or several under "matrices")."""
    body = json.loads(Path(path).read_text())
    return [ShareMatrix.model_validate(m) for m in body.get("matrices", [body])]


def merge_matrices(paths: list, kept: str | Path | None = None) -> list[ShareMatrix]:
    """The matrices of several result files joined (a model in a later file replaces it), each derived again
    from its serving rounds (ShareMatrix.rederived); with `kept` (a KeptTunings folder) each one's tuned kernels'
    launch facts by share from its kept tunings (task_timing.launch_summary: no GPU, nothing is built)."""
    from sharetune.experiments.share_tunings import tuning_key
    from sharetune.experiments.task_timing import kept_launch_facts, launch_summary

    merged = {m.model: m.rederived() for p in paths for m in read_matrices(p)}
    for m in merged.values() if kept else []:
        keys = [tuning_key(m.model, p, seed, m.trials_per_share) for p in m.shares for seed in m.info.get("seeds", [])]
        m.launch = launch_summary(kept_launch_facts([Path(kept) / k for k in keys]))
    return list(merged.values())


def earlier_reports(path: Path) -> dict[str, ShareMatrix]:
    """The matrices an earlier run of the benchmark wrote (by model): complete ones are kept (a background run
    that was stopped, run again; its finished tunings are found in its kept tunings)."""
    return {m.model: m for m in read_matrices(path)} if path.exists() else {}


def heatmap(reports: list[ShareMatrix], path: Path) -> str:
    """One panel per model: colour = latency over the column's best; text = median µs, its 95 % interval
    and that ratio; the diagonal cells say whether tuning at the serving share won beyond noise."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, len(reports), figsize=(5.2 * len(reports) + 1, 5.4), squeeze=False)
    for ax, r in zip(axes[0], reports):
        norm = np.array([[v if v is not None else np.nan for v in row] for row in r.normalised], dtype=float)
        im = ax.imshow(norm, cmap="viridis_r", vmin=1.0, vmax=max(1.25, float(np.nanmax(norm)) if np.isfinite(norm).any() else 1.25))
        labels = [f"{c} core{'s' * (c > 1)}" for c in r.cores] if r.cores else [f"{s} %" for s in r.shares]
        ax.set_xticks(range(len(labels)), labels)
        ax.set_yticks(range(len(labels)), labels)
        ax.set_xlabel("served at")
        ax.set_ylabel("tuned at")
        def named(share):
            return "none" if share is None else labels[r.shares.index(share)]

        title = (f"{r.model} ({r.device}; tasks: {r.tasks_tuned}, {r.trials_per_share} trials a share)\n"
                 f"recommended tuning at {named(r.recommended_share)}, knee {named(r.knee_share)}")
        ax.set_title(title, fontsize=9)
        verdict = {True: "wins", False: "loses", "within noise": "noise"}  # the diagonal's, per column
        for t, row in enumerate(r.latency_us):
            for s, v in enumerate(row):
                ci = r.ci95_us[t][s] if r.ci95_us else None
                n = r.tunings[t][s] if r.tunings else 1
                text = "failed" if v is None else (f"{_us(v)} us\n" + (f"[{_us(ci[0])}, {_us(ci[1])}]\n" if ci else "")
                                                   + f"x{r.normalised[t][s]:.2f}" + (f" n{n}" if n > 1 else ""))
                if v is not None and t == s and r.diagonal_wins.get(str(r.shares[s])) in verdict:
                    text += f" {verdict[r.diagonal_wins[str(r.shares[s])]]}"
                bold = r.recommended_share == r.shares[t]
                ax.text(s, t, text, ha="center", va="center", fontsize=7, color="white" if v is not None and r.normalised[t][s] > 1.12 else "black",
                        fontweight="bold" if bold else "normal")
        fig.colorbar(im, ax=ax, fraction=0.046, label="x column best")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)


# ---- one call: a local stack with the lanes the shares need -------------------------------------


def matrix(model: Any, shares, *, device: str = "cpu", trials: int | None = None, trials_per_iter: int = PER_ITER,
           work_dir: str | Path = "runs/matrix", only_tasks: list[str] | None = None, tasks: int | None = None,
           redis_url: str | None = None, gpu_index: int = 0, max_lanes_per_share: int = 4, example_inputs=None,
           name: str | None = None, replicates: Replicates = Replicates(), job_timeout_s: float = 1800.0,
           deadline: float | None = None, serve_reserve_s: float = 0.0, rounds: int = SERVE_ROUNDS,
           out_json: str | Path | None = None, out_png: str | Path | None = None, log: Callable[[str], None] = print,
           settings: StackSettings | None = None) -> ShareMatrix:
    """Start a local stack with lanes of every share (or use the running one at `redis_url`, whose lanes
    must serve them), build the matrix, write JSON + heatmap when asked. Every task is tuned unless
    `tasks` (the k heaviest) or `only_tasks` says otherwise; `trials` per tuning defaults to 32 a task, at
    least 256; `replicates`: tunings a share, their first seed, where they are kept and whether kept ones are
    used. Bad shares raise ShareError before anything starts. `settings`: the process's, for its stack
    (None: their defaults)."""
    from sharetune.client import Client

    settings = settings if settings is not None else StackSettings.model_construct()
    placement = Placement(device, node=settings.node)
    shares = parse_shares(shares, device, placement.host_cores)
    work_dir = Path(work_dir)
    if placement.kind.device_uuid:
        placement.gpu_uuid = gpu_uuid_at(gpu_index)
    all_tasks = model_tasks(model, device, example_inputs)
    if only_tasks is None and tasks:
        only_tasks = all_tasks[:tasks]
    stack = (MatrixStack(work_dir / "stack", lanes=placement.lanes(shares, max_lanes_per_share), settings=settings)
             if redis_url is None else None)
    if stack is None and placement.kind.mps:
        placement.mps_env = running_mps_environment(shares)
    name = name or (model if isinstance(model, str) else type(model).__name__)

    def partial(report: ShareMatrix) -> None:
        if out_json:
            write_outputs([report], Path(out_json))

    try:
        if stack is not None:
            redis_url = start_stack(stack, placement, f"[matrix {name}]", log)
        report = run_matrix(Client(redis_url), model, shares, placement, work_dir / "serve", trials=trials,
                            trials_per_iter=trials_per_iter, only_tasks=only_tasks, replicates=replicates,
                            n_tasks=len(all_tasks), example_inputs=example_inputs, name=name,
                            job_timeout_s=job_timeout_s, deadline=deadline, serve_reserve_s=serve_reserve_s,
                            serving=Serving(rounds, before=stack.stop_lanes if stack is not None else None),
                            log=log, on_partial=partial)
    finally:
        if stack is not None:
            stack.stop()
    if out_json:
        write_outputs([report], Path(out_json), Path(out_png) if out_png else None)
    return report


def gpu_uuid_at(gpu_index: int) -> str:
    """The UUID of this host's GPU of that index; ShareError naming the indices found when there is none."""
    from services.measurer.observers import make_observer

    gpus = make_observer().inventory()
    gpu = next((g for g in gpus if g.index == gpu_index), None)
    if gpu is None:
        raise ShareError(f"no GPU with index {gpu_index} on this host (found {[g.index for g in gpus]})")
    return gpu.uuid


def running_mps_environment(shares: list[int]) -> dict[str, str]:
    """The environment of the running MPS daemon's clients; LaneError when a share below 100 % would be served
    without one (it would silently run on the whole GPU)."""
    from services.measurer.gpu import MpsDaemon
    from shared.errors import LaneError

    mps = MpsDaemon(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps"),
                    os.environ.get("CUDA_MPS_LOG_DIRECTORY", "/var/log/nvidia-mps"))
    if min(shares) < 100 and not mps.is_running():
        raise LaneError(f"no MPS control daemon answers on {mps.pipe_dir}: cannot serve below 100 %")
    return mps.environment()


def start_stack(stack: Stack, placement: Placement, label: str, log: Callable[[str], None]) -> str:
    """Start the matrix's own stack; serving processes get its MPS daemon's environment. Returns its REDIS_URL."""
    t0 = time.time()
    stack.start()
    log(f"{label} stack up in {time.time() - t0:.0f} s, lanes {', '.join(sorted(set(stack.lanes)))}")
    if stack.mps is not None:
        placement.mps_env = stack.mps.environment()
    return stack.redis_url


class MatrixStack(Stack):
    """A stack whose lanes of different shares work one share at a time: a GPU lane's warm build pool
    gets the host's cores split among the lanes of its own share, not among every lane; CPU lanes of different
    shares may name the same cores (the core lock warns instead of refusing: they never time at once)."""

    def __init__(self, *args, **kwargs):
        settings = kwargs.get("settings") or StackSettings.model_construct()
        kwargs["settings"] = settings.model_copy(update={"core_overlap": "warn"})
        super().__init__(*args, **kwargs)
        self.agent.lane_build_workers = self._build_workers_of_share
        environment = self.agent.environment
        self.agent.environment = lambda: {**environment(), "SHARETUNE_CORE_OVERLAP": "warn"}  # the lanes' setting

    def _build_workers_of_share(self, queue: str) -> int | None:
        if self.settings.given("build_workers") is not None:
            return None
        cores = self.settings.matrix_cores if self.settings.matrix_cores is not None else os.cpu_count() or 1
        return max(1, cores // self.lanes.count(queue))

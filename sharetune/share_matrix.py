"""The tuned-at x served-at latency matrix: its pure logic (no TVM, no processes).

A model tuned at one share of a device is served at every share; ``latency_us[t][s]`` is the latency of
the model tuned at ``shares[t]`` served at ``shares[s]`` (None where the cell failed). From that:

* each column normalised to its best (1.0 = the best tuned model for that serving share);
* the robust share: the tuning share whose model stays within ``tolerance`` (5 %) of each column's best
  over the widest contiguous range of serving shares;
* the knee: the smallest serving share past which serving latency stops improving by more than
  ``tolerance``.

Shares are whole percentages of a device, as a job's ``share``. On a CPU a share must be a whole number of
the host's cores, with the same rounding as a CPU lane's share (services/measurer/lanes.py).
"""
from __future__ import annotations

import math
from typing import Any, Sequence

from pydantic import BaseModel, ConfigDict, Field, model_validator

from shared.errors import ShareError

TOLERANCE = 0.05


# ---- the share list ------------------------------------------------------------------------------


def cpu_share(cores: int, host_cores: int) -> int:
    """The share in percent of a CPU lane of `cores` cores (same rounding as lane_share)."""
    return max(1, round(100 * cores / host_cores))


def cores_for_share(share: int, host_cores: int) -> int:
    """How many cores a CPU share is; ShareError when it is not a whole number of this host's cores."""
    for n in range(1, host_cores + 1):
        if cpu_share(n, host_cores) == share:
            return n
    valid = ", ".join(f"{cpu_share(n, host_cores)} ({n} core{'s' * (n > 1)})" for n in range(1, host_cores + 1))
    raise ShareError(f"on this {host_cores}-core CPU a share must be a whole number of cores; {share} % is not "
                     f"(valid: {valid})")


def parse_shares(spec: str | Sequence[int], kind: str = "gpu", host_cores: int | None = None) -> list[int]:
    """'10,25,50,100' (or a list of ints) -> sorted distinct percentages, at least two of them.
    kind "cpu" also requires each share to be a whole number of `host_cores` cores."""
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
    if kind == "cpu":
        if not host_cores:
            raise ShareError("CPU shares need the host's core count")
        for v in values:
            cores_for_share(v, host_cores)
    elif kind != "gpu":
        raise ValueError(f"device kind must be 'cpu' or 'gpu', not {kind!r}")
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
    return parse_shares([cpu_share(c, host_cores) for c in counts], "cpu", host_cores)


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


class ShareMatrix(BaseModel):
    """One model's matrix and what it recommends; JSON written and read through this model."""

    model_config = ConfigDict(extra="forbid")

    model: str
    device: str  # "cpu" | "gpu"
    shares: list[int]
    cores: list[int] | None = None  # CPU only: the core count of each share
    latency_us: Matrix  # [tuned][served]
    normalised: Matrix = []
    tolerance: float = TOLERANCE
    recommended_share: int | None = None
    knee_share: int | None = None
    rows: list[dict[str, Any]] = []  # per tuned share: its good range and figures
    diagonal: list[dict[str, Any]] = []
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
              **extra) -> "ShareMatrix":
        latency_us = [[float(v) if _ok(v) else None for v in row] for row in latency_us]
        recommended, rows = robust_choice(shares, latency_us, tolerance)
        return cls(model=model, device=device, shares=shares, latency_us=latency_us, normalised=normalise(latency_us),
                   tolerance=tolerance, recommended_share=recommended, knee_share=knee(shares, latency_us, tolerance),
                   rows=rows, diagonal=diagonal_report(shares, latency_us), **extra)

    @property
    def complete(self) -> bool:
        return all(v is not None for row in self.latency_us for v in row)

    def table(self) -> str:
        """The matrix as text: latency in µs and, in brackets, over the column's best."""
        label = [f"{c}c" for c in self.cores] if self.cores else [f"{s}%" for s in self.shares]
        width = 18
        lines = [f"{self.model} ({self.device}): rows tuned at, columns served at; latency us (x column best)",
                 "tuned \\ served".ljust(16) + "".join(f"{lab:>{width}}" for lab in label)]
        for t, row in enumerate(self.latency_us):
            cells = []
            for s, v in enumerate(row):
                n = self.normalised[t][s]
                cells.append(f"{v:>10.1f} ({n:4.2f})" if v is not None else "failed")
            lines.append(f"{label[t]:<16}" + "".join(f"{c:>{width}}" for c in cells))
        rec = next((r for r in self.rows if r["tuned_share"] == self.recommended_share), None)
        rng = (f" (within {self.tolerance:.0%} of each column's best served at {rec['range'][0]}..{rec['range'][1]} %)"
               if rec and rec["range"] else "")
        lines.append(f"recommended tuning share: {self.recommended_share} %{rng}; knee of serving latency: {self.knee_share} %")
        for d in self.diagonal:
            if d["diagonal_wins"] is None:
                continue
            m = d["margin_vs_best_other"]
            how = "no other tuning to compare" if m is None else (
                f"{m:.1%} faster than the best other tuning" if d["diagonal_wins"]
                else f"{-m:.1%} slower than tuning at {d['best_tuned_share']} %")
            lines.append(f"served at {d['served_share']} %: tuned-at-same-share {'wins' if d['diagonal_wins'] else 'loses'}, {how}")
        for key, err in self.errors.items():
            lines.append(f"failed {key}: {err}")
        return "\n".join(lines)

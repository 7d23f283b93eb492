"""The share matrix's statistics, pure (numpy only: no TVM, no processes), tested on constructed cells.

A cell of the matrix (tuned at one share, served at another) holds, for each tuning of its row's share (one
search seed each), that tuned model's serving rounds at the column's share:

* the cell's figure: the median over its tunings of each tuning's median round;
* its 95 % interval: a hierarchical bootstrap, fixed seed: the tunings resampled, then each resampled tuning's
  rounds, the figure computed again each time. It covers the spread between tunings (search seeds) as well as
  serving noise; with one tuning it is the bootstrap over that tuning's rounds alone (serving noise only);
* a serving share's verdict: the model tuned there against each other tuning share served there, by the
  interval of the margin (other - diagonal) / other, the two cells resampled independently: "wins" when every
  such interval lies above 0, "loses" when one lies below 0, else "within noise" (no claim);
* advice from the verdicts: which share to tune at for each serving share, and by how much."""
from __future__ import annotations

import math
from typing import Literal, Sequence

BOOT_SEED = 0  # fixed: the same data always gives the same interval
BOOT_RESAMPLES = 2000
LEVEL = 0.95
NOISE = "within noise"

Interval = list[float]  # [low, high]
Cell = Sequence[Sequence[float]]  # one cell's serving rounds, a list per tuning
Verdict = bool | Literal["within noise"] | None


def intervals_statement(max_tunings: int) -> str:
    """What `ci95_us` covers, in words, for a matrix whose cells have at most `max_tunings` tunings."""
    if max_tunings > 1:
        return ("95 % hierarchical bootstrap interval of each cell's figure (the median over its tunings of each "
                "tuning's median serving round): tunings (search seeds) resampled, then each one's serving rounds; "
                "it covers the spread between tunings and the serving noise. A verdict is the interval of the margin "
                "between two cells, resampled independently")
    return ("95 % bootstrap interval of each cell's median over its serving rounds: serving noise of one tuned "
            "module per cell; the spread between tuning runs (search seed) is not sampled")


def _tunings(cell: Cell | None):
    """The cell's tunings as arrays of finite figures; tunings without one left out."""
    import numpy as np

    out = []
    for rounds in cell or []:
        x = np.asarray([v for v in rounds if v is not None and math.isfinite(v)], dtype=float)
        if x.size:
            out.append(x)
    return out


def cell_figure(cell: Cell | None) -> float | None:
    """The median over the cell's tunings of each tuning's median round; None without a figure."""
    import numpy as np

    meds = [float(np.median(x)) for x in _tunings(cell)]
    return float(np.median(meds)) if meds else None


def tunings_of(cell: Cell | None) -> int:
    return len(_tunings(cell))


def resampled_figures(cell: Cell | None, resamples: int = BOOT_RESAMPLES, seed: int = BOOT_SEED):
    """The cell's figure on each of `resamples` hierarchical resamples (numpy array); None when there is no
    spread to resample (no tuning, or one tuning with fewer than two rounds). One tuning: its rounds resampled,
    as a plain bootstrap of their median."""
    import numpy as np

    tunings = _tunings(cell)
    rng = np.random.default_rng(seed)
    if len(tunings) == 1:
        x = tunings[0]
        return None if x.size < 2 else np.median(x[rng.integers(0, x.size, size=(resamples, x.size))], axis=1)
    if not tunings:
        return None
    k = len(tunings)
    picks = rng.integers(0, k, size=(resamples, k))  # which tuning fills each of a resample's k slots
    # every tuning's rounds resampled for every slot of every resample: a tuning drawn twice is drawn twice over
    slot_medians = np.stack([np.median(x[rng.integers(0, x.size, size=(resamples, k, x.size))], axis=2)
                             for x in tunings])  # (tuning, resample, slot)
    drawn = slot_medians[picks, np.arange(resamples)[:, None], np.arange(k)[None, :]]
    return np.median(drawn, axis=1)


def _quantiles(values, level: float) -> Interval:
    import numpy as np

    lo, hi = np.quantile(values, [(1 - level) / 2, (1 + level) / 2])
    return [float(lo), float(hi)]


def hierarchical_ci(cell: Cell | None, level: float = LEVEL, resamples: int = BOOT_RESAMPLES,
                    seed: int = BOOT_SEED) -> Interval | None:
    """The `level` percentile interval of the cell's figure over tunings and rounds (resampled_figures)."""
    figures = resampled_figures(cell, resamples, seed)
    return None if figures is None else _quantiles(figures, level)


def bootstrap_ci(samples: Sequence[float], level: float = LEVEL, resamples: int = BOOT_RESAMPLES,
                 seed: int = BOOT_SEED) -> Interval | None:
    """The `level` percentile interval of the median, bootstrapped over `samples` (one tuning's serving
    rounds); None with fewer than two samples (no spread to resample)."""
    return hierarchical_ci([list(samples)], level, resamples, seed)


def margin_ci(diagonal: Cell | None, other: Cell | None, level: float = LEVEL,
              resamples: int = BOOT_RESAMPLES) -> tuple[float | None, Interval | None]:
    """(other - diagonal) / other, > 0 when the diagonal is faster, and its interval: the two cells' resamples
    drawn independently (their tunings are different searches). (None, None) without both figures."""
    d, o = cell_figure(diagonal), cell_figure(other)
    if d is None or o is None or o <= 0:
        return None, None
    fd = resampled_figures(diagonal, resamples, BOOT_SEED)
    fo = resampled_figures(other, resamples, BOOT_SEED + 1)
    if fd is None or fo is None:
        return (o - d) / o, None
    return (o - d) / o, _quantiles((fo - fd) / fo, level)


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


def _pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def _span(ci: Interval | None, sign: float = 1.0) -> str:
    if not ci:
        return "[no interval]"
    lo, hi = sorted((sign * ci[0], sign * ci[1]))
    return f"[{100 * lo:.1f}, {100 * hi:.1f}] %"


def serving_verdict(shares: list[int], cells: list[list[Cell]], s: int) -> dict:
    """The verdict at serving share shares[s]: the model tuned there against each other tuning share served
    there (see the module's docstring); `cells[t][s]`: tunings' rounds. `margin`/`margin_ci95` are against
    `against_tuned_share`: the best other tuning when the diagonal wins or is within noise, the fastest
    tuning when it loses. `says`: the verdict in words."""
    share = shares[s]
    figures = [cell_figure(row[s]) for row in cells]
    others = [t for t in range(len(shares)) if t != s and figures[t] is not None]
    out: dict = {"served_share": share, "verdict": None, "margin": None, "margin_ci95": None,
                 "against_tuned_share": None, "tunings": tunings_of(cells[s][s])}
    if figures[s] is None or not others:
        out["says"] = f"served at {share} %: no verdict (a cell failed, or nothing to compare)"
        return out
    margins = {t: margin_ci(cells[s][s], cells[t][s]) for t in others}
    losing = [t for t in others if margins[t][1] is not None and margins[t][1][1] < 0]
    if losing:
        verdict, against = "loses", min(losing, key=lambda t: figures[t])
    else:
        clear = all(margins[t][1] is not None and margins[t][1][0] > 0 for t in others)
        verdict, against = ("wins" if clear else NOISE), min(others, key=lambda t: figures[t])
    margin, ci = margins[against]
    out.update(verdict=verdict, margin=margin, margin_ci95=ci, against_tuned_share=shares[against])
    out["says"] = verdict_words(out)
    return out


def verdict_words(v: dict) -> str:
    """A verdict as a sentence, its margin with its interval."""
    share, other, m, ci = v["served_share"], v["against_tuned_share"], v["margin"], v["margin_ci95"]
    if v["verdict"] == "wins":
        return f"served at {share} %: tuning here wins by {_pct(m)} {_span(ci)} over tuning at {other} %"
    if v["verdict"] == "loses":
        return (f"served at {share} %: tuning here loses: tuning at {other} % is faster by {_pct(-m)} "
                f"{_span(ci, -1.0)}")
    return f"served at {share} %: within noise (tuning here vs at {other} %: {_pct(m)} {_span(ci)})"


def serving_verdicts(shares: list[int], cells: list[list[Cell]]) -> list[dict]:
    return [serving_verdict(shares, cells, s) for s in range(len(shares))]


WINS: dict[str | None, Verdict] = {"wins": True, "loses": False, NOISE: NOISE, None: None}


def serving_advice(verdicts: list[dict], recommended_share: int | None) -> list[dict]:
    """Per serving share, which share to tune at: the serving share where tuning there wins, the faster
    share where it loses, and where it is within noise any share (the recommended one: it covers the most
    serving shares); `says` names the share and the margin with its interval."""
    out = []
    for v in verdicts:
        share, other = v["served_share"], v["against_tuned_share"]
        if v["verdict"] == "wins":
            tune_at, why = share, f"it beats tuning at {other} % by {_pct(v['margin'])} {_span(v['margin_ci95'])}"
        elif v["verdict"] == "loses":
            tune_at, why = other, (f"it beats tuning at {share} % by {_pct(-v['margin'])} "
                                   f"{_span(v['margin_ci95'], -1.0)}")
        elif v["verdict"] == NOISE:
            tune_at = recommended_share
            why = (f"tuning at {share} % and at {other} % differ by {_pct(v['margin'])} {_span(v['margin_ci95'])}, "
                   "within noise: any share does")
        else:
            tune_at, why = None, "no verdict"
        where = f"tune at {tune_at} %" if tune_at is not None else "no advice"
        out.append({"served_share": share, "tune_at": tune_at, "verdict": v["verdict"],
                    "says": f"serving at {share} %: {where}: {why}"})
    return out

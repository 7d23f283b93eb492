"""The share matrix's statistics, pure (numpy only: no TVM, no processes), tested on constructed cells.

A cell of the matrix (tuned at one share, served at another) holds, for each tuning of its row's share (one
search seed each), that tuned model's serving rounds at the column's share:

* the cell's figure: the median over its tunings of each tuning's median round;
* its 95 % interval: a hierarchical bootstrap, fixed seed: the tunings resampled, then each resampled tuning's
  rounds, the figure computed again each time. It covers the spread between tunings (search seeds) as well as
  serving noise; with one tuning it is the bootstrap over that tuning's rounds alone (serving noise only);
* a serving share's verdict: the model tuned there against each other tuning share served there, by the
  interval of the margin (other - diagonal) / other: "wins" when every such interval lies above 0, "loses" when
  one lies below 0, else "within noise" (no claim); each comparison's own verdict is kept too (`against`);
* the margin's interval, where the two cells share at least two search seeds: paired by seed. A seed's tunings
  at different shares start from the same random draws, and the seed moves a tuned model's latency more than
  the share does (ResNet-18 on an H100, served at 100 %: seed 1's tunings 44-52 % slower than seed 0's), so the
  share's effect is read within each seed: per seed the log of other / diagonal (each tuning's median round),
  their mean and its Student t interval over the seeds (few seeds give wide intervals: t = 4.3 for three).
  Cells without two common seeds: the two cells' hierarchical resamples drawn independently;
* advice from the verdicts: which share to tune at for each serving share, by how much, and which to avoid."""
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


def _finite(rounds):
    """One tuning's rounds as an array of its finite figures."""
    import numpy as np

    return np.asarray([v for v in rounds if v is not None and math.isfinite(v)], dtype=float)


def _tunings(cell: Cell | None):
    """The cell's tunings as arrays of finite figures; tunings without one left out."""
    return [x for x in map(_finite, cell or []) if x.size]


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


# Student t's 97.5 % quantile by degrees of freedom (a table: no scipy on the path); past 30, 2.0 is within 2 %
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
        12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042}


def t975(df: int) -> float:
    """The 97.5 % quantile of Student's t with `df` degrees of freedom (the nearest tabled df at or below)."""
    return T975[max(k for k in T975 if k <= df)] if df <= 30 else 2.0


def paired_margin(diagonal: Cell | None, other: Cell | None, diagonal_seeds: Sequence[int],
                  other_seeds: Sequence[int]) -> dict | None:
    """The margin (other - diagonal) / other paired by search seed: per seed both cells have, r = log(other's
    median round / diagonal's); the margin 1 - exp(-mean r) and its 95 % interval from mean r's Student t
    interval over those seeds. `per_seed`: each seed's own margin. None under two common seeds."""
    import numpy as np

    def by_seed(cell, seeds):
        meds = [float(np.median(x)) if x.size else None for x in map(_finite, cell or [])]
        return {seed: m for seed, m in zip(seeds, meds) if m is not None and m > 0}

    d, o = by_seed(diagonal, diagonal_seeds), by_seed(other, other_seeds)
    common = sorted(set(d) & set(o))
    if len(common) < 2:
        return None
    r = np.log([o[k] / d[k] for k in common])
    half = t975(len(r) - 1) * float(np.std(r, ddof=1)) / math.sqrt(len(r))
    mean = float(np.mean(r))
    return {"margin": 1 - math.exp(-mean), "margin_ci95": [1 - math.exp(-(mean - half)), 1 - math.exp(-(mean + half))],
            "method": "paired", "per_seed": {str(k): 1 - d[k] / o[k] for k in common}}


def margin_between(diagonal: Cell | None, other: Cell | None, diagonal_seeds: Sequence[int] | None = None,
                   other_seeds: Sequence[int] | None = None) -> dict:
    """The diagonal against one other cell: paired by seed where the seeds are known and two are common
    (paired_margin), else the independent margin_ci; `verdict` from the interval ("wins": it lies above 0)."""
    got = paired_margin(diagonal, other, diagonal_seeds, other_seeds) if diagonal_seeds and other_seeds else None
    if got is None:
        margin, ci = margin_ci(diagonal, other)
        got = {"margin": margin, "margin_ci95": ci, "method": "independent"}
    ci = got["margin_ci95"]
    got["verdict"] = None if got["margin"] is None else (
        "wins" if ci and ci[0] > 0 else "loses" if ci and ci[1] < 0 else NOISE)
    return got


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


def serving_verdict(shares: list[int], cells: list[list[Cell]], s: int,
                    seeds: list[list[Sequence[int]]] | None = None) -> dict:
    """The verdict at serving share shares[s]: the model tuned there against each other tuning share served
    there (see the module's docstring); `cells[t][s]`: tunings' rounds, `seeds[t][s]` (when known): the search
    seed of each of those tunings, for paired margins. `margin`/`margin_ci95` are against
    `against_tuned_share`: the best other tuning when the diagonal wins or is within noise, the fastest
    tuning when it loses; `against`: every comparison (tuned share, margin, interval, method, verdict).
    `says`: the verdict in words."""
    share = shares[s]
    figures = [cell_figure(row[s]) for row in cells]
    others = [t for t in range(len(shares)) if t != s and figures[t] is not None]
    out: dict = {"served_share": share, "verdict": None, "margin": None, "margin_ci95": None,
                 "against_tuned_share": None, "tunings": tunings_of(cells[s][s]), "against": []}
    if figures[s] is None or not others:
        out["says"] = f"served at {share} %: no verdict (a cell failed, or nothing to compare)"
        return out
    seeds_of = (lambda t: seeds[t][s]) if seeds else (lambda t: None)
    margins = {t: margin_between(cells[s][s], cells[t][s], seeds_of(s), seeds_of(t)) for t in others}
    losing = [t for t in others if margins[t]["verdict"] == "loses"]
    if losing:
        verdict, against = "loses", min(losing, key=lambda t: figures[t])
    else:
        clear = all(margins[t]["verdict"] == "wins" for t in others)
        verdict, against = ("wins" if clear else NOISE), min(others, key=lambda t: figures[t])
    out.update(verdict=verdict, margin=margins[against]["margin"], margin_ci95=margins[against]["margin_ci95"],
               against_tuned_share=shares[against], method=margins[against]["method"],
               against=[{"tuned_share": shares[t], **margins[t]} for t in others])
    out["says"] = verdict_words(out)
    return out


def verdict_words(v: dict) -> str:
    """A verdict as a sentence, its margin with its interval; within noise, the comparisons that are not."""
    share, other, m, ci = v["served_share"], v["against_tuned_share"], v["margin"], v["margin_ci95"]
    paired = " (paired by seed)" if v.get("method") == "paired" else ""
    if v["verdict"] == "wins":
        return f"served at {share} %: tuning here wins by {_pct(m)} {_span(ci)} over tuning at {other} %{paired}"
    if v["verdict"] == "loses":
        return (f"served at {share} %: tuning here loses: tuning at {other} % is faster by {_pct(-m)} "
                f"{_span(ci, -1.0)}{paired}")
    beats = [f"beats tuning at {c['tuned_share']} % by {_pct(c['margin'])} {_span(c['margin_ci95'])}"
             for c in v.get("against", []) if c["verdict"] == "wins"]
    return (f"served at {share} %: within noise (tuning here vs at {other} %: {_pct(m)} {_span(ci)}){paired}"
            + "".join(f"; {b}" for b in beats))


def serving_verdicts(shares: list[int], cells: list[list[Cell]],
                     seeds: list[list[Sequence[int]]] | None = None) -> list[dict]:
    return [serving_verdict(shares, cells, s, seeds) for s in range(len(shares))]


WINS: dict[str | None, Verdict] = {"wins": True, "loses": False, NOISE: NOISE, None: None}


def serving_advice(verdicts: list[dict], recommended_share: int | None) -> list[dict]:
    """Per serving share, which share to tune at: the serving share where tuning there wins, the faster
    share where it loses, and where it is within noise the recommended one (it covers the most serving
    shares) unless tuning there is slower beyond noise, then the serving share itself; `avoid`: the tuning
    shares slower there beyond noise; `says` names the share and the margin with its interval."""
    out = []
    for v in verdicts:
        share, other = v["served_share"], v["against_tuned_share"]
        avoid = [c for c in v.get("against", []) if c["verdict"] == "wins"]
        if v["verdict"] == "wins":
            tune_at, why = share, f"it beats tuning at {other} % by {_pct(v['margin'])} {_span(v['margin_ci95'])}"
        elif v["verdict"] == "loses":
            tune_at, why = other, (f"it beats tuning at {share} % by {_pct(-v['margin'])} "
                                   f"{_span(v['margin_ci95'], -1.0)}")
        elif v["verdict"] == NOISE:
            slow = {c["tuned_share"] for c in avoid}
            tune_at = recommended_share if recommended_share not in slow else share
            why = (f"tuning at {share} % and at {other} % differ by {_pct(v['margin'])} {_span(v['margin_ci95'])}, "
                   "within noise: " + ("any share does" if not avoid else "either does")
                   + "".join(f"; not at {c['tuned_share']} %: tuning at {share} % is {_pct(c['margin'])} faster "
                             f"{_span(c['margin_ci95'])}" for c in avoid))
        else:
            tune_at, why = None, "no verdict"
        where = f"tune at {tune_at} %" if tune_at is not None else "no advice"
        out.append({"served_share": share, "tune_at": tune_at, "verdict": v["verdict"],
                    "avoid": [c["tuned_share"] for c in avoid] + ([share] if v["verdict"] == "loses" else []),
                    "says": f"serving at {share} %: {where}: {why}"})
    return out

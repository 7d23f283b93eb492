"""What patience (JobOptions.patience, min_gain_pct) would have done to recorded GPU tunings: shared.stopping's rule
replayed over each tuning's estimated-latency curve (seconds from submit, trials, the model's estimate from its
records), where the job would have stopped, after how long, and how far its estimate then was from the tuning's
final one. Reads the time-to-quality results (each model's cold and warm runs) and the scale results (each row).

    python -m sharetune.experiments.stopping [bench/results/time_to_quality_h200.json bench/results/scale_h100_ahead.json]
        [--patience 32,64,128] [--gain 1]
"""
from __future__ import annotations

import argparse
import json

from shared.stopping import StopRules

DEFAULT_RESULTS = ("bench/results/time_to_quality_h200.json", "bench/results/scale_h100_ahead.json")


def stopped_at(curve: list, rules: StopRules, from_trial: int = 1) -> dict | None:
    """Where patience stops a tuning whose estimate after each trial is `curve` ([seconds, trials, estimate_s]),
    counted from trial `from_trial` (when every task had had a round); None when it runs to its budget. The rule
    sees every trial here; a job looks once a second, so it stops a few trials later."""
    mark = None
    for t, trials, estimate_s in curve:
        if trials < from_trial:
            continue
        mark = rules.marked(mark, estimate_s, trials)
        if rules.out_of_patience(trials, *mark):
            return {"trials": trials, "t_s": round(t, 1), "estimate_s": estimate_s}
    return None


def every_task_by(events: list) -> int:
    """The trial (in time order) by which every task of a tuning's `events` ([seconds, task, seconds or None]) had
    one recorded."""
    seen, order, every = set(), sorted(events, key=lambda e: e[0]), {e[1] for e in events}
    for n, (_, task, _) in enumerate(order, start=1):
        seen.add(task)
        if seen == every:
            return n
    return len(order)


def recorded_curves(path: str) -> dict[str, tuple[list, int]]:
    """label -> ([seconds, trials, estimate_s] of the tuning, the trial by which every task had a round), for every
    tuning of the service in a results file (time-to-quality or scale)."""
    from sharetune.experiments.throughput import quality_curve

    with open(path) as f:
        data = json.load(f)
    out = {}
    models = data.get("models")
    for model, entry in (models.items() if isinstance(models, dict) else ()):
        for run, curve in (entry.get("curves") or {}).items():
            if run != "stock" and curve and (entry.get(run) or {}).get("events"):
                out[f"{model} {run}"] = ([(t, n, us * 1e-6) for t, n, us in curve], every_task_by(entry[run]["events"]))
    for row in data.get("rows") or []:
        curve = quality_curve(row)
        if curve:
            out[f"{row['model']} {row['config']}"] = (curve, every_task_by(row["quality"]["events"]))
    return out


def patience_table(curves: dict[str, tuple[list, int]], patiences: list[int], gain_pct: float) -> list[dict]:
    rows = []
    for label, (curve, every_task) in curves.items():
        final_t, final_n, final_s = curve[-1]
        row = {"tuning": label, "trials": final_n, "last_trial_s": round(final_t, 1), "final_us": round(final_s * 1e6, 2),
               "every_task_by": every_task}
        for p in patiences:
            hit = stopped_at(curve, StopRules(patience=p, min_gain_pct=gain_pct), every_task)
            row[f"patience {p}"] = None if hit is None else {
                "trials": hit["trials"], "t_s": hit["t_s"], "time_saved": round(1 - hit["t_s"] / final_t, 3),
                "estimate_vs_final": round(hit["estimate_s"] / final_s, 3)}
        rows.append(row)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="*", default=list(DEFAULT_RESULTS))
    ap.add_argument("--patience", default="32,64,128")
    ap.add_argument("--gain", type=float, default=1.0, help="min_gain_pct")
    args = ap.parse_args(argv)
    curves = {}
    for path in args.results:
        curves.update(recorded_curves(path))
    for row in patience_table(curves, [int(p) for p in args.patience.split(",")], args.gain):
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""`sharetune report JOB`: one self-contained HTML page (inline SVG drawn by matplotlib, a Jinja2 template in
templates/, no scripts, no downloads) with a job's best latency against trials and against time, per task and
for the model, lane utilisation over time, and a share matrix when one is given. Everything is read from the
store (Redis)."""
from __future__ import annotations

import io
import json
import math
from pathlib import Path

from shared import store
from shared.ranking import default_secs, rank_secs

# ---- data --------------------------------------------------------------------------------------------


def job_data(r, job_id: str) -> dict:
    """What the plots need, as plain data (tested without a browser)."""
    job = store.job_hash(r, job_id)
    spec = store.job_spec(r, job_id)
    tasks = store.job_tasks(r, job_id)
    t0 = job.tuning_at or spec.submitted_at
    per_task, events = {}, []
    for t in tasks:
        recs = sorted((x for x in store.records(r, t.wkey) if x.job_id == job_id), key=lambda x: x.measured_at)
        best, curve = None, []
        for i, rec in enumerate(recs, 1):
            if rec.error is None and rec.run_secs:
                us = 1e6 * rank_secs(rec.run_secs)
                best = us if best is None else min(best, us)
            curve.append({"trial": i, "t": rec.measured_at - t0, "best_us": best})
            events.append((rec.measured_at, t.task_id, best))
        per_task[t.task_id] = {"name": t.name, "weight": t.weight, "curve": curve, "best_us": best,
                               "errors": sum(1 for x in recs if x.error is not None)}
    # the model: sum of weight x each task's latency (its best, or its default schedule while that is
    # faster or no candidate is valid yet), from the moment every task has one
    bests = {t.task_id: 1e6 * s for t in tasks if (s := default_secs(store.default_timing(r, t.wkey)))}
    job_curve = []
    for n, (at, tid, best) in enumerate(sorted(events), 1):
        if best is not None:
            bests[tid] = min(best, bests.get(tid, math.inf))
        if len(bests) == len(tasks):
            job_curve.append({"trial": n, "t": at - t0,
                              "est_us": sum(bests[t.task_id] * t.weight for t in tasks)})
    batches = store.lane_batches(r, job_id)
    lanes: dict[str, list] = {}
    for b in batches:
        lanes.setdefault(f"{b.lane} @ {b.worker}", []).append((b.started_at - t0, b.finished_at - t0, b.candidates))
    end = max([b.finished_at - t0 for b in batches] + [c["t"] for p in per_task.values() for c in p["curve"]] + [1.0])
    return {"job_id": job_id, "name": spec.name, "target": spec.target, "share": spec.share, "budget": spec.trials,
            "state": job.state, "error": job.error, "tasks": per_task, "job_curve": job_curve,
            "lanes": lanes, "utilisation": utilisation(lanes, end), "end_s": end,
            "result": json.loads(store.job_result(r, job_id).model_dump_json()) if store.job_result(r, job_id) else None,
            "accounting": store.trial_accounting(r, job_id)}


def utilisation(lanes: dict[str, list], end_s: float, bins: int = 40) -> dict[str, list]:
    """Busy fraction of each lane worker in `bins` equal time bins from 0 to end_s."""
    width = max(end_s, 1e-9) / bins
    out = {}
    for lane, spans in lanes.items():
        busy = [0.0] * bins
        for start, stop, _ in spans:
            for i in range(max(0, int(start // width)), min(bins, int(stop // width) + 1)):
                lo, hi = i * width, (i + 1) * width
                busy[i] += max(0.0, min(hi, stop) - max(lo, start))
        out[lane] = [((i + 0.5) * width, min(1.0, b / width)) for i, b in enumerate(busy)]
    return out


# ---- charts (matplotlib, inline SVG) -------------------------------------------------------------------


def _svg(fig) -> str:
    """The figure as an inline <svg> element: text kept as text (searchable, and what the tests read)."""
    import matplotlib

    buf = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "sharetune"}):
        fig.savefig(buf, format="svg", bbox_inches="tight")
    text = buf.getvalue()
    return text[text.index("<svg"):]


def _figure(title: str, x_label: str, y_label: str):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 3.2))
    ax = fig.add_subplot()
    ax.set_title(title, fontsize=11)
    ax.set_xlabel(x_label)
    ax.set_ylabel(y_label)
    ax.grid(True, color="#eee")
    return fig, ax


def line_chart(series: list[tuple[str, list[tuple[float, float]]]], x_label: str, y_label: str,
               title: str, step: bool = True, y_min: float | None = None, y_max: float | None = None) -> dict:
    """{"title", "svg"}; svg is None when no series has a point yet."""
    series = [(label, [(x, y) for x, y in pts if y is not None]) for label, pts in series]
    if not any(pts for _, pts in series):
        return {"title": title, "svg": None}
    fig, ax = _figure(title, x_label, y_label)
    for label, pts in series:
        if not pts:
            continue
        xs, ys = zip(*pts)
        # a best holds until the next improvement: a step; few points are marked so a one-trial task shows
        ax.plot(xs, ys, drawstyle="steps-post" if step else "default", marker="o" if len(pts) <= 60 else None,
                markersize=3, linewidth=1.6, label=label)
    if y_min is not None or y_max is not None:
        ax.set_ylim(y_min, y_max)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    return {"title": title, "svg": _svg(fig)}


def lane_timeline(lanes: dict[str, list], end_s: float) -> dict:
    """One row per lane worker, a block per batch it measured, labelled with its busy share."""
    title = "Lane activity (blocks: batches being built and timed)"
    if not lanes:
        return {"title": title, "svg": None}
    from matplotlib.figure import Figure

    names = sorted(lanes)
    fig = Figure(figsize=(6.4, 0.9 + 0.32 * len(names)))
    ax = fig.add_subplot()
    ax.set_title(title, fontsize=11)
    for i, lane in enumerate(names):
        spans = lanes[lane]
        ax.broken_barh([(a, max(b - a, end_s / 600)) for a, b, _ in spans], (i - 0.35, 0.7), color=f"C{i % 10}")
    busy = [100 * sum(b - a for a, b, _ in lanes[lane]) / (end_s or 1) for lane in names]
    ax.set_yticks(range(len(names)), [f"{lane} ({b:.0f} % busy)" for lane, b in zip(names, busy)], fontsize=7)
    ax.set_xlim(0, end_s or 1)
    ax.set_ylim(-0.6, len(names) - 0.4)
    ax.invert_yaxis()
    ax.set_xlabel("seconds since tuning started")
    return {"title": title, "svg": _svg(fig)}


def matrix_rows(matrix: dict) -> list[dict]:
    """A share matrix (`sharetune matrix`, latency_us[tuned][served]) as table rows: each cell coloured by
    its log-latency between the matrix's extremes, the best tuning for each serving share marked."""
    shares, lat = matrix["shares"], matrix["latency_us"]
    vals = [v for row in lat for v in row if v is not None]
    lo, hi = (min(vals), max(vals)) if vals else (0, 1)
    rows = []
    for i, s in enumerate(shares):
        cells = []
        for j, v in enumerate(lat[i]):
            if v is None:
                cells.append(None)
                continue
            col = [c for c in (lat[k][j] for k in range(len(shares))) if c is not None]
            f = 0 if hi == lo or lo <= 0 else (math.log(v) - math.log(lo)) / (math.log(hi) - math.log(lo))
            cells.append({"us": v, "best": v == min(col), "bg": f"hsl({int(120 * (1 - f))},60%,80%)"})
        rows.append({"share": s, "cells": cells})
    return rows


def matrix_said(matrix: dict) -> list[str]:
    """What a `sharetune matrix` result says in words (ShareMatrix.said), its verdicts derived again from its
    serving rounds; nothing for a bare table of latencies."""
    from pydantic import ValidationError

    from sharetune.experiments.share_matrix import ShareMatrix

    try:
        return ShareMatrix.model_validate(matrix).rederived().said()
    except ValidationError:
        return []


# ---- page --------------------------------------------------------------------------------------------


def render_html(data: dict, matrix: dict | None = None) -> str:
    import jinja2

    from sharetune.progress import accounting_line, fmt_s, fmt_us

    tasks = sorted(data["tasks"].values(), key=lambda t: t["name"])
    by_trials = [(f"{t['name']} x{t['weight']}", [(c["trial"], c["best_us"]) for c in t["curve"]]) for t in tasks]
    by_time = [(f"{t['name']} x{t['weight']}", [(c["t"], c["best_us"]) for c in t["curve"]]) for t in tasks]
    model = "model (sum of task bests x weight)"
    job_trials = [(model, [(c["trial"], c["est_us"]) for c in data["job_curve"]])]
    job_time = [(model, [(c["t"], c["est_us"]) for c in data["job_curve"]])]
    util = sorted(data["utilisation"].items())
    res = data.get("result") or {}
    sections = [
        ("Best latency, per task", [
            line_chart(by_trials, "trials of the task", "best latency (µs)", "Best latency against trials"),
            line_chart(by_time, "seconds since tuning started", "best latency (µs)", "Best latency against time")]),
        ("Best latency, the model", [
            line_chart(job_trials, "trials of the job", "µs", "Model estimate against trials"),
            line_chart(job_time, "seconds since tuning started", "µs", "Model estimate against time")]),
        ("Lanes", [
            lane_timeline(data["lanes"], data["end_s"]),
            line_chart(util, "seconds since tuning started", "busy fraction", "Lane utilisation over time",
                       step=False, y_min=0.0, y_max=1.0)]),
    ]
    env = jinja2.Environment(loader=jinja2.PackageLoader("sharetune.experiments", "templates"), autoescape=True)
    return env.get_template("report.html.j2").render(
        d=data, res=res, sections=sections,
        tasks=[{**t, "best": fmt_us(t["best_us"])} for t in tasks],
        trials=sum(len(t["curve"]) for t in tasks), tuning_time=fmt_s(data["end_s"]),
        estimate=fmt_us(data["job_curve"][-1]["est_us"] if data["job_curve"] else None),
        split=", ".join(f"{k} {v} s" for k, v in (res.get("time_split_s") or {}).items()),
        accounting=accounting_line(data.get("accounting")),
        matrix={"shares": matrix["shares"], "rows": matrix_rows(matrix), "said": matrix_said(matrix)} if matrix else None)


def find_matrix(r, job_id: str) -> Path | None:
    """A matrix JSON beside the job's files (`<work dir>/jobs/<job>/matrix.json`), if there is one."""
    res = store.job_result(r, job_id)
    if res and res.database_dir:
        p = Path(res.database_dir).parent / "matrix.json"
        return p if p.is_file() else None
    return None


def write_report(r, job_id: str, out: Path, matrix_path: Path | None = None) -> Path:
    matrix_path = matrix_path or find_matrix(r, job_id)
    matrix = json.loads(Path(matrix_path).read_text()) if matrix_path else None
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render_html(job_data(r, job_id), matrix))
    return out.resolve()

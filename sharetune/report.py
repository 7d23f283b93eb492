"""`sharetune report JOB`: one self-contained HTML page (inline SVG, no scripts, no downloads) with a
job's best latency against trials and against time, per task and for the model, lane utilisation
over time, and a share matrix when one is given. Everything is read from the store (Redis)."""
from __future__ import annotations

import html
import json
import math
from pathlib import Path

from shared import store
from shared.ranking import rank_secs

PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
           "#bcbd22", "#17becf"]


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
    # the model: sum of the tasks' bests x weight, from the moment every task has a best
    bests, job_curve = {}, []
    for n, (at, tid, best) in enumerate(sorted(events), 1):
        if best is not None:
            bests[tid] = best
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
            "result": json.loads(store.job_result(r, job_id).model_dump_json()) if store.job_result(r, job_id) else None}


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


# ---- SVG ---------------------------------------------------------------------------------------------


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    if hi <= lo:
        hi = lo + 1
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = min((m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw), default=raw)
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


def _fmt(v: float) -> str:
    return f"{v:.0f}" if abs(v) >= 100 or v == int(v) else f"{v:.3g}"


def line_chart(series: list[tuple[str, list[tuple[float, float]]]], x_label: str, y_label: str,
               title: str, step: bool = True, y_min: float | None = None, y_max: float | None = None,
               w: int = 600, h: int = 300) -> str:
    pts = [(x, y) for _, s in series for x, y in s if y is not None]
    if not pts:
        return f"<p class='empty'>{html.escape(title)}: no data yet</p>"
    x0, x1 = min(0.0, min(p[0] for p in pts)), max(p[0] for p in pts)
    y0 = y_min if y_min is not None else min(p[1] for p in pts)
    y1 = y_max if y_max is not None else max(p[1] for p in pts)
    if y1 <= y0:
        y0, y1 = y0 * 0.9, y1 * 1.1 + 1e-9
    else:
        pad = 0.05 * (y1 - y0)
        y0, y1 = (y0 - pad if y_min is None else y0), (y1 + pad if y_max is None else y1)
    ml, mr, mt, mb = 64, 12, 28, 44
    pw, ph = w - ml - mr, h - mt - mb
    sx = lambda x: ml + pw * (x - x0) / ((x1 - x0) or 1)
    sy = lambda y: mt + ph * (1 - (y - y0) / ((y1 - y0) or 1))
    out = [f"<svg xmlns='http://www.w3.org/2000/svg' width='{w}' height='{h}' viewBox='0 0 {w} {h}' role='img'>",
           f"<text x='{w / 2}' y='18' text-anchor='middle' class='title'>{html.escape(title)}</text>",
           f"<rect x='{ml}' y='{mt}' width='{pw}' height='{ph}' class='frame'/>"]
    for t in _ticks(x0, x1):
        out.append(f"<line x1='{sx(t):.1f}' x2='{sx(t):.1f}' y1='{mt}' y2='{mt + ph}' class='grid'/>"
                   f"<text x='{sx(t):.1f}' y='{mt + ph + 16}' text-anchor='middle'>{_fmt(t)}</text>")
    for t in _ticks(y0, y1):
        out.append(f"<line x1='{ml}' x2='{ml + pw}' y1='{sy(t):.1f}' y2='{sy(t):.1f}' class='grid'/>"
                   f"<text x='{ml - 6}' y='{sy(t) + 4:.1f}' text-anchor='end'>{_fmt(t)}</text>")
    out.append(f"<text x='{ml + pw / 2}' y='{h - 6}' text-anchor='middle'>{html.escape(x_label)}</text>")
    out.append(f"<text transform='translate(14,{mt + ph / 2}) rotate(-90)' text-anchor='middle'>{html.escape(y_label)}</text>")
    for i, (label, s) in enumerate(series):
        s = [(x, y) for x, y in s if y is not None]
        if not s:
            continue
        color = PALETTE[i % len(PALETTE)]
        d, prev = [], None
        for x, y in s:
            if prev is not None and step:
                d.append(f"L{sx(x):.1f},{sy(prev):.1f}")
            d.append(("M" if not d else "L") + f"{sx(x):.1f},{sy(y):.1f}")
            prev = y
        out.append(f"<path d='{' '.join(d)}' stroke='{color}' fill='none' stroke-width='2'><title>{html.escape(label)}</title></path>")
        if len(s) <= 60:  # points where there are few, so a one-trial task still shows
            out.extend(f"<circle cx='{sx(x):.1f}' cy='{sy(y):.1f}' r='2.5' fill='{color}'/>" for x, y in s)
    out.append("</svg>")
    legend = "".join(f"<span><i style='background:{PALETTE[i % len(PALETTE)]}'></i>{html.escape(l)}</span>"
                     for i, (l, _) in enumerate(series))
    return "<figure>" + "".join(out) + f"<figcaption class='legend'>{legend}</figcaption></figure>"


def lane_timeline(lanes: dict[str, list], end_s: float, w: int = 600) -> str:
    """One row per lane worker, a block per batch it measured (busy), with its busy share."""
    if not lanes:
        return "<p class='empty'>no lane batches recorded for this job</p>"
    ml, mr, mt, row = 260, 12, 28, 22
    h = mt + row * len(lanes) + 40
    pw = w - ml - mr
    sx = lambda x: ml + pw * x / (end_s or 1)
    out = [f"<svg xmlns='http://www.w3.org/2000/svg' width='{w}' height='{h}' viewBox='0 0 {w} {h}' role='img'>",
           f"<text x='{w / 2}' y='18' text-anchor='middle' class='title'>Lane activity (blocks: batches being built and timed)</text>"]
    for i, (lane, spans) in enumerate(sorted(lanes.items())):
        y = mt + i * row
        busy = sum(b - a for a, b, _ in spans)
        out.append(f"<text x='{ml - 6}' y='{y + 15}' text-anchor='end'>{html.escape(lane)} ({100 * busy / end_s:.0f} % busy)</text>"
                   f"<rect x='{ml}' y='{y + 3}' width='{pw}' height='{row - 6}' class='frame'/>")
        for a, b, n in spans:
            out.append(f"<rect x='{sx(a):.1f}' y='{y + 3}' width='{max(1.0, sx(b) - sx(a)):.1f}' height='{row - 6}' "
                       f"fill='{PALETTE[i % len(PALETTE)]}'><title>{n} candidates, {b - a:.2f} s</title></rect>")
    for t in _ticks(0, end_s):
        out.append(f"<text x='{sx(t):.1f}' y='{h - 22}' text-anchor='middle'>{_fmt(t)}</text>")
    out.append(f"<text x='{ml + pw / 2}' y='{h - 4}' text-anchor='middle'>seconds since tuning started</text></svg>")
    return "<figure>" + "".join(out) + "</figure>"


def matrix_table(matrix: dict) -> str:
    """A share matrix (`sharetune matrix`): latency_us[tuned][served], tuned at one share, served at another."""
    shares = matrix["shares"]
    lat = matrix["latency_us"]
    vals = [v for row in lat for v in row if v is not None]
    lo, hi = (min(vals), max(vals)) if vals else (0, 1)
    rows = ["<tr><th>tuned at \\ served at</th>" + "".join(f"<th>{s} %</th>" for s in shares) + "</tr>"]
    for i, s in enumerate(shares):
        cells = []
        for j, v in enumerate(lat[i]):
            if v is None:
                cells.append("<td>-</td>")
                continue
            col = [c for c in (lat[k][j] for k in range(len(shares))) if c is not None]
            best = v == min(col)
            f = 0 if hi == lo else (math.log(v) - math.log(lo)) / (math.log(hi) - math.log(lo)) if lo > 0 else 0
            bg = f"hsl({int(120 * (1 - f))},60%,80%)"
            cells.append(f"<td style='background:{bg}'{' class=best' if best else ''}>{v:,.1f}</td>")
        rows.append(f"<tr><th>{s} %</th>" + "".join(cells) + "</tr>")
    return ("<table class='matrix'>" + "".join(rows) + "</table><p class='note'>Latency in µs of the model tuned "
            "at the row's share and served at the column's; bold: the best tuning for that serving share.</p>")


# ---- page --------------------------------------------------------------------------------------------

CSS = """
body{font-family:system-ui,sans-serif;margin:24px;color:#222;max-width:1400px}
h1{font-size:22px} h2{font-size:17px;margin-top:28px;border-bottom:1px solid #ddd}
svg text{font-size:11px;fill:#333} svg .title{font-size:13px;font-weight:600}
.frame{fill:none;stroke:#999} .grid{stroke:#eee}
figure{display:inline-block;margin:8px 16px 8px 0;vertical-align:top}
.legend span{display:inline-block;margin-right:12px;font-size:12px}
.legend i{display:inline-block;width:10px;height:10px;margin-right:4px}
table{border-collapse:collapse;font-size:13px} td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}
td.best{font-weight:700} .empty,.note{color:#777;font-size:13px}
"""


def render_html(data: dict, matrix: dict | None = None) -> str:
    from sharetune.progress import fmt_s, fmt_us

    tasks = sorted(data["tasks"].values(), key=lambda t: t["name"])
    by_trials = [(f"{t['name']} x{t['weight']}", [(c["trial"], c["best_us"]) for c in t["curve"]]) for t in tasks]
    by_time = [(f"{t['name']} x{t['weight']}", [(c["t"], c["best_us"]) for c in t["curve"]]) for t in tasks]
    job_trials = [("model (sum of task bests x weight)", [(c["trial"], c["est_us"]) for c in data["job_curve"]])]
    job_time = [("model (sum of task bests x weight)", [(c["t"], c["est_us"]) for c in data["job_curve"]])]
    util = [(lane, pts) for lane, pts in sorted(data["utilisation"].items())]
    res = data.get("result") or {}
    rows = "".join(
        f"<tr><td style='text-align:left'>{html.escape(t['name'])}</td><td>{t['weight']}</td><td>{len(t['curve'])}</td>"
        f"<td>{t['errors']}</td><td>{fmt_us(t['best_us'])}</td></tr>" for t in tasks)
    split = ", ".join(f"{k} {v} s" for k, v in (res.get("time_split_s") or {}).items())
    est = data["job_curve"][-1]["est_us"] if data["job_curve"] else None
    parts = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>sharetune job {html.escape(data['job_id'])}</title>"
        f"<style>{CSS}</style></head><body>",
        f"<h1>Job {html.escape(data['job_id'])}: {html.escape(data['name'])}</h1>",
        f"<p>state <b>{html.escape(str(data['state']))}</b>{' - ' + html.escape(data['error']) if data.get('error') else ''}; "
        f"target {html.escape(data['target'])} at {data['share']} %; {sum(len(t['curve']) for t in tasks)} of "
        f"{data['budget']} trials; tuning time {fmt_s(data['end_s'])}; model estimate {fmt_us(est)}"
        + (f"; wall {res['wall_s']:.0f} s; time split: {html.escape(split)}" if res else "") + "</p>",
        "<h2>Tasks</h2><table><tr><th>task</th><th>weight</th><th>trials</th><th>errors</th><th>best</th></tr>"
        + rows + "</table>",
        "<h2>Best latency, per task</h2>",
        line_chart(by_trials, "trials of the task", "best latency (µs)", "Best latency against trials"),
        line_chart(by_time, "seconds since tuning started", "best latency (µs)", "Best latency against time"),
        "<h2>Best latency, the model</h2>",
        line_chart(job_trials, "trials of the job", "µs", "Model estimate against trials"),
        line_chart(job_time, "seconds since tuning started", "µs", "Model estimate against time"),
        "<h2>Lanes</h2>",
        lane_timeline(data["lanes"], data["end_s"]),
        line_chart(util, "seconds since tuning started", "busy fraction", "Lane utilisation over time",
                   step=False, y_min=0.0, y_max=1.0),
    ]
    if matrix:
        parts += ["<h2>Share matrix</h2>", matrix_table(matrix)]
    parts.append("</body></html>")
    return "\n".join(parts)


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

"""Progress of a job: a bar for the job and one per task (trials, best latency, ETA), as plain lines (logs,
pipes) or as a rich table (a terminal, redrawn in place by `sharetune watch`). Pure functions of
`Job.status()` and a clock, so the CLI's `watch` and the tests share them."""
from __future__ import annotations

import math

from shared.messages import JobState
from shared.ranking import model_estimate


def bar(fraction: float, width: int = 20) -> str:
    fraction = min(1.0, max(0.0, fraction))
    full = int(fraction * width)
    return "[" + "#" * full + "." * (width - full) + "]"


def fmt_us(us: float | None) -> str:
    if us is None:
        return "-"
    return f"{us / 1000:.2f} ms" if us >= 1000 else f"{us:.1f} us"


# a job whose full timings' repeats spread wider than this at the 90th percentile is told so: on the H200 kernels
# of 20 us and more spread by 0.06 % (p90), those under 20 us, their lanes preempted by builds, by 33-51 %
NOISY_SPREAD = 0.10


def timing_line(res) -> str:
    """How a finished job's candidates were timed (screened timing: most get only the brief window)."""
    full, brief = res.timings.get("full", 0), res.timings.get("brief", 0)
    if not full and not brief:
        return "timing: -"
    line = (f"timing: {full} candidates timed fully, {brief} screened out after a brief timing "
            f"({100 * brief / (full + brief):.0f} %)")
    spread = res.timing_spread
    if spread:
        line += f"; repeats within {100 * spread['p50']:.1f} % (median), {100 * spread['p90']:.1f} % (p90)"
        if spread["p90"] > NOISY_SPREAD:
            line += (" - noisy: something else wants the lanes' CPU or device (docs/benchmarks.md, "
                     "\"Timing on a busy host\")")
    return line


def fmt_s(s: float | None) -> str:
    if s is None or math.isinf(s) or s < 0:
        return "-"
    s = int(round(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def estimates(st: dict, now: float) -> dict:
    """Elapsed tuning time, the trial rate and the ETA of the job and of each task.

    A task has no fixed budget (MetaSchedule's gradient scheduler moves trials to the tasks that gain
    most), so a task's bar is against an even split of the job's budget, and its ETA is at its own rate."""
    tasks = st.get("tasks") or []
    times = st.get("times") or {}
    started = times.get("tuning_at")
    ended = [times[k] for k in ("retiming_at", "compiling_at", "cancelled_at", "failed_at", "done_at") if k in times]
    end = min(ended) if ended and started and min(ended) >= started else now  # the search's own span
    elapsed = max(1e-9, end - started) if started else None
    trials, budget = st.get("trials", 0), max(1, st.get("budget", 1))
    rate = trials / elapsed if elapsed and trials else None
    searching = (JobState.QUEUED, JobState.PLANNING, JobState.PLANNED, JobState.TUNING)
    done = st.get("state") not in searching  # the search is over
    eta = 0.0 if done or trials >= budget else ((budget - trials) / rate if rate else None)
    per_task = max(1, math.ceil(budget / max(1, len(tasks))))
    out_tasks = []
    for t in tasks:
        t_rate = t["trials"] / elapsed if elapsed and t["trials"] else None
        left = max(0, per_task - t["trials"])
        out_tasks.append({"task": t["task"], "fraction": min(1.0, t["trials"] / per_task),
                          "eta_s": 0.0 if done or not left or trials >= budget else (left / t_rate if t_rate else None)})
    return {"elapsed_s": elapsed, "rate": rate, "eta_s": eta, "fraction": min(1.0, trials / budget),
            "per_task_budget": per_task, "tasks": out_tasks}


def render(st: dict, now: float, width: int = 100) -> list[str]:
    """Lines for one refresh: a header, the job's bar, then one line per task (heaviest first)."""
    est = estimates(st, now)
    best = _job_estimate_us(st)
    lines = [
        f"job {st['job_id']} ({st.get('name', '')}, {st.get('target', '')} at {st.get('share', '?')} %): {st.get('state')}"
        + (f" - {st['error']}" if st.get("error") else "") + (f" - stopped early: {st['stopped']}" if st.get("stopped") else ""),
        f"  {bar(est['fraction'], 30)} {st.get('trials', 0)}/{st.get('budget', '?')} trials"
        f"  {('%.2f' % est['rate']) + ' trials/s' if est['rate'] else '-'}  elapsed {fmt_s(est['elapsed_s'])}"
        f"  ETA {fmt_s(est['eta_s'])}  sum of task bests x weight {fmt_us(best)}",
    ]
    stops = stopping_line(st, now)
    if stops:
        lines.append(f"  {stops}")
    name_w = max([len(t["task"]) for t in st.get("tasks", [])] + [4])
    name_w = min(name_w, max(12, width - 70))
    for t, e in zip(st.get("tasks", []), est["tasks"]):
        name = t["task"] if len(t["task"]) <= name_w else t["task"][: name_w - 1] + "~"
        lines.append(
            f"  {name:<{name_w}} {bar(e['fraction'], 12)} {t['trials']:>4} trials"
            f" {t['errors']:>3} err  best {fmt_us(t['best_us']):>10}  x{t['weight']:<2} ETA {fmt_s(e['eta_s'])}"
            + (f"  (+{t['reused_trials']} reused)" if t.get("reused_trials") else "")
        )
    return lines


def stopping_line(st: dict, now: float) -> str | None:
    """Where a job with stopping rules stands against them while it searches (None without rules, or once over)."""
    rules = st.get("stopping")
    searching = (JobState.QUEUED, JobState.PLANNING, JobState.PLANNED, JobState.TUNING)
    if not rules or st.get("stopped") or st.get("state") not in searching:
        return None
    parts = []
    if rules.get("time_limit_s") is not None:
        started = (st.get("times") or {}).get("tuning_at")
        left = rules["time_limit_s"] - (now - started) if started else None
        parts.append(f"time limit {rules['time_limit_s']:g} s" + (f" ({fmt_s(max(0.0, left))} left)" if left is not None
                                                               else ""))
    if rules.get("patience") is not None:
        gain = f"{rules.get('min_gain_pct', 1.0):g} %"
        mark = rules.get("mark_trials")
        parts.append(f"patience {rules['patience']}: " + (
            f"{max(0, st.get('trials', 0) - mark)} trials since the estimate last fell {gain}" if mark is not None
            else "counts once every task has had a round"))
    return "stops at: " + "; ".join(parts)


def live_view(st: dict, now: float):
    """The same content as render(), as a rich renderable (imported here: the API image has no rich)."""
    from rich.console import Group
    from rich.progress_bar import ProgressBar
    from rich.table import Table
    from rich.text import Text

    est = estimates(st, now)
    head = Text.assemble(
        (f"job {st['job_id']}", "bold"), f" ({st.get('name', '')}, {st.get('target', '')} at {st.get('share', '?')} %): ",
        (str(st.get("state")), "bold green" if st.get("state") == JobState.DONE else "bold"),
        (f" - {st['error']}", "red") if st.get("error") else "",
        f" - stopped early: {st['stopped']}" if st.get("stopped") else "")
    total = Table.grid(padding=(0, 2))
    total.add_row(ProgressBar(total=1.0, completed=est["fraction"], width=30),
                  f"{st.get('trials', 0)}/{st.get('budget', '?')} trials",
                  f"{est['rate']:.2f} trials/s" if est["rate"] else "-", f"elapsed {fmt_s(est['elapsed_s'])}",
                  f"ETA {fmt_s(est['eta_s'])}", f"sum of task bests x weight {fmt_us(_job_estimate_us(st))}")
    tasks = Table(box=None, pad_edge=False, header_style="bold")
    for col, justify in (("task", "left"), ("", "left"), ("trials", "right"), ("err", "right"), ("best", "right"),
                         ("weight", "right"), ("ETA", "right"), ("reused", "right")):
        tasks.add_column(col, justify=justify, overflow="ellipsis", no_wrap=True)
    for t, e in zip(st.get("tasks", []), est["tasks"]):
        tasks.add_row(t["task"], ProgressBar(total=1.0, completed=e["fraction"], width=12), str(t["trials"]),
                      str(t["errors"]), fmt_us(t["best_us"]), f"x{t['weight']}", fmt_s(e["eta_s"]),
                      str(t.get("reused_trials") or ""))
    stops = stopping_line(st, now)
    return Group(head, total, Text(stops), tasks) if stops else Group(head, total, tasks)


def _job_estimate_us(st: dict) -> float | None:
    """The model's latency as its tasks' latencies times their weights: a task's best, or its default
    schedule's time when that is faster or nothing was measured yet (what the compiled model runs). None
    while a task has neither."""
    return model_estimate([(t["weight"], t.get("best_us"), t.get("default_us")) for t in st.get("tasks") or []])


def accounting_line(acc: dict | None) -> str | None:
    """Where a job's trials went, in one line (None when the store no longer knows)."""
    if not acc:
        return None
    line = (f"trials: {acc['claimed']} claimed, {acc['recorded']} recorded, {acc['outstanding']} outstanding, "
            f"{acc['lost']} lost, {acc.get('reused', 0)} reused from the store")
    kinds = acc.get("resend_kinds") or {}
    if kinds:
        line += "; re-sent batches: " + ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
    return line

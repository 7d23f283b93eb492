"""Time to quality, from a run's measured trials: the model's estimated latency after each trial (the weighted
sum of each task's best so far), when a run first reaches a latency, the figures a time-to-quality result holds
per model and over the panel, its markdown table and its plot (bench/time_to_quality.py runs the benchmark;
docs/time_to_quality.md has the protocol)."""
from __future__ import annotations

import collections
import json
import math
import statistics
from pathlib import Path

from sharetune.experiments.throughput import full_windows


def latency_curve(events: list[tuple[float, str, float | None]], weights: dict[str, int],
                  defaults: dict[str, float], keeps_default: bool = True, lines: list[int | None] | None = None,
                  retimed: dict | None = None) -> list[tuple[float, int, float]]:
    """(seconds, trials so far, estimated model seconds) after each measured trial. `events`: (seconds from
    submit, task name, the trial's seconds or None for a failed trial), in any order; `defaults`: each task's
    default schedule's seconds (a task without one counts at its first valid trial until then).
    `keeps_default`: the run compiles a task's default schedule where it beats the task's best trial (the
    service's guard); stock does not: a task it measured compiles its best trial, slower or not.
    With `retimed` ({"steps": {line: us}, "defaults": {task: us}}, from retimed_kernels; `lines`: each event's
    database line, event_lines) the curve is timed again, every run's kernels in one process: the kernel in effect
    is still the task's best so far by the run's own timings, counted at its common figure, and with
    `keeps_default` the faster of it and the task's default by the common timing (the service's export times both
    again before it chooses). A kernel without a common figure counts at the run's own."""
    steps = {int(k): v * 1e-6 for k, v in ((retimed or {}).get("steps") or {}).items()}
    again = {k: v * 1e-6 for k, v in ((retimed or {}).get("defaults") or {}).items()}
    order = sorted(zip(events, lines or [None] * len(events)), key=lambda p: p[0][0])  # None never compares
    first = {}
    for (_, task, secs), _line in order:
        if secs is not None:
            first.setdefault(task, secs)
    best: dict[str, tuple[float, float]] = {}  # task -> (its own seconds, the common timing's)
    out = []
    for n, ((t, task, secs), line) in enumerate(order, start=1):
        if secs is not None and secs < best.get(task, (math.inf,))[0]:
            best[task] = (secs, steps.get(line, secs) if line is not None else secs)
        def cost(name: str) -> float:
            default = again.get(name, defaults.get(name))
            if name not in best:
                return default if default is not None else first.get(name, 0.0)
            return min(best[name][1], default) if keeps_default and default is not None else best[name][1]
        out.append((round(t, 2), n, sum(w * cost(name) for name, w in weights.items())))
    return out


def event_lines(events: list, every_trial: bool) -> list[int | None]:
    """Each event's line in its run's JSON database, whose records are in the order they were committed: stock's
    holds every trial (`every_trial`), a service run's export only its fully timed ones (export_job_records)."""
    if every_trial:
        return list(range(len(events)))
    lines, n = [], 0
    for event in events:
        lines.append(None if event[2] is None else n)
        n += event[2] is not None
    return lines


def curve_steps(events: list, lines: list[int | None]) -> dict[int, str]:
    """The records that were their task's best so far when they were measured (line -> task): the kernels the
    run's module would have run, had the run stopped there."""
    best: dict[str, float] = {}
    steps = {}
    for (_, task, secs), line in sorted(zip(events, lines), key=lambda p: p[0][0]):
        if secs is not None and line is not None and secs < best.get(task, math.inf):
            best[task], steps[line] = secs, task
    return steps


def workload_names(db: Path) -> dict[int, str]:
    """A JSON database's workload indices by task name, where the run said which is which: stock's tasks.json,
    a service export's workload_tasks.json (task -> structural hash, as the workload lines hold it)."""
    if (db / "tasks.json").exists():
        by_hash = {str(t["shash"]): t["name"] for t in json.loads((db / "tasks.json").read_text())}
    elif (db / "workload_tasks.json").exists():
        by_hash = {str(h): name for name, h in json.loads((db / "workload_tasks.json").read_text()).items()}
    else:
        return {}
    lines = (db / "database_workload.json").read_text().splitlines()
    return {i: by_hash[str(json.loads(line)[0])] for i, line in enumerate(lines)
            if line.strip() and str(json.loads(line)[0]) in by_hash}


# the serving process's launch floor (a kernel that copies 64 floats): light kernels' figures move with it from one
# machine to the next, and with them a module's latency ratio to another's
FLOOR_SET, FLOOR_KERNEL = "launch-floor", "launch_floor"
WARM_CUT = 4  # the warm goal: the cold run's final latency within this fraction of its trials (1/4)


def trial_cuts(row: dict, kept_run) -> dict[str, tuple[Path, int]]:
    """The modules a row serves beside each run's final one, each compiled from a run's first N trials (label ->
    (its records_db, N)): the cold run at stock's trial count where it ran more (latency at equal trials), the warm
    run at a quarter of the cold run's trials (the warm goal, by the served modules themselves rather than the
    estimate). `kept_run(phase)` -> the folder holding the run's records_db, or None."""
    cuts = {}
    stock_trials, cold_trials = (row.get("stock") or {}).get("trials"), (row.get("cold") or {}).get("trials")
    wants = {"cold_at_stock_trials": ("cold", stock_trials if cold_trials and stock_trials
                                      and cold_trials > stock_trials else None),
             "warm_at_quarter": ("warm", cold_trials // WARM_CUT if cold_trials and row.get("warm") else None)}
    for label, (phase, first) in wants.items():
        if first and (kept := kept_run(phase)) is not None and (kept / "records_db").exists():
            cuts[label] = (kept / "records_db", first)
    return cuts


def record_databases(row: dict, stock_db: Path | None, kept_run) -> dict[str, tuple[list, Path]]:
    """Each run of a row with its events and the JSON database of every record it committed, in order: stock's
    database, a service run's records_db (`kept_run(phase)` -> the folder holding it, or None)."""
    runs = {}
    if stock_db is not None and (row.get("stock") or {}).get("events"):
        runs["stock"] = (row["stock"]["events"], stock_db)
    for phase in ("cold", "warm"):
        if (row.get(phase) or {}).get("events") and (kept := kept_run(phase)) is not None \
                and (kept / "records_db" / "database_tuning_record.json").exists():
            runs[phase] = (row[phase]["events"], kept / "records_db")
    return runs


def step_kernels(row: dict, stock_db: Path | None, kept_run, target_json: str,
                 out_root: Path) -> tuple[dict, dict, dict]:
    """Each run's curve steps and every workload's default built (task_timing.build_all, a child process a run),
    from the databases record_databases finds. Returns ({label: kernels folder}, {label: why none}, {label: (its
    steps, line -> task; the database they were built from)})."""
    import shutil

    from sharetune.experiments.task_timing import build_all

    shutil.rmtree(out_root / "steps", ignore_errors=True)
    todo, steps = {}, {}
    for label, (events, db) in record_databases(row, stock_db, kept_run).items():
        events = [tuple(e) for e in events]
        copy = out_root / "steps-db" / label  # build_all names a kernels folder by its database's
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(db, copy)
        steps[label] = (curve_steps(events, event_lines(events, every_trial=label == "stock")), copy)
        todo[label] = (copy, target_json, ",".join(map(str, sorted(steps[label][0]))))
    folders, errors = build_all(todo, out_root / "steps")
    return folders, errors, steps


def retimed_runs(served: dict, folders: dict[str, Path], steps: dict[str, tuple]) -> dict:
    """Each run's step kernels as the serving process timed them (`served["kernel_us"]`'s "<run>-steps" sets,
    taken out of it), for latency_curve: {run: {"steps": ..., "defaults": ...}}."""
    kernel_us = served.get("kernel_us") or {}
    return {label: retimed_kernels(kernel_us.pop(f"{label}-steps", {}), folder, steps[label][1], steps[label][0])
            for label, folder in folders.items()}


def retimed_kernels(kernel_us: dict[str, float], folder: Path, db: Path, steps: dict[int, str]) -> dict:
    """One run's kernels (built in `folder` from its database `db`) timed in the serving process (key -> us:
    r<line>, d<index>) as latency_curve takes them: {"steps": {line: us}, "defaults": {task: us}}; a default is
    named by its workload's task (the run's own naming, else a step of that workload)."""
    from sharetune.experiments.task_timing import KERNELS

    built = json.loads((folder / KERNELS).read_text())["kernels"]
    names = workload_names(db)
    for key, kernel in built.items():
        if key.startswith("r") and int(key[1:]) in steps:
            names.setdefault(kernel["workload"], steps[int(key[1:])])
    out: dict = {"steps": {}, "defaults": {}}
    for key, us in kernel_us.items():
        if key.startswith("r"):
            out["steps"][key[1:]] = round(us, 3)
        elif key.startswith("d") and (name := names.get(built.get(key, {}).get("workload"))) is not None:
            out["defaults"][name] = round(us, 3)
    return out


def untuned_estimate(weights: dict[str, int], defaults: dict[str, float]) -> float:
    return sum(w * defaults.get(name, 0.0) for name, w in weights.items())


def time_to_reach(curve: list, target: float) -> tuple[float | None, int | None]:
    """(seconds, trials) at which the curve first is at or below `target` (None: never)."""
    for t, n, est in curve:
        if est <= target * (1 + 1e-9):
            return t, n
    return None, None


def heaviest_task_landed(events: list, weights: dict[str, int], defaults: dict[str, float]) -> tuple[str | None,
                                                                                                    float | None]:
    """(the task costing the untuned model most, weight x default seconds; the time of its first fully timed
    record, None if none came): when the part of the latency the user waits on most starts to fall."""
    costs = {name: weights.get(name, 1) * d for name, d in defaults.items() if d}
    if not costs:
        return None, None
    heaviest = max(costs, key=lambda name: costs[name])
    return heaviest, next((t for t, name, secs in events if name == heaviest and secs is not None), None)


# a served module computes the wrong thing where its output departs from the reference by more than this many times
# the untuned module's departure (reductions summed in another order move the last bits), WRONG_OUTPUT_FLOOR at
# least; NaN is always wrong. MetaSchedule times kernels without checking what they compute, so a schedule that
# TVM lowers wrongly can win a task: its latency is no tuned latency
WRONG_OUTPUT_FACTOR = 100.0
WRONG_OUTPUT_FLOOR = 1e-4


def wrong_outputs(served: dict | None) -> list[str]:
    """The served modules (stock, cold, warm, ...) whose output is not the model's (`served`: the row's served
    figures, their `max_abs_err` against the reference output); the untuned module is the yardstick."""
    errs = (served or {}).get("max_abs_err") or {}
    base = errs.get("untuned")
    bar = WRONG_OUTPUT_FLOOR
    if base is not None and math.isfinite(base):
        bar = max(bar, WRONG_OUTPUT_FACTOR * base)
    return sorted(k for k, e in errs.items() if k != "untuned" and not (e is not None and e <= bar))


def summarise_model(row: dict) -> None:
    """The curves from the events, and the figures the issue asks for."""
    cold, warm, stock = row.get("cold"), row.get("warm"), row.get("stock")
    defaults = (cold or warm or {}).get("defaults") or {}
    weights = (cold or warm or stock or {}).get("weights") or {}
    curves = {}
    for name, res in (("stock", stock), ("cold", cold), ("warm", warm)):
        if res and res.get("events"):
            curves[name] = latency_curve([tuple(e) for e in res["events"]], weights, defaults,
                                         keeps_default=name != "stock")
    row["curves"] = {k: [[t, n, round(e * 1e6, 3)] for t, n, e in v] for k, v in curves.items()}
    s = {"untuned_estimate_us": round(untuned_estimate(weights, defaults) * 1e6, 3) if defaults else None}
    s.update(curve_figures(curves, (stock or {}).get("wall_s")))
    again = row.get("retimed") or {}
    retimed = {name: latency_curve(events, weights, defaults, keeps_default=name != "stock",
                                   lines=event_lines(events, every_trial=name == "stock"), retimed=again[name])
               for name, res in (("stock", stock), ("cold", cold), ("warm", warm))
               if name in again and res and (events := [tuple(e) for e in res.get("events") or []])}
    row.pop("curves_retimed", None)
    if retimed:
        row["curves_retimed"] = {k: [[t, n, round(e * 1e6, 3)] for t, n, e in v] for k, v in retimed.items()}
        s.update(curve_figures(retimed, (stock or {}).get("wall_s"), prefix="retimed_"))
    for k in ("cold", "warm"):
        if k in curves and defaults:
            s["heaviest_task"], landed = heaviest_task_landed([tuple(e) for e in row[k]["events"]], weights, defaults)
            s[f"{k}_heaviest_task_landed_s"] = round(landed, 2) if landed is not None else None
    lat = (row.get("served") or {}).get("latency_us") or {}
    wrong = wrong_outputs(row.get("served"))
    if wrong:
        s["wrong_output"] = wrong
    if "stock" in lat and "stock" not in wrong:
        for k in ("cold", "warm", "cold_at_stock_trials"):
            if k in lat:
                s[f"{k}_vs_stock_latency"] = round(lat[k] / lat["stock"], 4)
        equal_run = "cold_at_stock_trials" if "cold_at_stock_trials" in lat else "cold"
        if equal_run in lat and equal_run not in wrong:  # a wrong module's latency meets no goal
            s["latency_vs_stock_equal_trials"] = round(lat[equal_run] / lat["stock"], 4)
    if "warm_at_quarter" in lat and "cold" in lat and not {"warm_at_quarter", "cold"} & set(wrong):
        s["warm_quarter_vs_cold_latency"] = round(lat["warm_at_quarter"] / lat["cold"], 4)  # <= 1: the goal met
    floor = ((row.get("served") or {}).get("kernel_us") or {}).get(FLOOR_SET, {}).get(FLOOR_KERNEL)
    if floor is not None:
        s["served_launch_floor_us"] = floor
    if "untuned" in lat:
        s["never_slower_than_untuned"] = all(v <= lat["untuned"] * 1.02 for k, v in lat.items() if k in ("cold", "warm"))
    # the goal holds for every search the service runs: the worse of the cold and warm runs (a warm run's rounds
    # are mostly evolutionary, which cost more a candidate than cold draws)
    cpu = [(run["search_cpu_s_per_valid_candidate"], k) for k, run in (("cold", cold), ("warm", warm))
           if run and run.get("search_cpu_s_per_valid_candidate") is not None]
    if cpu:
        s["search_cpu_s_per_valid_candidate"], s["search_cpu_s_per_valid_candidate_run"] = max(cpu)
    row["summary"] = s


def curve_figures(curves: dict[str, list], stock_wall: float | None, prefix: str = "") -> dict:
    """A row's figures from its curves (seconds): each run's final estimate, when the service's runs reach stock's
    final latency (and the ratio to stock's wall), when the warm run reaches the cold run's."""
    s: dict = {}
    for k, v in curves.items():
        s[f"{prefix}{k}_final_estimate_us"] = round(v[-1][2] * 1e6, 3)
    if "stock" in curves and stock_wall:
        for k in ("cold", "warm"):
            if k in curves:
                t, n = time_to_reach(curves[k], curves["stock"][-1][2])
                s[f"{prefix}{k}_time_to_stock_latency_s"] = t
                s[f"{prefix}{k}_trials_to_stock_latency"] = n
                s[f"{prefix}{k}_time_to_stock_latency_ratio"] = round(t / stock_wall, 4) if t is not None else None
    if "cold" in curves and "warm" in curves:
        t, n = time_to_reach(curves["warm"], curves["cold"][-1][2])
        s[f"{prefix}warm_time_to_cold_latency_s"] = t
        s[f"{prefix}warm_trials_ratio"] = round(n / len(curves["cold"]), 4) if n is not None else None
    return s


def summarise(result: dict) -> dict:
    """The worst panel model's figure for each goal."""
    rows = [row for row in result["models"].values() if row.get("summary")]
    def worst(key, pick=max):
        vals = [(row["summary"][key], m) for m, row in result["models"].items()
                if row.get("summary") and row["summary"].get(key) is not None]
        if not vals:
            return None, None
        return pick(vals)
    out = {"models": sum(1 for row in rows if row["summary"].get("latency_vs_stock_equal_trials") is not None),
           "models_started": len(result["models"])}
    for key, src in (("time_to_stock_latency_ratio", "cold_time_to_stock_latency_ratio"),
                     ("latency_vs_stock_equal_trials", "latency_vs_stock_equal_trials"),
                     ("warm_trials_ratio", "warm_trials_ratio"),
                     ("search_cpu_s_per_valid_candidate", "search_cpu_s_per_valid_candidate"),
                     # the same curves with every run's kernels in effect timed again in one process (latency_curve with `retimed`)
                     ("retimed_time_to_stock_latency_ratio", "retimed_cold_time_to_stock_latency_ratio"),
                     ("retimed_warm_trials_ratio", "retimed_warm_trials_ratio"),
                     # the warm run's module at a quarter of the cold run's trials against the cold run's final one
                     ("warm_quarter_vs_cold_latency", "warm_quarter_vs_cold_latency")):
        v, m = worst(src)
        out[key], out[f"{key}_model"] = v, m
    out["models_retimed"] = sum(1 for row in rows if row.get("curves_retimed"))
    wrong = {m: row["summary"]["wrong_output"] for m, row in result["models"].items()
             if (row.get("summary") or {}).get("wrong_output")}
    if wrong:
        out["wrong_output"] = wrong
    unreached = [m for m, row in result["models"].items() if row.get("summary") and "stock" in row.get("curves", {})
                 and "cold" in row.get("curves", {}) and row["summary"].get("cold_time_to_stock_latency_s") is None]
    if unreached:
        out["never_reached_stock_latency"] = unreached
    # a warm run that never reached the cold run's final latency has no trials ratio: it is over 1, not unknown
    warm_short = [m for m, row in result["models"].items() if "warm" in row.get("curves", {}) and "cold" in row.get("curves", {})
                  and row["summary"].get("warm_time_to_cold_latency_s") is None]
    if warm_short:
        out["warm_never_reached_cold_latency"] = warm_short
    return out


def markdown_table(result: dict) -> str:
    """One row a model and run, as docs/time_to_quality.md shows it."""
    lines = ["| model | run | trials | wall s | time to stock's final (s, ratio to stock's wall) | final estimate us "
             "(re-timed) | served us (x stock) |", "|---|---|---|---|---|---|---|"]
    for m, row in result["models"].items():
        s, lat = row.get("summary") or {}, (row.get("served") or {}).get("latency_us") or {}
        for run in ("stock", "cold", "warm"):
            res = row.get(run)
            if not res or res.get("error"):
                continue
            reach = "-" if run == "stock" else (
                f"{s.get(f'{run}_time_to_stock_latency_s')} ({s.get(f'{run}_time_to_stock_latency_ratio')})"
                if s.get(f"{run}_time_to_stock_latency_s") is not None else "never")
            served = f"{lat[run]:.1f}" + (f" ({lat[run] / lat['stock']:.2f}x)" if "stock" in lat and run != "stock" else "") \
                if run in lat else "-"
            if run in s.get("wrong_output", ()):
                served += " WRONG OUTPUT"
            again = s.get(f"retimed_{run}_final_estimate_us")
            lines.append(f"| {m} | {run} | {res.get('trials')} | {res.get('wall_s')} | {reach} | "
                         f"{s.get(f'{run}_final_estimate_us')}{f' ({again})' if again is not None else ''} | {served} |")
        if "warm_at_quarter" in lat:  # the warm goal by served modules
            lines.append(f"| {m} | warm, first quarter | {(row.get('cold') or {}).get('trials', 0) // WARM_CUT} | - | - | - | "
                         f"{lat['warm_at_quarter']:.1f} ({s.get('warm_quarter_vs_cold_latency')}x cold's) |")
        if "untuned" in lat:
            lines.append(f"| {m} | untuned | 0 | - | - | {s.get('untuned_estimate_us')} | {lat['untuned']:.1f} |")
    return "\n".join(lines)


def table_again(path: Path) -> str:
    """A results file's figures derived again from its recorded events and written back, its PNG drawn beside
    it; returns its markdown table."""
    result = json.loads(path.read_text())
    for row in result["models"].values():
        summarise_model(row)
    result["summary"] = summarise(result)
    path.write_text(json.dumps(result, indent=1))
    plot(result, path.with_suffix(".png"))
    return markdown_table(result)


def plot(result: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    models = [m for m, row in result["models"].items() if row.get("curves")]
    if not models:
        return
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4.2), squeeze=False)
    for ax, m in zip(axes[0], models):
        row = result["models"][m]
        u = (row.get("summary") or {}).get("untuned_estimate_us")
        for name, style in (("stock", "k-"), ("cold", "b-"), ("warm", "g-")):
            c = row["curves"].get(name)
            if c:  # from submit at the untuned estimate; stock's end marked where its run ended
                xs, ys = [0.5] + [max(p[0], 0.5) for p in c], [u or c[0][2]] + [p[2] for p in c]
                wall = (row.get(name) or {}).get("wall_s")
                if wall and wall > xs[-1]:
                    xs, ys = xs + [wall], ys + [ys[-1]]
                ax.step(xs, ys, style, where="post", label=name)
        if u:
            ax.axhline(u, color="grey", ls=":", label="untuned")
            # a tuner's first records of a task can be 100x its default: the axis stops where they would hide the rest
            ax.set_ylim(0, 1.6 * u)
        ax.set_xscale("log")
        ax.set_title(m)
        ax.set_xlabel("seconds from submit")
        ax.set_ylabel("estimated model latency (us)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def stock_events(work: Path, seen: list[float]) -> tuple[list[tuple], dict[str, int]]:
    """Stock's run in `work` as (events, each task's weight): its JSON database's records in the order they were
    committed, each at its time in `seen`, named by the task its workload belongs to (tasks.json)."""
    tasks = json.loads((work / "tasks.json").read_text())
    by_hash = {t["shash"]: t["name"] for t in tasks}
    wl_names = [by_hash.get(json.loads(line)[0], f"?{i}") for i, line in
                enumerate((work / "database_workload.json").read_text().splitlines())]
    events = []
    for t, line in zip(seen, (work / "database_tuning_record.json").read_text().splitlines()):
        wl, rec = json.loads(line)
        secs = rec[1]
        ok = secs and all(s < 1e9 for s in secs)
        events.append((t, wl_names[wl], statistics.median(secs) if ok else None))
    return events, {t["name"]: t["weight"] for t in tasks}


def job_events(r, job_id: str, t0: float, wall: float, threads: int) -> dict:
    """A service job's part of a time-to-quality row, from the store: its tasks' weights and default schedules'
    seconds, its events (seconds from `t0`; a trial not fully timed counts as failed: an export leaves it out),
    its phase splits and the search CPU a valid candidate took (`threads`: each client's search threads)."""
    from shared import store

    tasks = store.job_tasks(r, job_id)
    defaults = {}
    for t in tasks:
        d = store.default_timing(r, t.wkey)
        if d is not None and d.run_secs:
            defaults[t.name] = statistics.median(d.run_secs)
    recs = sorted(((x, t) for t in tasks for x in store.records(r, t.wkey) if x.job_id == job_id),
                  key=lambda p: p[0].measured_at)
    events, seeds, valid = [], 0, 0
    seeded: dict[str, list] = {}  # task -> its seeds' seconds (None: not fully timed)
    for rec, t in recs:
        valid += store.valid_record(rec)  # timed, briefly or fully
        ok = store.valid_record(rec) and rec.timing == "full"  # what an export may use
        events.append((rec.measured_at - t0, t.name, statistics.median(rec.run_secs) if ok else None))
        if getattr(rec, "seeded_from", None):
            seeds += 1
            seeded.setdefault(t.name, []).append(events[-1][2])
    splits = store.splits(r, job_id)
    row = {"trials": len(events), "weights": {t.name: t.weight for t in tasks}, "defaults": defaults,
           "full_windows": full_windows([x for x, _ in recs]), "events": events, "seeds_measured": seeds, "trials_per_min": round(60 * len(events) / max(wall, 1e-9), 1),
           "splits": splits, "valid_trials": valid, "fully_timed_trials": sum(1 for e in events if e[2] is not None)}
    row["seed_tasks"] = seed_tasks(seeded, events)
    # candidates the lanes refused for computing another output than their task's default schedule, per task
    wrong = collections.Counter(t.name for x, t in recs if (x.error or "").startswith("wrong result"))
    row["wrong_results"] = dict(sorted(wrong.items()))
    row["output_checked_trials"] = sum(1 for x, _ in recs if x.output_checked)
    # the sample phase is wall time, so this is its CPU only while its threads are busy
    sample_s = sum(s.get("sample", 0.0) for s in splits)
    sample_cpu = sum(s.get("sample_cpu", 0.0) for s in splits)
    if sample_cpu:  # measured: the CPU of every search thread while it sampled
        row["search_cpu_s_per_valid_candidate"] = round(sample_cpu / max(1, valid), 3)
        row["search_cpu_s_per_valid_candidate_bound"] = round(sample_s * threads / max(1, valid), 3)
    else:  # an upper bound: the sample phase's wall time with every search thread busy
        row["search_cpu_s_per_valid_candidate"] = round(sample_s * threads / max(1, valid), 3)
    row.update(search_cpu_split(splits))
    floors = [s["launch_floor_s"] for s in splits if s.get("launch_floor_s")]
    row["launch_floor_us"] = round(1e6 * floors[0], 2) if floors else None  # what the gradients counted from
    return row


def settings_in_effect(environ: dict) -> dict[str, str]:
    """The SHARETUNE_ settings a run's services inherit (anything naming a secret left out): what a row was tuned
    under, beside the defaults of its code."""
    secret = ("PASSWORD", "SECRET", "TOKEN", "KEY")
    return {k: v for k, v in sorted(environ.items())
            if k.startswith("SHARETUNE_") and not any(word in k for word in secret)}


def task_bests(events: list) -> dict[str, float]:
    """Each task's best fully timed seconds among the events (a task with none is absent)."""
    best: dict[str, float] = {}
    for _, name, secs in events:
        if secs is not None:
            best[name] = min(best.get(name, secs), secs)
    return best


def seed_tasks(seeded: dict[str, list], events: list) -> dict:
    """Per task with warm seeds: how many were measured, the best seed's µs and the task's best µs in the run
    (fully timed trials; None where none was): how near the seeds started it."""
    best = task_bests(events)

    def us(secs):
        return None if secs is None else round(secs * 1e6, 2)

    return {name: {"seeds": len(times), "best_seed_us": us(min((x for x in times if x is not None), default=None)),
                   "task_best_us": us(best.get(name))} for name, times in sorted(seeded.items())}


def search_cpu_split(splits: list[dict]) -> dict:
    """The search's CPU a proposed candidate, evolutionary rounds apart from design-space sampling (empty where the
    splits predate the split)."""
    if not any("evolved" in s for s in splits):
        return {}
    evolved = sum(s.get("evolved", 0) for s in splits)
    sample_cpu = sum(s.get("sample_cpu", 0.0) for s in splits)
    evolve_cpu = sum(s.get("evolve_cpu", 0.0) for s in splits)
    drawn = sum(s.get("drawn", 0) for s in splits)
    return {"evolved_candidates": int(evolved), "drawn_candidates": int(drawn), "evolve_cpu_s": round(evolve_cpu, 2),
            "sample_cpu_s": round(sample_cpu - evolve_cpu, 2),
            "evolve_cpu_s_per_candidate": round(evolve_cpu / evolved, 3) if evolved else None,
            "sample_cpu_s_per_candidate": round((sample_cpu - evolve_cpu) / drawn, 3) if drawn else None}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


HEAVY_TASK_US = 8.0  # a task whose untuned kernel takes this long gets its own line in an A/B's summary


def settings_ab(runs: list[tuple[str, dict]], model: str) -> dict:
    """One model's cold runs under two or more settings (e.g. SHARETUNE_PAD_AWKWARD=matmul against off), each a
    time-to-quality result of its own: per run its label, wall, final and untuned estimates, served latencies,
    search CPU and, per task, the untuned and best fully timed microseconds and the trials it took; and the
    summary, each figure's mean per label."""
    out = []
    for label, result in runs:
        row = result["models"][model]
        cold, served = row["cold"], (row.get("served") or {}).get("latency_us", {})
        errs = (row.get("served") or {}).get("max_abs_err") or {}
        curve = latency_curve(cold["events"], cold["weights"], cold["defaults"])
        best = task_bests(cold["events"])
        trials = collections.Counter(task for _, task, _ in cold["events"])
        out.append({
            "label": label, "lease": cold.get("lease"), "settings": cold.get("settings"),
            "wall_s": cold["wall_s"], "trials": cold["trials"],
            "final_estimate_us": round(1e6 * curve[-1][2], 3) if curve else None,
            "untuned_estimate_us": round(1e6 * untuned_estimate(cold["weights"], cold["defaults"]), 3),
            "served_us": {k: round(v, 1) for k, v in served.items()},
            "max_abs_err": {k: (v if v is None or math.isfinite(v) else str(v)) for k, v in errs.items()},
            "wrong_output": wrong_outputs(row.get("served")),
            "wrong_results": cold.get("wrong_results"),  # candidates the lanes' output check refused, per task
            "output_checked_trials": cold.get("output_checked_trials"),  # candidates whose output matched
            "search_cpu_s_per_valid_candidate": cold.get("search_cpu_s_per_valid_candidate"),
            "launch_floor_us": cold.get("launch_floor_us"),
            "split_bests_us": cold.get("split_bests_us"),  # the tasks' bests that split their reduction (split_k)
            "tasks": {name: {"untuned_us": round(1e6 * d, 2),
                             "best_us": round(1e6 * best[name], 2) if name in best else None,
                             "trials": trials.get(name, 0)}
                      for name, d in cold["defaults"].items() if d}})

    def mean(values: list) -> float | None:
        values = [v for v in values if v is not None]
        return round(statistics.fmean(values), 3) if values else None

    labels = list(dict.fromkeys(r["label"] for r in out))
    by = {label: [r for r in out if r["label"] == label] for label in labels}
    summary = {key: {label: mean([get(r) for r in rs]) for label, rs in by.items()} for key, get in (
        ("final_estimate_us", lambda r: r["final_estimate_us"]),
        ("served_cold_us", lambda r: r["served_us"].get("cold")),
        ("served_untuned_us", lambda r: r["served_us"].get("untuned")),
        # within one serving process: steadier across runs than the microseconds, which move with the card's state
        ("served_cold_vs_stock", lambda r: _ratio(r["served_us"].get("cold"), r["served_us"].get("stock"))),
        ("search_cpu_s_per_valid_candidate", lambda r: r["search_cpu_s_per_valid_candidate"]))}
    summary["runs_with_wrong_output"] = {label: sum(1 for r in rs if r["wrong_output"]) for label, rs in by.items()}
    heavy = sorted({name for r in out for name, t in r["tasks"].items() if t["untuned_us"] >= HEAVY_TASK_US})
    for name in heavy:
        summary[f"{name}_best_us"] = {label: mean([r["tasks"].get(name, {}).get("best_us") for r in rs])
                                      for label, rs in by.items()}
    return {"model": model, "runs": out, "summary": summary}


def best_record_db(src: Path, dst: Path) -> Path:
    """`src`'s JSON database cut to each workload's best valid record (the one MetaSchedule's compile applies: the
    lowest mean run_secs), in `dst`: what task_timing.build_kernels takes (one record a workload)."""
    best: dict[int, tuple[float, str]] = {}
    for line in (src / "database_tuning_record.json").read_text().splitlines():
        if not line.strip():
            continue
        index, record = json.loads(line)
        secs = [s for s in (record[1] or []) if s is not None and s < 1e9]
        if secs and (index not in best or statistics.fmean(secs) < best[index][0]):
            best[index] = (statistics.fmean(secs), line)
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "database_workload.json").write_text((src / "database_workload.json").read_text())
    (dst / "database_tuning_record.json").write_text("".join(best[i][1] + "\n" for i in sorted(best)))
    return dst


def kernel_names(kernel_us: dict[str, dict[str, float]], workloads: dict[str, list[str]],
                 tasks: list[dict]) -> dict[str, dict[str, float]]:
    """Each set's kernel times (label -> workload index -> µs, model_timing --kernels) by task name: a workload
    named by stock's tasks.json entry of the same structural hash (`workloads`: label -> its database's workload
    lines), else `w<index>`; the launch floor's set (FLOOR_SET) by FLOOR_KERNEL."""
    names = {str(t["shash"]): t["name"] for t in tasks}
    out = {}
    for label, times in kernel_us.items():
        lines = workloads.get(label, [])
        shash = {str(i): str(json.loads(line)[0]) for i, line in enumerate(lines) if line.strip()}
        out[label] = {FLOOR_KERNEL if label == FLOOR_SET else names.get(shash.get(i, ""), f"w{i}"): round(us, 2)
                      for i, us in sorted(times.items())}
    return out


def kernel_sets(dbs: dict[str, Path], target_json: str, out_root: Path) -> tuple[dict, dict, dict]:
    """Each run's task kernels (label -> its JSON database: stock's, a service run's export) built from each
    workload's best record, a child process each (task_timing.build_all): ({label: kernels folder}, {label: why it
    has none}, {label: its workload lines}) for model_timing --kernels and kernel_names."""
    import shutil

    from sharetune.experiments.task_timing import KERNELS, build_all, floor_db

    shutil.rmtree(out_root / "kernels", ignore_errors=True)  # build_all keeps a folder built before: a run served again
    cut = {label: best_record_db(db, out_root / f"{label}-best") for label, db in dbs.items()}
    cut[FLOOR_SET] = floor_db(out_root / "floor-db")  # this machine's floor, beside the kernels it bounds
    folders, errors = build_all({label: (d, target_json) for label, d in cut.items()}, out_root / "kernels")
    for label, folder in folders.items():  # a workload whose kernel did not build: said, not silently missing
        built = json.loads((folder / KERNELS).read_text())
        errors.update({f"{label}/{index}": why for index, why in built.get("errors", {}).items()})
    workloads = {label: (d / "database_workload.json").read_text().splitlines() for label, d in cut.items()}
    return folders, errors, workloads


def run_databases(row: dict, stock_db: Path | None, kept_run) -> dict[str, Path]:
    """The JSON databases a row's modules were compiled with: stock's, and each service run's export (this lease's
    `database_dir`, else the kept run's `database`; `kept_run(phase)` -> its folder or None)."""
    dbs = {"stock": stock_db} if stock_db is not None else {}
    for phase in ("cold", "warm"):
        if not row.get(phase):
            continue
        exported = row[phase].get("database_dir")
        if exported and Path(exported).is_dir():
            dbs[phase] = Path(exported)
        elif (kept := kept_run(phase)) is not None and (kept / "database").is_dir():
            dbs[phase] = kept / "database"
    return dbs

"""A tuning run's throughput figures, as the scale benchmark (bench/scale_h200.py) records them: its timeline
second by second (lanes and GPU busy added to the sampled CPU and queues), where its idle core-seconds went,
its build CPU per candidate and what the slowest builds bought (and, for the build benchmarks, what a compile CPU
limit would cut and how many builds repeat a source), stock MetaSchedule's rate read from its log, and a results
file's parts joined and summarised against stock, with its table."""
from __future__ import annotations

import datetime as _dt
import json
import re
import statistics
from pathlib import Path

from shared.messages import JobState

ROLES = ("tuner", "builder", "lane", "updater", "other")  # a stack's processes, as the timeline groups them


def pipeline(rows: list[dict], t0: float, batches, gpu_samples, cores: int, tuners: int, png: Path, title: str) -> dict:
    """The run's timeline (one row a second), where its idle core-seconds went from the first candidate
    measured to the last, and its PNG."""
    add_lane_busy(rows, batches, t0)
    add_gpu_busy(rows, gpu_samples, t0)
    out = {"timeline": rows, "png": plot(rows, png, title, cores)}
    if batches:
        first, last = min(b.started_at for b in batches) - t0, max(b.finished_at for b in batches) - t0
        out.update(first_measured_s=round(first, 1), last_measured_s=round(last, 1),
                   **idle_attribution(rows, cores, first, last, tuners))
    return out


def add_lane_busy(rows: list[dict], batches, t0: float) -> None:
    """Each row's lanes busy (lane-seconds inside batches per second of the row's interval), from the lanes'
    batch clocks; `t0` is the timeline's start."""
    for i, row in enumerate(rows):
        lo = t0 + (rows[i - 1]["t"] if i else 0.0)
        hi = t0 + row["t"]
        inside = sum(max(0.0, min(b.finished_at, hi) - max(b.started_at, lo)) for b in batches)
        row["lanes_busy"] = round(inside / max(hi - lo, 1e-6), 2)


def add_gpu_busy(rows: list[dict], samples, t0: float) -> None:
    """Each row's GPU busy fraction: the mean NVML utilisation of the readings inside its interval."""
    for i, row in enumerate(rows):
        lo, hi = t0 + (rows[i - 1]["t"] if i else 0.0), t0 + row["t"]
        got = [s.utilization_gpu_pct for s in samples if lo <= s.timestamp < hi and s.utilization_gpu_pct is not None]
        row["gpu_busy"] = round(sum(got) / len(got) / 100, 3) if got else None


def idle_attribution(rows: list[dict], cores: int, start: float, end: float, tuners: int) -> dict:
    """Where the idle core-seconds between `start` and `end` (seconds on the timeline: first candidate sent
    to last measured) went. Each second's idle cores (its cores less host busy) are put down to one cause:

    - `drain`: after the last build (nothing queued to build and no builder busy from then on), the lanes timing
      what was built last: a job's end, which one job on one lane always has and several jobs overlap;
    - `builds_waiting`: candidates waited in the build queue, yet cores idled (builders too few or stalled);
    - `search_bound`: nothing to build and the `tuners` clients busy, half a core each or more (the search
      could not feed the builders);
    - `waiting_on_lanes`: nothing to build, the tuners mostly idle and candidates queued for or on the lanes;
    - `starved`: nothing queued anywhere and the tuners mostly idle (a client between steps).
    """
    out = dict.fromkeys(("drain", "builds_waiting", "search_bound", "waiting_on_lanes", "starved"), 0.0)
    drain_from = max((row["t"] for row in rows if (row.get("queued") or {}).get("build", 0) > 0
                      or row["cores_by_role"].get("builder", 0.0) >= 1.0), default=end)
    busy_s = span = 0.0
    prev = 0.0
    for row in rows:
        dt, t = row["t"] - prev, row["t"]
        prev = t
        if t <= start or t - dt >= end:
            continue
        span += dt
        busy_s += row["host_busy_cores"] * dt
        idle = max(0.0, cores - row["host_busy_cores"]) * dt
        q = row.get("queued") or {}
        searching = row["cores_by_role"].get("tuner", 0.0)
        if t > drain_from:
            cause = "drain"
        elif q.get("build", 0) > 0:
            cause = "builds_waiting"
        elif searching >= 0.5 * tuners:
            cause = "search_bound"
        elif q.get("measure", 0) > 0 or row.get("lanes_busy", 0) > 0.2:
            cause = "waiting_on_lanes"
        else:
            cause = "starved"
        out[cause] += idle
    total = sum(out.values())
    before = span - max(0.0, min(end, prev) - max(start, drain_from))  # the window up to the drain
    return {"window_s": round(span, 1), "host_busy_frac": round(busy_s / max(span * cores, 1e-9), 4),
            "drain_from_s": round(drain_from, 1),
            "host_busy_frac_before_drain": round(1 - (total - out["drain"]) / max(before * cores, 1e-9), 4),
            "idle_core_s": round(total, 1),
            "idle_core_s_by_cause": {k: round(v, 1) for k, v in out.items()},
            "idle_frac_by_cause": {k: round(v / total, 3) if total else 0.0 for k, v in out.items()}}


def plot(rows: list[dict], path, title: str, cores: int) -> str | None:
    """CPU cores busy per role (stacked) against the host's cores, the queues' depth, lanes and GPU busy."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    t = [row["t"] for row in rows]
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(11, 6.5), sharex=True, height_ratios=[3, 2])
    ax.stackplot(t, *[[row["cores_by_role"].get(k, 0.0) for row in rows] for k in ROLES], labels=ROLES, alpha=0.8)
    ax.plot(t, [row["host_busy_cores"] for row in rows], color="black", lw=1, label="host busy")
    ax.axhline(cores, color="grey", ls="--", lw=0.8)
    ax.set_ylabel("CPU cores busy")
    ax.legend(loc="upper right", fontsize=8, ncol=3)
    ax.set_title(title)
    for group, color in (("build", "tab:orange"), ("measure", "tab:red")):
        ax2.plot(t, [(row.get("queued") or {}).get(group, 0) for row in rows], color=color, lw=1, label=f"{group} queue")
    ax2.set_ylabel("candidates queued")
    ax2.set_xlabel("seconds from submit")
    ax3 = ax2.twinx()
    ax3.plot(t, [row.get("lanes_busy") or 0 for row in rows], color="tab:green", lw=1, label="lanes busy")
    if any(row.get("gpu_busy") is not None for row in rows):
        ax3.plot(t, [row.get("gpu_busy") or 0 for row in rows], color="tab:purple", lw=1, label="GPU busy")
    ax3.set_ylabel("lanes busy / GPU busy")
    lines = ax2.get_legend_handles_labels(), ax3.get_legend_handles_labels()
    ax2.legend(lines[0][0] + lines[1][0], lines[0][1] + lines[1][1], loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def batch_figures(batches, trials: int) -> dict:
    """From the first candidate measured to the last (the rate once planning is done), and the lane time a
    candidate took; empty without batches."""
    if not batches:
        return {}
    active = max(b.finished_at for b in batches) - min(b.started_at for b in batches)
    # builders feed a lane one candidate a batch: a batch's time is that candidate's lane time
    per = [(b.finished_at - b.started_at) / b.candidates for b in batches if b.candidates]
    return {"active_s": round(active, 1), "steady_trials_per_min": round(60 * trials / max(active, 1e-9), 1),
            "lane_s_per_candidate": round(statistics.median(per), 4),
            "lane_s_per_candidate_mean": round(statistics.mean(per), 4)}


def compile_cut(error: str | None) -> bool:
    """A build the compile limits stopped or refused (LaneSettings.cuda_compile_cpu_limit_s, _source_limit_kb)."""
    return bool(error) and "CUDA compile" in error and "over its limit" in error


def full_windows(recs: list) -> dict[str, int]:
    """The valid full timings by the window a repeat they were taken at (TimingConfig.settle_ms where the repeats
    agreed, min_repeat_ms otherwise; "-" for records that do not say)."""
    from collections import Counter

    from shared import store

    found = Counter(str(x.window_ms) if x.window_ms is not None else "-" for x in recs
                    if x.timing == "full" and store.valid_record(x))
    return {f"{k} ms" if k != "-" else k: n for k, n in sorted(found.items())}


def record_stats(recs: list) -> dict:
    """Per candidate of the job, from its records: build CPU seconds (median, mean, the share of the
    slowest builds), which timing each got."""
    from shared import store

    cpu = sorted(x.build_cpu_s for x in recs if x.build_cpu_s is not None)
    out = {"records": len(recs), "brief": sum(x.timing == "brief" for x in recs),
           "full": sum(x.timing == "full" and store.valid_record(x) for x in recs),
           "errors": sum(not store.valid_record(x) for x in recs),
           # builds the compile limits stopped or refused
           "builds_cut": sum(compile_cut(x.error) for x in recs), "full_windows": full_windows(recs)}
    if cpu:
        out.update(build_cpu_s_median=round(statistics.median(cpu), 3), build_cpu_s_mean=round(statistics.mean(cpu), 3),
                   build_cpu_s_p90=round(cpu[int(0.9 * (len(cpu) - 1))], 3), build_cpu_s_max=round(cpu[-1], 3),
                   build_cpu_s_total=round(sum(cpu), 1), built=len(cpu),
                   build_cpu_share_over_4s=round(sum(c for c in cpu if c > 4) / max(sum(cpu), 1e-9), 3))
        out.update(slow_build_worth(recs))
    return out


def slow_build_worth(recs, over_s: float = 4.0, near: float = 1.25) -> dict:
    """What the builds over `over_s` CPU seconds bought: how many there were, how many ran within `near` of
    their task's best, and how many tasks' bests they are (a build cap would have lost those)."""
    from shared import store
    from shared.ranking import rank_secs

    best: dict[str, float] = {}
    for x in recs:
        if store.valid_record(x):
            best[x.wkey] = min(best.get(x.wkey, float("inf")), rank_secs(x.run_secs))
    slow = [x for x in recs if x.build_cpu_s is not None and x.build_cpu_s > over_s]
    ran = [x for x in slow if store.valid_record(x)]
    return {"slow_builds": len(slow),
            "slow_builds_near_best": sum(rank_secs(x.run_secs) <= near * best[x.wkey] for x in ran),
            "slow_builds_task_bests": sum(rank_secs(x.run_secs) == best[x.wkey] for x in ran),
            "tasks": len(best)}


def summarise(result: dict) -> dict:
    """The issue's figures: throughput against stock (per model, then the worst model's), latency at equal
    trials, GPU busy, build CPU and lane time per candidate, screened against uniform timing."""
    rows, stocks = result["rows"], result.get("stocks") or {}
    summary: dict = {"per_model": {}}
    ratios: dict[str, list[float]] = {}
    for model, stock in stocks.items():
        mine = {row["config"]: row for row in rows if row["model"] == model}
        per = {"stock_trials_per_min": stock["trials_per_min"],
               "throughput_vs_stock": {c: round(row["trials_per_min"] / max(stock["trials_per_min"], 1e-9), 2)
                                       for c, row in mine.items()},
               "latency_vs_stock": {c: row.get("latency_vs_stock") for c, row in mine.items()}}
        summary["per_model"][model] = per
        for c, v in per["throughput_vs_stock"].items():
            ratios.setdefault(c, []).append(v)
    screened = {c: v for c, v in ratios.items() if not c.endswith(CONTROLS)}
    if screened:  # a configuration's ratio is its worst model's: every model must reach it
        best = max(screened, key=lambda c: min(screened[c]))
        summary["throughput_vs_stock"] = min(screened[best])
        summary["throughput_vs_stock_config"] = best
        one = next((c for c in screened if c.endswith("1x100")), None)
        summary["throughput_vs_stock_1x100"] = min(screened[one]) if one else None
        summary["throughput_vs_stock_per_config"] = {c: min(v) for c, v in ratios.items()}
    lat = [row["latency_vs_stock"] for row in rows
           if row.get("latency_vs_stock") and not row["config"].endswith(CONTROLS)]
    summary["latency_vs_stock"] = max(lat) if lat else None  # the worst configuration and model
    summary["latency_vs_stock_per_row"] = {f"{row['config']}/{row['model']}": row.get("latency_vs_stock") for row in rows}
    summary["gpu_busy_frac"] = {f"{row['config']}/{row['model']}": row.get("gpu_busy_frac") for row in rows}
    # CPU-bound or not: the host's busy fraction and CPU seconds a trial (every process of the stack)
    summary["host_cpu_busy_frac"] = {f"{row['config']}/{row['model']}": row.get("host_cpu_busy_frac") for row in rows}
    summary["cpu_s_per_trial"] = {f"{row['config']}/{row['model']}": row.get("cpu_s_per_trial") for row in rows}
    # how tightly the lanes timed, and at which window (docs/benchmarks.md, "Timing on a busy host")
    for key in ("p90", "short_p90"):  # every full timing's, and those of kernels under 20 us
        summary[f"timing_spread_{key}"] = {f"{row['config']}/{row['model']}": (row.get("timing_spread") or {}).get(key)
                                           for row in rows}
    summary["full_windows"] = {f"{row['config']}/{row['model']}": row.get("full_windows") for row in rows}
    cpu = [row for row in rows if row.get("built")]
    if cpu:  # over every built candidate of every run, weighted by how many each built
        n = sum(row["built"] for row in cpu)
        summary["build_cpu_s_mean"] = round(sum(row["build_cpu_s_total"] for row in cpu) / n, 3)
        summary["build_cpu_s_median"] = round(statistics.median(row["build_cpu_s_median"] for row in cpu), 3)
    hundred = [row["lane_s_per_candidate"] for row in rows if row.get("share") == 100 and row.get("lane_s_per_candidate")
               and not row["config"].endswith(CONTROLS)]
    summary["lane_s_per_candidate"] = round(statistics.median(hundred), 4) if hundred else None
    summary.update(pipeline_summary(result))
    summary.update(latency_summary(rows))
    both = result.get("screened_vs_uniform") or {}
    if both.get("latency_ratio"):  # timed side by side in one process
        summary["screened_vs_uniform_latency"] = both["latency_ratio"]
        summary["screened_vs_uniform_lane_s"] = [both["lane_s_per_candidate"]["screened"],
                                                 both["lane_s_per_candidate"]["uniform"]]
        return summary
    uni = next((row for row in rows if row.get("timing") == "uniform"), None)
    if uni:
        same = next((row for row in rows if row["model"] == uni["model"] and row["config"] == uni["config"].removesuffix("-uniform")), None)
        if same and same.get("tuned_latency_us") and uni.get("tuned_latency_us"):
            summary["screened_vs_uniform_latency"] = round(same["tuned_latency_us"] / uni["tuned_latency_us"], 3)
            summary["screened_vs_uniform_lane_s"] = [same.get("lane_s_per_candidate"), uni.get("lane_s_per_candidate")]
    return summary


# configurations that are controls of another (its name without the suffix): never a configuration's best figure
CONTROLS = ("-uniform", "-strict")


def quality_curve(row: dict) -> list:
    """A service row's estimated model latency after each trial (time_to_quality.latency_curve over its `quality`:
    each task's best full timing, weighted, a task's default schedule where faster or the task has none)."""
    from sharetune.experiments.time_to_quality import latency_curve

    q = row.get("quality")
    return latency_curve(q["events"], q["weights"], q["defaults"]) if q and q.get("events") else []


def estimated_us(row: dict) -> float | None:
    """A service row's final estimated model latency (µs)."""
    curve = quality_curve(row)
    return round(curve[-1][2] * 1e6, 3) if curve else None


def latency_summary(rows: list[dict]) -> dict:
    """Each row's final estimated latency, and each model against its variants (variant_pairs) where they ran."""
    out = {"estimated_latency_us": {f"{row['config']}/{row['model']}": estimated_us(row) for row in rows}}
    for key, suffix in (("settle_above_best_vs_strict", "-strict"), ("rounds_ahead_vs_default", "-ahead")):
        pairs = variant_pairs(rows, suffix)
        out |= {key: pairs} if pairs else {}
    return out


def variant_pairs(rows: list[dict], suffix: str) -> dict:
    """Each model's row against its variant (the configuration named with `suffix`: `-strict`, every full
    timing's disagreeing short window taken again at the floor; `-ahead`, rounds ahead): trials a minute, the
    lane's seconds a candidate, the full timings by window, the final estimated latency, and when each first
    reached the slower of the two finals (seconds from submit). The variant's key is the suffix's word."""
    from sharetune.experiments.time_to_quality import time_to_reach

    out = {}
    for ctl in (row for row in rows if row["config"].endswith(suffix) and row.get("quality")):
        base = ctl["config"].removesuffix(suffix)  # its twin's name, or its name's end ("1x100": "1gpu-1x100")
        twin = next((row for row in rows if row["model"] == ctl["model"] and row.get("quality")
                     and row["config"] in (base, f"1gpu-{base}")), None)
        if twin is None:
            continue
        pair = {"default": twin, suffix.lstrip("-"): ctl}
        curves = {k: quality_curve(row) for k, row in pair.items()}
        finals = {k: c[-1][2] for k, c in curves.items() if c}
        if len(finals) < 2:
            continue
        worse = max(finals.values())
        out[ctl["model"]] = {
            **{f: {k: row.get(f) for k, row in pair.items()} for f in ("trials_per_min", "lane_s_per_candidate_mean",
                                                                      "lane_busy_frac", "host_cpu_busy_frac")},
            "full_windows": {k: row.get("full_windows") for k, row in pair.items()},
            "estimated_latency_us": {k: round(v * 1e6, 3) for k, v in finals.items()},
            "estimated_latency_ratio": round(finals["default"] / finals[suffix.lstrip("-")], 4),
            "seconds_to_slower_final": {k: time_to_reach(c, worse)[0] for k, c in curves.items()},
        }
    return out


def pipeline_summary(result: dict) -> dict:
    """The worst model's and configuration's figures of the pipeline goals, and the multi-job run against
    the same models one after another on one 100 % lane."""
    rows = [row for row in result["rows"] if not row["config"].endswith(CONTROLS) and row.get("state") == JobState.DONE]
    stocks = result.get("stocks") or {}
    vs = [(row["trials_per_min"] / stocks[row["model"]]["trials_per_min"], f"{row['config']}/{row['model']}")
          for row in rows if row["model"] in stocks and stocks[row["model"]].get("trials_per_min")]
    busy = [(row["pipeline"]["host_busy_frac"], f"{row['config']}/{row['model']}") for row in rows
            if (row.get("pipeline") or {}).get("host_busy_frac") is not None]
    before_drain = [(row["pipeline"]["host_busy_frac_before_drain"], f"{row['config']}/{row['model']}") for row in rows
                    if (row.get("pipeline") or {}).get("host_busy_frac_before_drain") is not None]
    cpu = [(row["cpu_s_per_trial"], f"{row['config']}/{row['model']}") for row in rows if row.get("cpu_s_per_trial")]
    out: dict = {}
    for key, pairs, pick in (("throughput_vs_stock_min", vs, min), ("host_cpu_busy_min", busy, min),
                             ("host_cpu_busy_before_drain_min", before_drain, min), ("cpu_s_per_trial_max", cpu, max)):
        if pairs:
            value, where = pick(pairs)
            out[key], out[key + "_at"] = round(value, 3), where
    idle: dict[str, float] = {}
    for row in rows:
        for cause, v in ((row.get("pipeline") or {}).get("idle_core_s_by_cause") or {}).items():
            idle[cause] = idle.get(cause, 0.0) + v
    if idle:
        out["idle_core_s_by_cause"] = {k: round(v, 1) for k, v in idle.items()}
    multi = result.get("multi_job")
    if multi:
        # the same jobs alone, one after another: the one-lane configuration (1 x 100 %, or the rehearsal's)
        alone = {row["model"]: row for row in rows if row["config"].endswith("1x100") or row["config"] == "cpu-1lane"}
        m = {"makespan_s": multi["makespan_s"], "aggregate_trials_per_min": multi["aggregate_trials_per_min"],
             "share_spread": multi["shares"].get("share_spread"),
             "last_first_measured_s": multi["last_first_measured_s"]}
        if all(model in alone for model in multi["models"]):  # the same jobs one after another, 1 x 100 %
            seq_s = sum(alone[model]["tuning_s"] for model in multi["models"])
            seq_trials = sum(alone[model]["trials"] for model in multi["models"])
            m.update(sequential_s=round(seq_s, 1), makespan_vs_sequential=round(multi["makespan_s"] / seq_s, 3),
                     aggregate_vs_single=round(multi["aggregate_trials_per_min"] / (60 * seq_trials / seq_s), 3))
        out["multi_job"] = m
    return out


def print_table(result: dict) -> None:
    rows = list((result.get("stocks") or {}).values()) + result["rows"]
    print(f"\nmodels {result.get('model')}, {result.get('per_iter')} a round")
    print(f"{'config':<20}{'model':<12}{'lanes':>6}{'trials':>7}{'tr/min':>8}{'gpu busy':>9}{'lane s/c':>9}"
          f"{'bld cpu med':>12}{'mean':>7}{'brief':>6}{'tuned us':>10}{'vs stock@N':>11}")
    for row in rows:
        print(f"{row['config']:<20}{row.get('model', ''):<12}{row.get('lanes', 0):>6}{row.get('trials', 0):>7}"
              f"{row.get('trials_per_min', 0):>8}{_f(row.get('gpu_busy_frac')):>9}{_f(row.get('lane_s_per_candidate')):>9}"
              f"{_f(row.get('build_cpu_s_median')):>12}{_f(row.get('build_cpu_s_mean')):>7}{_f(row.get('brief')):>6}"
              f"{_f(row.get('tuned_latency_us')):>10}{_f(row.get('latency_vs_stock')):>11}")
    if result.get("summary"):
        print("summary:", json.dumps({k: v for k, v in result["summary"].items() if k != "per_model"}))


def _f(v) -> str:
    return "-" if v is None else f"{v:.3g}" if isinstance(v, float) else str(v)


def merged(parts: list[dict], stock_log: str | None = None) -> dict:
    """Results files of parts of a run joined, summarised again; with one stock row, its trials read again from
    stock's own `stock_log` (its text)."""
    rows = [row for part in parts for row in part["rows"]]
    stocks = {}
    for part in parts:
        stocks.update(part.get("stocks") or ({part["model"]: part["stock"]} if part.get("stock") else {}))
    if stock_log is not None and len(stocks) == 1:  # trials from stock's own log
        stock = next(iter(stocks.values()))
        stock.update(stock_log_figures(stock["trials"], stock["window_s"], stock_log))
    result = {k: v for k, v in parts[0].items() if k not in ("rows", "stock", "stocks", "part", "summary")}
    result.update(rows=rows, stocks=stocks, stock=next(iter(stocks.values()), None))
    result["summary"] = summarise(result)
    two, one = (next((row for row in rows if row["config"] == c), None) for c in ("2gpu-4x25-b32", "1gpu-4x25-b32"))
    if two and one:
        result["summary"]["scaling_efficiency_2gpu"] = round(two["trials_per_min"] / (2 * one["trials_per_min"]), 3)
    return result


def merge_files(paths: list[str], out_path: str, stock_log: str | None = None) -> None:
    """Results files of parts of a run joined into `out_path` (merged), their table printed."""
    log = Path(stock_log).read_text() if stock_log and Path(stock_log).exists() else None
    result = merged([json.loads(Path(p).read_text()) for p in paths], log)
    Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    Path(out_path).write_text(json.dumps(result, indent=1))
    print_table(result)


def stocks_of(result: dict) -> dict:
    """Stock's rows of an earlier result: this benchmark's, or the time-to-quality benchmark's (stock run to
    its budget, each model in its own lease)."""
    if result.get("stocks"):
        return result["stocks"]
    out = {}
    for model, row in (result.get("models") or {}).items():
        stock = row.get("stock") or {}
        if stock.get("trials_per_min"):
            out[model] = {"config": "stock", "model": model, "trials": stock["trials"], "window_s": stock["wall_s"],
                          "trials_per_min": stock["trials_per_min"], "lease": row.get("stock_lease"),
                          "note": "tune_tasks run to its budget (time_to_quality), 16 builders + LocalRunner"}
    return out


def stock_trials_from_log(log_text: str) -> int:
    """Candidates stock sent to its runner (timed right away by LocalRunner). Its task scheduler commits a
    task's records to the database only when it comes back to that task, so over a short window on a model
    with many tasks the database holds none of them: its own log is what counts."""
    return sum(int(m) for m in re.findall(r"Sending (\d+) valid sample\(s\) to runner", log_text))


def stock_steady_from_log(log_text: str) -> dict:
    """Stock's rate once started: from its first batch sent to the builder to its next task pick after the
    last batch it sent to the runner (that batch then timed)."""
    def at(line):
        return _dt.datetime.strptime(line[:19], "%Y-%m-%d %H:%M:%S").timestamp()

    lines = [l for l in log_text.splitlines() if re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", l)]
    first = next((at(l) for l in lines if re.search(r"sample\(s\) to builder", l)), None)
    runner = [i for i, l in enumerate(lines) if re.search(r"valid sample\(s\) to runner", l)]
    if first is None or not runner:
        return {}
    after = next((at(l) for l in lines[runner[-1] + 1:] if "TaskScheduler picks" in l), at(lines[runner[-1]]))
    trials = stock_trials_from_log(log_text)
    return {"active_s": round(after - first, 1), "steady_trials_per_min": round(60 * trials / max(after - first, 1e-9), 1)}


def stock_log_figures(committed: int, wall_s: float, log_text: str) -> dict:
    """Stock's trials over a window (its database's records, or its log's count when that is more), its rate, and
    its rate once started."""
    trials = max(committed, stock_trials_from_log(log_text))
    return {"trials": trials, "trials_per_min": round(60 * trials / wall_s, 1), **stock_steady_from_log(log_text)}

"""Throughput at the scale users tune, against stock MetaSchedule on the same machine (DESIGN.md section 4).

One H200 and its 16 cores: stock `tune_tasks` on each model for a fixed window, then this service, configuration
after configuration (CONFIGS), each in a fresh stack that builds cold. Tuned latency at equal trials: the service's
first N records (N = stock's) compiled as stock's are, both timed in one fresh process at the configuration's
share. The JSON is written after every step; a rerun with the same --work-dir and output resumes. docs/benchmarks.md.

    python -m bench.scale_h200 --models resnet18,transformer     # one GPU, ~20 min: background it
    python -m bench.scale_h200 --rehearse     # the same code on CPU lanes (llvm), small, on this host
    python -m bench.scale_h200 --merge A.json B.json --out bench/results/scale_h200.json
"""
from __future__ import annotations

import argparse, contextlib, json, os, statistics, subprocess, sys, time  # noqa: E401
from pathlib import Path

from bench.harness.common import child_env, cores_of, last_json_line, out_dir, tuning_options
from bench.harness.jobs import gpu_lane, gpus as find_gpus, job_records, local_stack, run_job
from bench.harness.samplers import BusySampler, CpuSampler, RunSamplers
from bench.harness.serving import export_job_records, serve, serving_mps, spawn_compile
from bench.harness.stock import kill_group, spawn_tune_tasks, stock_records
from bench.panel import model_arg as panel_model
from sharetune.experiments.time_to_quality import job_events, search_cpu_split
from sharetune.experiments.throughput import (
    batch_figures, merge_files, pipeline, print_table, record_stats, stock_log_figures, stocks_of, summarise,
)

CONFIGS = {  # name -> (lanes per GPU "NxPCT", GPUs, builders, builder cores, tuner-side cores, timing)
    "1gpu-1x100": ("1x100", 1, 16, "0-15", "0-15", "screen"),
    "1gpu-4x25": ("4x25", 1, 16, "0-15", "0-15", "screen"),
    "1gpu-1x100-uniform": ("1x100", 1, 16, "0-15", "0-15", "uniform"),  # every candidate timed fully
    "1gpu-4x25-multi": ("4x25", 1, 16, "0-15", "0-15", "screen"),
    "1gpu-1x100-8c": ("1x100", 1, 16, "0-15", "0-15", "screen"),  # twice the clients
    "1x100-strict": ("1x100", 1, 16, "0-15", "0-15", "screen"),  # full timings above the best at 50 ms too
    "1x100-ahead": ("1x100", 1, 16, "0-15", "0-15", "screen"),  # a round ahead while every task is measured
    "multi-8c": ("4x25", 1, 16, "0-15", "0-15", "screen"),  # the four jobs at once with twice the clients
}
REHEARSAL = {f"cpu-1lane{s}": ("measure.cpu.c0", 1, 1, "1", "0-1", "uniform" if s == "-uniform" else "screen")
             for s in ("", "-uniform", "-multi", "-2tuners", "-strict", "-ahead")}
TUNERS = {"1gpu-1x100-8c": 8, "multi-8c": 8, "cpu-1lane-2tuners": 2}  # clients where a configuration names them
DEFAULT_CONFIGS = ("1gpu-1x100", "1gpu-4x25", "1gpu-1x100-uniform")
FIRST_MODEL_ONLY = {"1gpu-1x100-uniform", "cpu-1lane-uniform"}  # the comparison runs on one model
MULTI = {"1gpu-4x25-multi", "multi-8c", "cpu-1lane-multi"}  # every model at once, against the same one after another


@contextlib.contextmanager
def config_stack(args, name: str, spec: tuple, gpus: list, work: Path):
    """A fresh stack of the configuration `spec` in `work`: yields (stack, its client, the row so far, the
    GPUs' UUIDs)."""
    from sharetune.client import Client

    lanes_spec, n_gpus, builders, builder_cores, tuner_cores, timing = spec
    os.sched_setaffinity(0, cores_of(tuner_cores))  # the stack's processes inherit it (builders: their own)
    if args.rehearse:
        lanes, share, uuids = [lanes_spec], 50, []
    else:
        count, pct = (int(x) for x in lanes_spec.split("x"))
        uuids = [g.uuid for g in gpus[:n_gpus]]
        lanes = [gpu_lane(u, pct) for u in uuids for _ in range(count)]
        share = pct
    tuners = TUNERS.get(name, args.tuners)
    os.environ["SHARETUNE_SEARCH_THREADS"] = str(max(1, len(cores_of(tuner_cores)) // tuners))
    os.environ.update(SHARETUNE_TIMING_SETTLE_ABOVE_BEST="0" if name.endswith("-strict") else "1",
                      SHARETUNE_ROUNDS_AHEAD="1" if name.endswith("-ahead") else "0")  # the controls' settings
    row = {"config": name, "gpus": n_gpus, "lanes": len(lanes), "share": share, "builders": builders,
           "builder_cores": builder_cores, "tuners": tuners, "per_iter": args.per_iter, "timing": timing}
    t_up = time.time()
    with local_stack(work, lanes, tuners, builders, builder_cores) as stack:
        row["stack_startup_s"] = round(time.time() - t_up, 1)
        yield stack, Client(stack.redis_url), row, uuids


def host_cores(spec: tuple) -> int:
    """The cores a configuration's stack runs on: its builders' and its tuner side's."""
    return len(cores_of(spec[3]) | cores_of(spec[4]))


def submitted(args, model: str, share: int, timing: str) -> dict:
    """A job's submit options: a panel model goes as its Relax module (converted before the clock starts)."""
    return dict(model=panel_model(model), name=model, target="cuda" if not args.rehearse else "llvm", share=share,
                trials=args.trials, trials_per_iter=args.per_iter, seed=args.seed, timing=timing,
                untuned_baseline=False)  # no untuned model compiled at the end: stock's rate counts no compile


def run_config(args, name: str, spec: tuple, gpus: list, work: Path, model: str) -> dict:
    from shared import store
    from shared.messages import lane_utilisation

    key = f"{name}-{model}"
    with config_stack(args, name, spec, gpus, work / key) as (stack, client, row, uuids):
        row["model"] = model
        options = submitted(args, model, row["share"], spec[5])
        samplers = RunSamplers(stack, uuids)
        job, final, wall = run_job(client, args.config_timeout, cancel_on_timeout=True, **options)
        t0 = time.time() - wall
        (rows, busy, cpu), status = samplers.stop(), job.status()
        row.update(cpu, cpu_s_per_trial=round(sum(cpu["cpu_s_by_role"].values()) / max(1, status["trials"] or 0), 2))
        r = store.connect(stack.redis_url)
        batches = store.lane_batches(r, job.job_id)
        # submit to the last candidate timed: the tuned model's compile after it is not tuning (stock's
        # window counts none either); the job's own wall time beside it
        tuned_s = max(b.finished_at for b in batches) - t0 if batches else wall
        row.update(state=final.get("state"), wall_s=round(wall, 1), tuning_s=round(tuned_s, 1), trials=status["trials"],
                   trials_per_min=round(60 * status["trials"] / tuned_s, 1),
                   gpu_busy_frac=round(statistics.mean(b for b in busy if b is not None), 4) if any(
                       b is not None for b in busy) else None,
                   gpu_busy_per_gpu=busy, task_trials={t["task"]: t["trials"] for t in status["tasks"]})
        lanes = lane_utilisation(batches, t0, t0 + wall)  # each lane's own busy clock, as the job result has it
        row.update(lane_busy_frac=lanes.get("mean_busy_frac"),
                   lane_busy_per_lane={k: v["busy_frac"] for k, v in lanes.get("per_lane", {}).items()})
        row.update(batch_figures(batches, status["trials"]))
        row.update(record_stats([x for x, _ in job_records(r, job.job_id)]))
        q = job_events(r, job.job_id, t0, wall, 1)  # the estimated latency's curve (full timings, as exported)
        row["quality"] = {k: q[k] for k in ("events", "weights", "defaults")}
        row["pipeline"] = pipeline(rows, samplers.timeline.t0, batches, samplers.gpu[0].samples,
                                   host_cores(spec), row["tuners"], args.png_dir / f"timeline-{key}.png", key)
        if final.get("state") == "done":
            res = job.result()
            row["tuned_module"] = res.tuned_module_path
            row["split_s"], row["timing_spread"] = res.time_split_s, res.timing_spread
            row["search_cpu_split"] = search_cpu_split([res.time_split_s])  # as the time-to-quality row has it
            row["full_timing_of_bests"] = res.retime.get("full_timing_of_bests")
        row["exported_trials"] = export_job_records(stack.redis_url, job.job_id, work / key / "records_db")
    return row


def run_multi(args, name: str, spec: tuple, gpus: list, work: Path, models: list[str]) -> dict:
    """Every model submitted at once to one stack (the same options as alone): the makespan, the aggregate
    rate, each job's wall time, when its first candidate was measured, and how the jobs shared the lanes."""
    from shared import store
    from shared.messages import FINAL_STATES, measurement_shares

    with config_stack(args, name, spec, gpus, work / name) as (stack, client, row, uuids):
        options = {m: submitted(args, m, row["share"], spec[5]) for m in models}  # converted before the clock
        samplers = RunSamplers(stack, uuids)
        t0 = time.time()
        jobs = {m: (time.time(), client.submit(**options[m])) for m in models}
        ended: dict[str, tuple[float, str]] = {}
        while len(ended) < len(jobs) and time.time() - t0 < args.config_timeout * len(models):
            for m, (_, job) in jobs.items():
                state = job.state()["state"]
                if m not in ended and state in FINAL_STATES:
                    ended[m] = (time.time(), state)
            time.sleep(0.5)
        rows, busy, cpu = samplers.stop()
        row.update(cpu)
        r = store.connect(stack.redis_url)
        batches = {m: store.lane_batches(r, job.job_id) for m, (_, job) in jobs.items()}
        per_job = {}
        for m, (sent, job) in jobs.items():
            bs, status = batches[m], job.status()
            end = max((b.finished_at for b in bs), default=time.time())
            per_job[m] = {"job_id": job.job_id, "state": ended.get(m, (None, "timeout"))[1], "submitted_s": round(sent - t0, 1),
                          "trials": status["trials"], "tuning_s": round(end - sent, 1),
                          "first_measured_s": round(min(b.started_at for b in bs) - sent, 1) if bs else None}
        trials = sum(j["trials"] for j in per_job.values())
        makespan = max(max((b.finished_at for b in bs), default=t0) for bs in batches.values()) - t0
        shares = measurement_shares({m: [x.measured_at for x, _ in job_records(r, job.job_id)]
                                     for m, (_, job) in jobs.items()})
        row.update(models=models, jobs=per_job, trials=trials, makespan_s=round(makespan, 1),
                   aggregate_trials_per_min=round(60 * trials / max(makespan, 1e-9), 1),
                   cpu_s_per_trial=round(sum(row["cpu_s_by_role"].values()) / max(1, trials), 2),
                   gpu_busy_frac=busy[0], shares={k: v for k, v in shares.items() if k != "first_measured_at"},
                   last_first_measured_s=max((j["first_measured_s"] or 0.0) for j in per_job.values()))
        row["pipeline"] = pipeline(rows, samplers.timeline.t0, [b for bs in batches.values() for b in bs],
                                   samplers.gpu[0].samples, host_cores(spec), row["tuners"],
                                   args.png_dir / f"timeline-{name}.png", f"{name}: {', '.join(models)}")
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    tuning_options(ap, None, 1024, 15, "/tmp/scale_bench")  # models: resnet18,transformer (rehearsal: tiny)
    ap.add_argument("--configs", default=None, help="comma-separated names (default: DEFAULT_CONFIGS)")
    ap.add_argument("--stock-window", type=float, default=360.0, help="seconds of stock tuning a model (>= ~6 min)")
    ap.add_argument("--stock-max-trials", type=int, default=100000)
    ap.add_argument("--stock-models", default=None, help="models whose stock window runs (default: every model)")
    ap.add_argument("--stock-from", help="an earlier result JSON whose stock rows stand for the models not run here")
    ap.add_argument("--config-timeout", type=float, default=600.0, help="a job's limit, its final compile included")
    ap.add_argument("--out-json", default=None, help="default: $OUT/scale_partA.json")
    ap.add_argument("--resume-from", help="a results JSON of the same models and budget: its rows kept, the rest run")
    ap.add_argument("--no-serve", dest="serve", action="store_false", help="no tuned model served (ttq times them)")
    ap.add_argument("--merge", nargs="*")
    ap.add_argument("--out", default=None)
    ap.add_argument("--stock-log", default=None, help="with --merge: stock's log, whose trials count")
    args = ap.parse_args(argv)
    if args.merge:
        merge_files(args.merge, args.out or "bench/results/scale_h200.json", args.stock_log)
        return 0
    if args.rehearse and args.trials == 1024:
        args.trials, args.per_iter, args.stock_window, args.config_timeout = 24, 8, 150.0, 600.0
    return run_part(args)


def run_part(args) -> int:
    work = Path(args.work_dir) / "partA"
    work.mkdir(parents=True, exist_ok=True)
    models = (args.models or ("tiny" if args.rehearse else "resnet18,transformer")).split(",")
    gpus = [] if args.rehearse else find_gpus()
    probe = None if args.rehearse else probe_hidden_gpu_build()
    if probe is not None and not probe.get("cubin"):  # keep builders off the lanes' contexts, at least (they open none)
        os.environ["SHARETUNE_BUILDER_HIDE_GPUS"] = "0"
    table = REHEARSAL if args.rehearse else CONFIGS
    names_ = [n for n in (args.configs or ",".join(REHEARSAL if args.rehearse else DEFAULT_CONFIGS)).split(",")
              if args.rehearse or table[n][1] <= max(1, len(gpus))]  # configurations the GPUs found allow
    out_json = Path(args.out_json) if args.out_json else out_dir() / "scale_partA.json"
    args.png_dir = out_json.parent
    result = {"model": ",".join(models), "models": models, "per_iter": args.per_iter, "trials_budget": args.trials,
              "part": "A", "host_cores": os.cpu_count(), "gpus": [g.uuid for g in gpus], "rows": [],
              "stock": None, "stocks": {}, "builder_probe": probe, "phase": "stock"}
    earlier = out_json if out_json.exists() or not args.resume_from else Path(args.resume_from)
    if earlier.exists():  # resume: keep what a run stopped part-way (or the file named) measured
        done = json.loads(earlier.read_text())
        if done.get("models") == models and done.get("trials_budget") == args.trials:
            result.update({k: done[k] for k in ("rows", "stocks", "stock") if done.get(k)})
            print(f"resuming: stock of {sorted(result['stocks'])}, {len(result['rows'])} rows", flush=True)

    def save():
        out_json.write_text(json.dumps(result, indent=1))

    if args.stock_from:
        earlier = stocks_of(json.loads(Path(args.stock_from).read_text()))
        for model, stock in earlier.items():
            if model in models and model not in result["stocks"]:
                result["stocks"][model] = dict(stock, from_earlier_run=args.stock_from)
    stock_models = args.stock_models.split(",") if args.stock_models else models
    for model in stock_models if args.stock_window > 0 else []:  # stock alone on the machine first, model after model
        if model not in result["stocks"]:  # (--stock-window 0: the service's rows only)
            stock = start_stock(args, gpus, work / model, model, cores="1" if args.rehearse else "0-15")
            time.sleep(args.stock_window)
            result["stocks"][model] = stop_stock(stock, args)
            print(json.dumps(result["stocks"][model]), flush=True)
            save()
    result["stock"] = result["stocks"].get(models[0])
    result["phase"] = "service"
    # configuration by configuration (a run cut short has the first configuration on every model), a model's
    # equal-trials latency as soon as its rows are in; the first-model-only controls last
    steps = []
    for n in names_:
        steps += [(n, "*")] if n in MULTI else [] if n in FIRST_MODEL_ONLY else [(n, m) for m in models]
    steps += [(n, models[0]) for n in names_ if n in FIRST_MODEL_ONLY]
    last_step = {m: i for i, (_, m) in enumerate(steps)}
    for i, (name, model) in enumerate(steps):
        if model == "*":
            if not result.get("multi_job"):
                result["multi_job"] = run_multi(args, name, table[name], gpus, work, models)
                result["summary"] = summarise(result)
                save()
            continue
        if not any(r["config"] == name and r["model"] == model for r in result["rows"]):
            row = run_config(args, name, table[name], gpus, work / model, model)
            result["rows"].append(row)
            print(json.dumps({k: v for k, v in row.items() if k not in ("lane_busy_per_lane", "task_trials", "split_s", "quality")}
                             | {"pipeline": {k: v for k, v in row.get("pipeline", {}).items() if k != "timeline"}}),
                  flush=True)
            save()
        if args.serve and (i == last_step[model] or (steps[i + 1][0] in FIRST_MODEL_ONLY
                                                     and name not in FIRST_MODEL_ONLY)):
            equal_trials_latency(args, result, model, gpus, work / model)
            result["summary"] = summarise(result)
            save()
    if args.serve:
        screened_against_uniform(args, result, gpus, work)
    result["summary"] = summarise(result)
    result["phase"] = "done"
    save()
    print_table(result)
    print("wrote", out_json)
    return 0


PROBE = """
import json, tvm
from services.measurer.metaschedule.build import build, trivial_kernel
from services.measurer.metaschedule.targets import family_target
t = family_target("cuda.sm_90")
rt = build(trivial_kernel(t), t)
print(json.dumps({"cubin": all(m.is_runnable() for m in rt.imports if m.kind == "cuda")}))
"""


def probe_hidden_gpu_build() -> dict:
    """Can a process that sees no GPU (as builders run) compile CUDA to a cubin here?"""
    from services.measurer.lane_pool import builder_environment

    out = subprocess.run([sys.executable, "-c", PROBE], env=child_env(**builder_environment("cuda.sm_90")),
                         capture_output=True, text=True, timeout=120)
    answer = last_json_line(out, "error")
    return answer if "error" not in answer else {"cubin": False, **answer}


def start_stock(args, gpus, work: Path, model: str, cores: str) -> dict:
    stock_work = work / "stock"
    stock_work.mkdir(parents=True, exist_ok=True)
    uuid = None if args.rehearse else gpus[0].uuid
    proc = spawn_tune_tasks(model, stock_work, args.per_iter, args.stock_max_trials, cores, uuid, args.rehearse,
                            work / "stock.log")
    return {"proc": proc, "t0": time.time(), "work": stock_work, "sampler": BusySampler(uuid), "uuid": uuid,
            "cores": cores, "model": model, "cpu": CpuSampler({"stock": proc})}


def stop_stock(stock: dict, args) -> dict:
    wall = time.time() - stock["t0"]
    cpu = stock["cpu"].stop()
    kill_group(stock["proc"])
    busy = stock["sampler"].stop()
    committed = len(stock_records(stock["work"]))
    log = stock["work"].parent / "stock.log"
    text = log.read_text() if log.exists() else ""
    figures = stock_log_figures(committed, wall, text)
    trials = figures.pop("trials")
    row = {"config": "stock", "model": stock["model"], "gpus": 1, "lanes": 0, "builders": len(cores_of(stock["cores"])),
           "per_iter": args.per_iter, "window_s": round(wall, 1), "trials": trials, "committed_records": committed,
           "trials_per_min": figures.pop("trials_per_min"), "gpu_busy_frac": busy, "work": str(stock["work"]),
           "note": "LocalBuilder(max_workers=its cores, timeout_sec=120) + LocalRunner, stopped at the window", **figures}
    row.update(cpu, cpu_s_per_trial=round(sum(cpu["cpu_s_by_role"].values()) / trials, 2) if trials else None)
    return row


def equal_trials_latency(args, result: dict, model: str, gpus, work: Path) -> None:
    """Compile stock's model from its committed records and each configuration's from its first N (N =
    stock's), in parallel on the cores; time each configuration's pair at its share."""
    stock = result["stocks"].get(model) or {}
    rows = [r for r in result["rows"] if r["model"] == model and "tuned_latency_us" not in r]
    if not rows:
        return
    uuid0 = gpus[0].uuid if gpus else None
    n_cores = os.cpu_count() or 1
    compiles = {}
    if stock.get("committed_records"):  # else no equal-trials latency (a longer window, or --stock-max-trials)
        compiles["stock"] = spawn_compile(Path(stock["work"]), stock["committed_records"], work / "stock.so",
                                          "0" if args.rehearse else "0-3", uuid0, model, args.rehearse)
    for i, row in enumerate(rows):
        if row.get("exported_trials") and stock.get("committed_records"):
            row["compared_at_trials"] = min(stock["committed_records"], row["exported_trials"])
            first = 4 + 4 * i
            cores = "0" if args.rehearse else f"{first % n_cores}-{min(first % n_cores + 3, n_cores - 1)}"
            compiles[row["config"]] = spawn_compile(work / f"{row['config']}-{model}" / "records_db",
                                                    row["compared_at_trials"], work / f"{row['config']}.so", cores,
                                                    uuid0, model, args.rehearse)
    for proc in compiles.values():
        proc.wait(timeout=420)
    ok = {label: str(work / f"{label}.so") for label in compiles if (work / f"{label}.so").exists()}
    stock["tuned_module_at_trials"] = ok.get("stock")
    with serving_mps(work / "serve-mps", bool(uuid0)) as mps_env:
        for row in rows:
            label = row["config"]
            mods = {k: v for k, v in {"stock": ok.get("stock"), "ours_at_stock_trials": ok.get(label),
                                      "ours_full": row.get("tuned_module")}.items() if v}
            served = serve(mods, model, work, args.serve_rounds, uuid0, row["share"], mps_env)
            lat = served.get("latency_us", {})
            row["tuned_latency_us"] = round(lat["ours_full"], 2) if "ours_full" in lat else None
            row["tuned_latency_us_at_stock_trials"] = (round(lat["ours_at_stock_trials"], 2)
                                                       if "ours_at_stock_trials" in lat else None)
            row["stock_latency_us_at_share"] = round(lat["stock"], 2) if "stock" in lat else None
            row["serve_errors"] = served.get("errors") or None
            if "stock" in lat and "ours_at_stock_trials" in lat:
                row["latency_vs_stock"] = round(lat["ours_at_stock_trials"] / lat["stock"], 3)
            if row["share"] == 100 and "stock" in lat and stock:
                stock["tuned_latency_us"] = round(lat["stock"], 2)


def screened_against_uniform(args, result: dict, gpus, work: Path) -> None:
    """The uniform-timing control's tuned module and its screened twin's (same model, seed, trials, share),
    timed in one fresh process, interleaved round by round, so GPU drift between the two rows' own serving
    runs cannot decide the verdict. Each round's figure is kept to show the spread."""
    uni = next((r for r in result["rows"] if r.get("timing") == "uniform" and r.get("tuned_module")), None)
    if uni is None or result.get("screened_vs_uniform"):
        return
    twin = next((r for r in result["rows"] if r["model"] == uni["model"] and r.get("tuned_module")
                 and r["config"] == uni["config"].removesuffix("-uniform")), None)
    if twin is None:
        return
    mods = {"screened": twin["tuned_module"], "uniform": uni["tuned_module"]}
    if not all(Path(m).exists() for m in mods.values()):
        return
    uuid0 = gpus[0].uuid if gpus else None
    with serving_mps(work / "serve-mps-uniform", bool(uuid0) and uni["share"] < 100) as mps_env:
        served = serve(mods, uni["model"], work / uni["model"], 2 * args.serve_rounds, uuid0, uni["share"], mps_env)
    lat = served.get("latency_us", {})
    out = {"model": uni["model"], "share": uni["share"], "latency_us": lat, "rounds_us": served.get("rounds_us"),
           "errors": served.get("errors") or None,
           **{k: {"screened": twin.get(k), "uniform": uni.get(k)}
              for k in ("full_timing_of_bests", "trials_per_min", "lane_s_per_candidate", "gpu_busy_frac")}}
    if "screened" in lat and "uniform" in lat:
        out["latency_ratio"] = round(lat["screened"] / lat["uniform"], 3)
    result["screened_vs_uniform"] = out
    print(json.dumps({"screened_vs_uniform": out}), flush=True)


if __name__ == "__main__":
    sys.exit(main())

"""`sharetune` command line (Click). One function per subcommand taking its parsed options as attributes, and
its options declared once, at the end; `--json` on the user-side commands is for scripts."""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path

import click

from shared.messages import JobOptions, JobState, cli_flag


def _redis_url(args) -> str:
    """REDIS_URL, else the URL `sharetune up` wrote to its work dir (SHARETUNE_WORK_DIR, default runs/stack)."""
    if os.environ.get("REDIS_URL"):
        return os.environ["REDIS_URL"]
    from sharetune.stack.supervisor import recorded_url

    return recorded_url(args.settings.work_dir) or "redis://127.0.0.1:6379/0"


def _client(args):
    from sharetune.client import Client

    return Client(_redis_url(args))


def _print_json(obj) -> None:
    print(json.dumps(obj, indent=1, default=str))


# ---- demo, up, down: the local topology -------------------------------------------------------------



def cmd_demo(args) -> int:
    from sharetune.demo import run_demo

    return run_demo(args.model, args.trials, args.per_iter, args.work_dir, settings=args.settings)



def cmd_up(args) -> int:
    """Start a supervisor of its own (sharetune/stack/supervisor.py) that runs the stack and restarts what dies;
    return once the stack is ready. One stack per work dir."""
    from shared.store import masked_url
    from sharetune.stack import supervisor
    from services.measurer.agent import gpu_lanes

    live = supervisor.running(args.work_dir)
    if live:
        sup = live.get("supervisor_pid")
        if not supervisor.process_alive(sup):  # its processes outlived it: nothing restarts them, nor would a new `up`
            print(f"sharetune up: the supervisor (pid {sup}) of the stack in {args.work_dir} is dead, but its "
                  f"processes still run: `sharetune down --work-dir {args.work_dir}` ends them, then `up` again",
                  file=sys.stderr)
            return 1
        print(f"sharetune up: a stack is already running in {args.work_dir}: REDIS_URL={masked_url(live.get('redis_url'))}, "
              f"supervisor pid {sup} (sharetune services / sharetune down --work-dir "
              f"{args.work_dir})", file=sys.stderr)
        return 1
    lanes = args.lanes.split(",") if args.lanes else (gpu_lanes(args.gpu) if args.gpu else None)
    families = args.builder_family.split(",") if args.builder_family else None
    if args.builders < 0:
        print("sharetune up: --builders must be 0 or more", file=sys.stderr)
        return 2
    if lanes is None and args.join and families:
        lanes = []  # a build-only host joining a stack
    opts = [f"--lanes={','.join(lanes)}"] if lanes is not None else []
    for flag, value in (("--tuners", args.tuners), ("--builders", args.builders),
                        ("--builder-cores", args.builder_cores), ("--builder-family", args.builder_family)):
        if value is not None:
            opts += [flag, str(value)]
    proc = supervisor.spawn(args.work_dir, opts, join_url=args.join)  # the URL in its env: ps shows argv
    try:
        state = supervisor.wait_ready(args.work_dir, proc)
    except KeyboardInterrupt:
        proc.terminate()  # the supervisor stops what it started
        raise
    except (RuntimeError, TimeoutError) as err:
        print(f"sharetune up: {err}", file=sys.stderr)
        return 1
    # the password stays off the terminal (and its scrollback, CI logs): the full URL is in a file of the owner's
    print(f"REDIS_URL={masked_url(state['redis_url'])}")
    if not args.join:
        print(f"the full URL is in {os.path.join(args.work_dir, supervisor.URL_FILE)} (yours alone): the other commands "
              f"read it there, or: export REDIS_URL=$(sharetune url --work-dir {args.work_dir})")
    builders = [n for n in state["pids"] if n.startswith("builder-")]
    print(f"lanes: {', '.join(state['lanes']) or 'none'}; builders: {len(builders)}; supervised by pid "
          f"{state['supervisor_pid']} (see: sharetune services --work-dir {args.work_dir}); "
          f"stop with: sharetune down --work-dir {args.work_dir}")
    return 0



def cmd_down(args) -> int:
    from sharetune.stack import supervisor

    stopped = supervisor.stop(args.work_dir)
    if stopped is None:
        print(f"no stack running in {args.work_dir}")
        return 0
    print("stopped: " + ", ".join(stopped))
    return 0



def cmd_url(args) -> int:
    """The full REDIS_URL (with its password) of the stack `up` runs in the work dir, for its owner:
    `export REDIS_URL=$(sharetune url)`."""
    from sharetune.stack import supervisor

    url = supervisor.recorded_url(args.work_dir) or (supervisor.running(args.work_dir) or {}).get("redis_url")
    if not url:
        path = os.path.join(args.work_dir, supervisor.URL_FILE)
        print(f"sharetune url: no stack URL recorded in {args.work_dir} ({path} is missing or unreadable; "
              f"`sharetune up --work-dir {args.work_dir}` records it)", file=sys.stderr)
        return 1
    print(url)
    return 0


def cmd_services(args) -> int:
    from shared.store import masked_url
    from sharetune.stack import supervisor

    state = supervisor.read_state(args.work_dir)
    if state is None:
        print(f"no stack running in {args.work_dir}")
        return 1
    sup = state.get("supervisor_pid")
    sup_alive = supervisor.process_alive(sup)
    rows = [{**r, "alive": bool(r["alive"] and supervisor.process_alive(r["pid"]))} for r in state.get("services", [])]
    # non-zero for scripts and health checks: nothing restarts, or something was given up
    healthy = 0 if sup_alive and not any(r["given_up"] for r in rows) else 1
    if args.json:
        _print_json({"work_dir": state.get("work_dir"), "redis_url": masked_url(state.get("redis_url")), "supervisor_pid": sup,
                     "supervisor_alive": sup_alive, "ready": state.get("ready"), "updated_at": state.get("updated_at"),
                     "services": rows})
        return healthy
    age = time.time() - (state.get("updated_at") or 0)
    print(f"supervisor pid {sup} {'alive' if sup_alive else 'DEAD (nothing is restarted)'}; REDIS_URL="
          f"{masked_url(state.get('redis_url'))}; {'ready' if state.get('ready') else 'starting'}; state {age:.0f} s old")
    for r in rows:
        status = "GIVEN UP: " + r["given_up"] if r["given_up"] else ("alive" if r["alive"] else "dead")
        print(f"  {r['name']:<32} {r['kind']:<8} pid {str(r['pid'] or '-'):>7}  restarts {r['restarts']:>2}  {status}")
    return healthy


# ---- the user's side: submit, status, watch, results, export, lanes, cancel, report -------------------



def cmd_submit(args) -> int:
    options = {name: getattr(args, name) for name in JobOptions.model_fields}
    if options["only_tasks"] is not None:
        options["only_tasks"] = [t.strip() for t in options["only_tasks"].split(",") if t.strip()]
    job = _client(args).submit(args.model, **options)
    if args.json and not (args.wait or args.watch):
        _print_json({"job_id": job.job_id})
    elif not args.json:
        print(job.job_id, flush=True)
        _print_advice(job)
    if args.watch:
        return _watch(job, args.json)
    if args.wait:
        final = job.wait()
        st = job.status()
        if args.json:
            _print_json(st)
        else:
            _print_status(st)
        return 0 if final.get("state") == JobState.DONE else 1
    return 0


def _print_advice(job, plan_wait_s: float = 20.0) -> None:
    """Once the job is planned (a few seconds), the budget advice if its trials cannot reach every task."""
    deadline = time.time() + plan_wait_s
    st = job.status()
    while st["state"] in (JobState.QUEUED, JobState.PLANNING) and not st["waiting_for"] and time.time() < deadline:
        time.sleep(0.3)
        st = job.status()
    if st["waiting_for"]:
        print(f"waiting for {st['waiting_for']} (cancel with: sharetune cancel {job.job_id})", file=sys.stderr)
    if st["advice"]:
        print(f"budget advice: {st['advice']}", file=sys.stderr)



def cmd_status(args) -> int:
    from sharetune.progress import estimates

    client = _client(args)
    if not args.job_id:
        rows = []
        for job in client.jobs(20):
            s = job.status()
            rows.append({k: s[k] for k in ("job_id", "name", "state", "trials", "budget", "share", "target")})
        if args.json:
            _print_json(rows)
        else:
            for r in rows:
                print(f"{r['job_id']}  {r['state']:<10} {r['trials']:>5}/{r['budget']:<5} {r['target']} {r['share']} %  {r['name']}")
        return 0
    st = client.job(args.job_id).status()
    if args.json:
        _print_json({**st, "estimates": estimates(st, time.time())})
    else:
        _print_status(st)
    return 0


def _print_status(st: dict) -> None:
    """A job's status view: its bar, one line per task, the budget advice."""
    from sharetune.progress import render

    from sharetune.progress import accounting_line

    print("\n".join(render(st, time.time(), _width())))
    if accounting_line(st.get("accounting")):
        print(accounting_line(st.get("accounting")))
    if st.get("advice"):
        print(f"budget advice: {st['advice']}")
    if st.get("stopped"):
        print(f"stopped early: {st['stopped']}")



def cmd_watch(args) -> int:
    return _watch(_client(args).job(args.job_id), args.json, args.interval)


def _width() -> int:
    import shutil

    return shutil.get_terminal_size((100, 24)).columns


def _watch(job, as_json: bool = False, interval: float = 1.0) -> int:
    """Redraw in place on a terminal; elsewhere (a pipe, a log) print only when something changed."""
    from sharetune.client import FINAL_STATES
    from sharetune.progress import estimates, live_view, render

    live = None
    if sys.stdout.isatty() and not as_json:
        from rich.live import Live

        live = Live(auto_refresh=False)
        live.start()
    last = None
    try:
        while True:
            st = job.status()
            key = (st["state"], st["trials"], tuple((t["trials"], t["best_us"]) for t in st["tasks"]))
            if live is not None:
                live.update(live_view(st, time.time()), refresh=True)
            elif key != last:
                print(json.dumps({**st, "estimates": estimates(st, time.time())}, default=str) if as_json
                      else "\n".join(render(st, time.time(), _width())), flush=True)
            last = key
            if st["state"] in FINAL_STATES:
                return 0 if st["state"] == JobState.DONE else 1
            time.sleep(interval)
    finally:
        if live is not None:
            live.stop()



def cmd_results(args) -> int:
    from shared.errors import SharetuneError
    from sharetune.progress import accounting_line, fmt_us, timing_line

    job = _client(args).job(args.job_id)
    res = job.result()
    if args.json:
        print(res.model_dump_json(indent=1))
        return 0
    advice = job.state().get("advice")
    if advice:
        print(f"budget advice: {advice}")
    print(f"job {res.job_id}: {res.trials} trials in {res.wall_s:.0f} s on {res.target}")
    if res.stopped:
        print(f"stopped early: {res.stopped}")
    if res.accounting is not None:
        print(accounting_line(res.accounting.model_dump()))
    for t in res.tasks:
        kept = "" if t.applied or t.best_us is None else "  (default kept: as fast or faster)"
        print(f"  {t.name:<40} x{t.weight:<2} {t.trials:>4} trials  best {fmt_us(t.best_us):>10}  "
              f"default {fmt_us(t.default_us):>10}  lane {t.best_lane or '-'}{kept}")
    print(f"tuned module:   {res.tuned_module_path}\nuntuned module: {res.untuned_module_path}")
    print(f"TVM database:   {res.database_dir}")
    print("time split (s): " + ", ".join(f"{k} {v}" for k, v in res.time_split_s.items()))
    print(timing_line(res))
    curve = tuning_curve_points(job)
    if curve:  # where to stop: the model's estimate as trials and time went by
        print("model estimate (sum of task bests x weight): " + ", ".join(
            f"{p['trial']} trials {p['t']:.0f} s {fmt_us(p['est_us'])}" for p in curve))
    try:
        lat = job.latency_us()
    except SharetuneError as err:
        print(f"end-to-end latency: not timed ({err})")
        return 0
    if lat.get("tuned") and lat.get("untuned"):
        print(f"end-to-end latency ({lat['cores']} core{'s' * (lat['cores'] > 1)}): tuned {fmt_us(lat['tuned'])}, "
              f"untuned {fmt_us(lat['untuned'])}, {lat['untuned'] / lat['tuned']:.2f}x")
    else:
        print("end-to-end latency: " + ", ".join(f"{k} {fmt_us(lat[k])}" for k in ("tuned", "untuned") if lat.get(k))
              + "".join(f"; {k} failed: {e}" for k, e in lat.get("errors", {}).items()))
    return 0


def tuning_curve_points(job, points: int = 5) -> list[dict]:
    """A few points of the job's tuning curve (the report draws all of it), from the first trial at which
    every task had a best to the last."""
    from sharetune.experiments.report import job_data

    curve = job_data(job.client.redis, job.job_id)["job_curve"]
    if not curve:
        return []
    idx = sorted({round(i * (len(curve) - 1) / max(1, points - 1)) for i in range(points)})
    return [curve[i] for i in idx]



def cmd_export(args) -> int:
    from pathlib import Path

    from shared import store

    client = _client(args)
    client.job(args.job_id)
    wkeys = [t.wkey for t in store.job_tasks(client.redis, args.job_id)]
    out = Path(args.out or f"{args.job_id}-database")
    out.mkdir(parents=True, exist_ok=True)
    kept = 0
    if args.format == "tvm":
        from services.tuner.metaschedule.records import export_json_database

        _, n, kept = export_json_database(client.redis, wkeys, str(out))
        what = f"{n} tuning records in TVM's database"
        if kept:
            what += f" ({kept} workload{'s' * (kept > 1)} keep{'s' * (kept == 1)} its default schedule: no record)"
    else:
        n = 0
        with open(out / "records.jsonl", "w") as f:
            for wkey in wkeys:
                for rec in store.records(client.redis, wkey):
                    if args.all_jobs or rec.job_id == args.job_id:
                        f.write(rec.model_dump_json() + "\n")
                        n += 1
        what = f"{n} records ({'every job' if args.all_jobs else 'this job'}'s, errors too)"
    if args.json:
        _print_json({"job_id": args.job_id, "dir": str(out.resolve()), "records": n, "format": args.format,
                     "defaults_kept": kept})
    else:
        print(f"{what} of {len(wkeys)} workloads written to {out.resolve()}")
    return 0



def cmd_lanes(args) -> int:
    client = _client(args)
    lanes, down = client.lanes(), client.gpus_down()
    if args.json:  # a list of lanes; a given-up GPU's lanes appear with "down" and the error
        _print_json([json.loads(l.model_dump_json()) for l in lanes]
                    + [{"queue": q, "kind": "gpu", "down": True, "error": e["error"], "down_since": e["at"]}
                       for e in down.values() for q in e["lanes"]])
        return 0
    for l in lanes:
        print(f"{l.queue:<28} {l.kind} {l.share:>3} %  worker {l.worker:<28} batches {l.batches:>4}  candidates {l.candidates}")
    for gpu8, e in sorted(down.items()):
        print(f"GPU {gpu8} DOWN (lanes {', '.join(e['lanes'])} stopped): {e['error']}")
    if not lanes:
        print("no live lane")
    return 0



def cmd_cancel(args) -> int:
    state = _client(args).job(args.job_id).cancel()
    if args.json:
        _print_json({"job_id": args.job_id, "state": state})
    else:
        print(f"{args.job_id}: {state}")
    return 0



def parse_duration(text: str) -> float:
    """Seconds from '7d', '12h', '30m', '45s' or a plain number of seconds; SpecError otherwise."""
    from shared.errors import SpecError

    units = {"d": 86400, "h": 3600, "m": 60, "s": 1}
    t = text.strip().lower()
    try:
        value = float(t[:-1]) * units[t[-1]] if t and t[-1] in units else float(t)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise SpecError(f"--older-than {text!r}: give a duration like 7d, 12h, 30m or seconds")
    return value


def cmd_prune(args) -> int:
    from shared import store

    r = _client(args).redis
    before = store.memory(r)
    gone = store.prune_jobs(r, parse_duration(args.older_than), dry_run=True)
    freed = store.job_bytes(r, gone)  # measured before anything goes
    if not args.dry_run:
        store.prune_jobs(r, parse_duration(args.older_than), dry_run=False)
    after = store.memory(r)
    out = {"jobs": gone, "dry_run": args.dry_run, "frees_bytes": freed, "used_bytes_before": before["used_bytes"],
           "used_bytes_after": after["used_bytes"], "max_bytes": after["max_bytes"], "keys": after["keys"]}
    if args.json:
        _print_json(out)
        return 0
    limit = f" of {after['max_bytes'] / 2**20:.1f}" if after["max_bytes"] else ""
    head = f"{len(gone)} job(s) ended more than {args.older_than} ago"
    if args.dry_run:
        print(f"would prune {head}, freeing ~{freed / 2**20:.1f} MiB of the {before['used_bytes'] / 2**20:.1f}{limit} "
              f"MiB Redis uses (tuning records kept); nothing deleted")
    else:
        print(f"pruned {head} (~{freed / 2**20:.1f} MiB); Redis uses {before['used_bytes'] / 2**20:.1f} -> "
              f"{after['used_bytes'] / 2**20:.1f}{limit} MiB ({after['keys']} keys; tuning records kept)")
    return 0


def cmd_report(args) -> int:
    from pathlib import Path

    from sharetune.experiments.report import write_report

    client = _client(args)
    client.job(args.job_id)
    out = write_report(client.redis, args.job_id, Path(args.out or f"{args.job_id}-report.html"),
                       Path(args.matrix) if args.matrix else None)
    print(out)
    return 0



def cmd_api(args) -> int:
    import uvicorn

    from sharetune.api import check_exposure, make_app

    token = args.settings.api_token
    if not token and not args.no_token:
        from sharetune.api import new_token

        token, path = new_token(Path(args.settings.work_dir))
        host = f"[{args.host}]" if ":" in args.host else args.host
        print(f"API token in {path} (readable by you only). Open http://{host}:{args.port}/jobs?token={token} "
              f"or send 'Authorization: Bearer <token>'", file=sys.stderr, flush=True)
    check_exposure(args.host, token, args.published_on)
    uvicorn.run(make_app(_redis_url(args), token=token), host=args.host, port=args.port, log_level="info")
    return 0



def cmd_matrix(args) -> int:
    from pathlib import Path

    from shared.errors import SharetuneError
    from sharetune.experiments.share_matrix import Replicates, matrix, shares_from_cores

    try:
        if (args.shares is None) == (args.cores is None):
            raise SharetuneError("give either --shares (percent) or --cores (CPU core counts)")
        if args.cores is not None:
            from shared import lanes

            if not lanes.kind(args.device).runs_on_host_cores:
                raise SharetuneError("--cores is for --device cpu; give GPU shares with --shares")
            shares = shares_from_cores(args.cores, os.cpu_count() or 1)
        else:
            shares = args.shares
        if args.tunings < 1:
            raise SharetuneError(f"--tunings must be at least 1, got {args.tunings}")
        out = Path(args.out or Path(args.work_dir) / "share_matrix.json")
        report = matrix(args.model, shares, device=args.device, trials=args.trials, trials_per_iter=args.per_iter,
                        tasks=args.tasks, gpu_index=args.gpu_index, rounds=args.rounds, work_dir=args.work_dir,
                        replicates=Replicates(args.tunings, args.seed, resume=args.resume),
                        redis_url=os.environ.get("REDIS_URL"), out_json=out, out_png=out.with_suffix(".png"),
                        settings=args.settings)
    except SharetuneError as err:
        print(f"sharetune: {err}", file=sys.stderr)
        return 2
    print(report.table())
    png = out.with_suffix(".png")
    print(f"wrote {out}" + (f" and {png}" if png.exists() else " (no heatmap: matplotlib is not installed)"))
    return 0 if report.complete else 1


# ---- the command line: every subcommand's options, declared once each ------------------------------------

JSON = click.option("--json", is_flag=True, help="machine-readable output (for scripts)")
WORK_DIR = click.option("--work-dir", default="runs/stack", show_default=True, help="the stack's work dir")


def job_option_flags() -> list:
    """`submit`'s flags, one per JobOptions field, with its default, range and help: declared once there."""
    import typing

    flags = []
    for name, field in JobOptions.model_fields.items():
        flag, ann = cli_flag(name), field.annotation
        kw: dict = {"help": field.description, "show_default": field.default is not None}
        args = [a for a in typing.get_args(ann) if a is not type(None)]
        if ann is bool and field.default:
            flags.append(click.option(f"{flag}/--no-{flag[2:]}", name, default=True, **kw))
            continue
        if ann is bool:
            flags.append(click.option(flag, name, is_flag=True, default=False, **{**kw, "show_default": False}))
            continue
        if typing.get_origin(ann) is typing.Literal:
            kw["type"] = click.Choice(list(typing.get_args(ann)))
        elif int in (args or [ann]):
            kw["type"] = int
        elif float in (args or [ann]):
            kw["type"] = float
        elif name == "only_tasks":
            kw["help"] += " (comma-separated)"
        flags.append(click.option(flag, name, default=field.default, **kw))
    return flags


JOB = click.argument("job_id")


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
def cli() -> None:
    """GPU/CPU autotuning with spatial sharing."""


# the subcommands that talk to a running stack's Redis, and where they find it (_redis_url)
READS_THE_STORE = {"submit", "status", "watch", "results", "export", "lanes", "cancel", "prune", "report", "api"}
STORE_HELP = ("Reads REDIS_URL; else the URL `sharetune up` recorded in SHARETUNE_WORK_DIR (default runs/stack); "
              "else redis://127.0.0.1:6379/0.")


def command(name: str, help: str, *params):
    """Register body(args) as subcommand `name`; its options arrive as attributes (args.trials, args.json), and
    the settings main read (CliSettings) as args.settings."""
    def run(body, **options):
        return body(argparse.Namespace(**options, settings=click.get_current_context().obj))

    def register(body):
        cmd = click.Command(name, callback=functools.partial(run, body), help=help,
                            short_help=help.split("\n")[0], epilog=STORE_HELP if name in READS_THE_STORE else None)
        for param in params:
            param(cmd)
        cli.add_command(cmd)
        return body
    return register


command("demo", "tune a built-in model on this CPU with an embedded Redis, then stop",
        click.option("--model", default="small_cnn", show_default=True),
        click.option("--trials", type=int, default=40, show_default=True),
        click.option("--per-iter", type=int, default=8, show_default=True),
        click.option("--work-dir", default="runs/demo", show_default=True))(cmd_demo)
command("up", "start the stack as local processes and leave it running", WORK_DIR,
        click.option("--lanes", help="comma-separated lane queues (default: one CPU lane per core)"),
        click.option("--gpu", help="GPU lane spec on this host's GPUs, e.g. 4x25"),
        click.option("--tuners", type=int,
                     help="tuner clients (default on GPU lanes: one per lane and at least 4, 4 physical cores each at least; 1 on CPU lanes)"),
        click.option("--join", metavar="REDIS_URL",
                     help="start only lanes, serving an existing stack (another host's, or this one's)"),
        click.option("--builders", type=int, default=0, show_default=True,
                     help="builder workers per build family: they build candidates so the lanes only time them"),
        click.option("--builder-cores", help="cores the builders run on, e.g. 16-31"),
        click.option("--builder-family",
                     help="families to build for (e.g. cuda.sm_90); with --join and no lanes: a build-only host"))(cmd_up)
command("down", "stop the stack `up` started (by PID)", WORK_DIR)(cmd_down)
command("url", "the full REDIS_URL (password included) of the stack `up` runs: export REDIS_URL=$(sharetune url)",
        WORK_DIR)(cmd_url)
command("services", "every process of the stack `up` started: pid, alive, restarts, given up", WORK_DIR, JSON)(cmd_services)
command("submit", "submit a model (zoo name, .onnx file) to a running stack", click.argument("model"),
        *job_option_flags(),
        click.option("--wait", is_flag=True, help="wait for the job to end, then print its status"),
        click.option("--watch", is_flag=True, help="show live progress until the job ends"), JSON)(cmd_submit)
command("status", "a job's state and per-task progress (no JOB: the newest jobs)",
        click.argument("job_id", required=False), JSON)(cmd_status)
command("watch", "live progress bars of a job and its tasks until it ends", JOB,
        click.option("--json", is_flag=True, help="one JSON status line per change"),
        click.option("--interval", type=float, default=1.0, show_default=True))(cmd_watch)
command("results", "a finished job's best latency per task, tuned module and database", JOB, JSON)(cmd_results)
command("export", "write a job's records as TVM's JSON database (or JSON lines)", JOB,
        click.option("-o", "--out", help="directory (default: ./<job>-database)"),
        click.option("--format", type=click.Choice(["tvm", "jsonl"]), default="tvm", show_default=True,
                     help="tvm: database_workload.json + database_tuning_record.json (every workload's best "
                          "records, as TVM applies them); jsonl: the job's records, errors too"),
        click.option("--all-jobs", is_flag=True,
                     help="jsonl: every job's records of the job's workloads (identical workloads share records)"),
        JSON)(cmd_export)
command("lanes", "live measurer lanes (one line per worker)", JSON)(cmd_lanes)
command("cancel", "stop a job after the round in flight", JOB, JSON)(cmd_cancel)
command("prune", "delete ended jobs' state from the store (their tuning records stay)\n\n"
        "Delete every key of the jobs that ended (done, failed, cancelled) more than --older-than ago: status, "
        "tasks, progress, batches. The workloads' tuning records and defaults stay (exports and later jobs use "
        "them), and so do exported databases and compiled modules on disk. An ended job's model and other "
        "running state already expire an hour after it ends.",
        click.option("--older-than", default="7d", show_default=True, help="e.g. 7d, 12h, 30m, or seconds"),
        click.option("--dry-run", is_flag=True, help="list what would go, delete nothing"), JSON)(cmd_prune)
command("report", "write an HTML report with plots of a job", JOB,
        click.option("-o", "--out", help="HTML file (default: ./<job>-report.html)"),
        click.option("--matrix", help="a share-matrix JSON (`sharetune matrix`) to plot as well"))(cmd_report)
command("api", "serve the HTTP API (submit, status, results, cancel; /docs, /openapi.json)",
        click.option("--host", default="127.0.0.1", show_default=True,
                     help="an address other than loopback needs SHARETUNE_API_TOKEN"),
        click.option("--port", type=int, default=8000, show_default=True),
        click.option("--published-on", default=None,
                     help="in a container: the host address its port is published on (what others reach; "
                          "loopback needs no token)"),
        click.option("--no-token", is_flag=True,
                     help="serve without a token when SHARETUNE_API_TOKEN is unset (loopback only); by default "
                          "a new token is made and written to SHARETUNE_WORK_DIR/api_token"))(cmd_api)
command("matrix", "tune at each share, serve at every share: the latency matrix\n\n"
        "Tune at each share (--tunings times, one search seed each), serve each tuned model at every share, print the "
        "tuned-at x served-at table (with 95 % intervals over tunings and serving rounds), the verdict and advice per "
        "serving share, the recommended share, the knee and what a share mismatch costs; write JSON + heatmap. Every "
        "task of the model by default.",
        click.argument("model"),
        click.option("--shares", help="percentages, e.g. 10,25,50,100 (CPU: whole cores of this host)"),
        click.option("--cores", help="CPU only, instead of --shares: core counts, e.g. 1,2"),
        click.option("--device", type=click.Choice(["cpu", "gpu"]), default="cpu", show_default=True),
        click.option("--trials", type=int, help="trial budget of each tuning job (default 32 x tasks, at least 256)"),
        click.option("--tunings", type=int, default=3, show_default=True,
                     help="tunings a share, each an isolated job of its own search seed: the intervals cover the "
                          "spread between them and the verdicts compare the shares within each seed (1: one "
                          "search, a verdict about those tuned modules only)"),
        click.option("--seed", type=int, default=0, show_default=True, help="the first tuning's seed (then +1, +2, ...)"),
        click.option("--resume", is_flag=True,
                     help="keep the tunings an earlier run finished (WORK_DIR/serve/tunings, by model, share, seed "
                          "and trials) and tune only the missing ones"),
        click.option("--per-iter", type=int, default=64, show_default=True,
                     help="candidates a search round (MetaSchedule's default)"),
        click.option("--tasks", type=int, help="tune only the model's k heaviest tasks (default: all)"),
        click.option("--gpu-index", type=int, default=0, show_default=True),
        click.option("--rounds", type=int, default=30, show_default=True,
                     help="timing rounds per cell: the median, and a bootstrap 95 % interval over them"),
        click.option("--work-dir", default="runs/matrix", show_default=True),
        click.option("--out", help="JSON path (default WORK_DIR/share_matrix.json; PNG beside it)"))(cmd_matrix)

COMMANDS = list(cli.commands)


def main(argv=None) -> int:
    """Run one subcommand; its exit status (2: bad input, named on stderr; 130: interrupted)."""
    from pydantic import ValidationError

    from shared.errors import SharetuneError
    from shared.settings import CliSettings

    try:
        settings = CliSettings()
    except ValidationError as err:  # a SHARETUNE_* variable of a value it cannot take
        print(f"sharetune: {err}", file=sys.stderr)
        return 2
    try:
        return cli.main(args=argv, prog_name="sharetune", standalone_mode=False, obj=settings) or 0
    except click.exceptions.Exit as done:  # --help
        return done.exit_code
    except click.ClickException as err:  # a usage error: unknown option, a value of the wrong type
        err.show()
        return err.exit_code
    except SharetuneError as err:
        print(f"sharetune: {err}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, click.Abort):
        return 130


if __name__ == "__main__":
    sys.exit(main())

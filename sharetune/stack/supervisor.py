"""The process `sharetune up` leaves behind: `python -m sharetune.stack.supervisor --work-dir W [up's options]`,
in its own session, owns one Stack and its supervision thread (a dead lane, tuner client, planner,
updater, builder or embedded Redis is started again with back-off; one that keeps dying is given up) and
writes W/stack.json every second: its pid, REDIS_URL and every service's pid, liveness, restarts and
whether it was given up (`sharetune services` reads it). On SIGTERM (`sharetune down`) it stops what it
started, by PID, and removes the file.

One stack per work dir: the supervisor holds W/supervisor.lock for its life. Redis keeps a stable port
per work dir: the one recorded in W/redis_url when it is free, else 6379 when free, else a free one; the
URL is written to W/redis_url, which the CLI's other commands read when REDIS_URL is not set. That URL
carries the store's services user and password (the embedded Redis is locked, sharetune/stack/local.py), kept per
work dir like the port; W/redis_url and W/stack.json are the owner's alone (0600), and logs show the URL
masked. A joined stack's URL (`up --join`) reaches the supervisor in SHARETUNE_JOIN_URL, not its argv."""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

STATE_FILE = "stack.json"
URL_FILE = "redis_url"
START_ERROR_FILE = "start_error"  # why the last start failed, in one line (written by the supervisor)
LOCK_FILE = "supervisor.lock"
DEFAULT_PORT = 6379
JOIN_ENV = "SHARETUNE_JOIN_URL"  # `up --join`'s URL, for the supervisor (its argv would show the password in ps)


def process_alive(pid) -> bool:
    """Whether a pid a state records (None or 0: none) is a live process."""
    from services.measurer.agent import alive

    return bool(pid) and alive(int(pid))


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    with socket.socket() as s:  # nothing answering there either (a server bound to another address)
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) != 0


def write_private(path: Path, text: str) -> None:
    """Write `path` readable by its owner alone (0600) and whole: readers never see half a file."""
    tmp = Path(path).with_name(Path(path).name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(fd, 0o600)  # a tmp file left over with another mode
        f.write(text)
    os.replace(tmp, path)


def recorded_url(work_dir: Path) -> str | None:
    path = Path(work_dir) / URL_FILE
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def choose_port(work_dir: Path) -> int:
    """The port recorded for this work dir when it is free (an exported REDIS_URL stays right), else
    6379 when free, else any free one."""
    from services.broker.server import free_port

    url = recorded_url(work_dir)
    if url:
        try:
            port = int(url.rsplit(":", 1)[1].split("/", 1)[0])
            if _port_free(port):
                return port
        except (IndexError, ValueError):
            pass
    return DEFAULT_PORT if _port_free(DEFAULT_PORT) else free_port()


def recorded_password(work_dir: Path) -> str | None:
    """The services' password recorded for this work dir's embedded Redis (an exported REDIS_URL stays
    right across `down` and `up`, like the port), or None: a new one is made."""
    from urllib.parse import urlsplit

    from services.broker.server import SERVICE_USER

    url = recorded_url(work_dir)
    try:
        parts = urlsplit(url) if url else None
    except ValueError:
        return None
    return parts.password if parts is not None and parts.username == SERVICE_USER and parts.password else None


def read_state(work_dir: Path) -> dict | None:
    try:
        return json.loads((Path(work_dir) / STATE_FILE).read_text())
    except (OSError, ValueError):
        return None


def state_pids(state: dict) -> dict[str, int]:
    """name -> pid of every process a state records (the supervisor, Redis, the workers)."""
    pids = {n: p for n, p in (state.get("pids") or {}).items() if p}
    if state.get("redis_pid"):
        pids["redis"] = state["redis_pid"]
    if state.get("supervisor_pid"):
        pids["supervisor"] = state["supervisor_pid"]
    return pids


def running(work_dir: Path) -> dict | None:
    """The state of the stack running in `work_dir` (its supervisor or any of its processes alive), or None."""
    state = read_state(work_dir)
    if state and any(process_alive(p) for p in state_pids(state).values()):
        return state
    return None


def _write_state(work_dir: Path, state: dict) -> None:
    write_private(Path(work_dir) / STATE_FILE, json.dumps(state, indent=1, default=str))  # it holds the URL


def stack_state(stack, ready: bool) -> dict:
    services = stack.services()
    return {
        "supervisor_pid": os.getpid(),
        "ready": ready,
        "updated_at": time.time(),
        "work_dir": str(stack.work_dir),
        "redis_url": stack.redis_url,
        "redis_pid": stack.redis_server.proc.pid if stack.redis_server and stack.redis_server.proc else None,
        "pids": {name: p.pid for name, p in list(stack.procs.items())},
        "mps": {"pipe": str(stack.mps.pipe_dir), "log": str(stack.mps.log_dir)} if stack.mps and stack.mps.started else None,
        "lanes": stack.lanes,
        "services": services,
        # the latest recoveries, with the phase times of each GPU's (where its seconds went)
        "recoveries": [{k: v for k, v in e.items() if k != "faults"} for e in list(stack.recoveries)[-10:]],
    }


def _lock(work_dir: Path):
    import fcntl

    f = open(Path(work_dir) / LOCK_FILE, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        return None
    return f  # held while this process lives (not inherited: the stack's children are started close_fds)


def _start_failed(work: Path, err: BaseException) -> None:
    """Why the stack did not start, in the one line `up` prints."""
    reason = (str(err).strip().splitlines() or [""])[0]
    (work / START_ERROR_FILE).write_text(f"{type(err).__name__}: {reason}"[:2000] + "\n")


def main(argv=None) -> int:
    from shared.settings import StackSettings

    settings = StackSettings()
    args = parse_args(argv, settings.join_url)
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("sharetune.supervise")
    from shared.store import masked_url

    work = prepare_work_dir(Path(args.work_dir), args.join)
    lock = _lock(work)
    if lock is None:
        state = read_state(work) or {}
        log.error("a stack is already running in %s (supervisor pid %s, REDIS_URL=%s)", work,
                  state.get("supervisor_pid"), masked_url(state.get("redis_url")))
        return 3
    try:
        stack = make_stack(args, work, settings)
    except Exception as err:  # noqa: BLE001 - a bad option: `up` says which, in a line
        log.exception("stack refused")
        _start_failed(work, err)
        return 1
    return supervise(stack, work, args.join, args.interval, log)


def parse_args(argv=None, join_url: str | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m sharetune.stack.supervisor")
    ap.add_argument("--work-dir", required=True)
    ap.add_argument("--lanes", default=None, help="comma-separated lane queues; empty: none (default: one CPU lane per core)")
    ap.add_argument("--tuners", type=int, default=None)
    ap.add_argument("--join", default=join_url or None,
                    help=f"the URL of the stack to join (better: in {JOIN_ENV}, which ps does not show)")
    ap.add_argument("--builders", type=int, default=0)
    ap.add_argument("--builder-cores", default=None)
    ap.add_argument("--builder-family", default=None)
    ap.add_argument("--log-level", default="INFO")
    ap.add_argument("--interval", type=float, default=1.0, help="seconds between state writes")
    return ap.parse_args(argv)


def prepare_work_dir(work_dir: Path, join_url: str | None) -> Path:
    """The work dir, made and resolved, its last start error gone; the stack's children get REDIS_URL, never
    the URL it joins, nor this work dir's own URL exported from an earlier `up` (its Redis is started again)."""
    os.environ.pop(JOIN_ENV, None)  # read into the settings already
    work = work_dir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    if not join_url and os.environ.get("REDIS_URL") and os.environ["REDIS_URL"] == recorded_url(work):
        del os.environ["REDIS_URL"]
    (work / START_ERROR_FILE).unlink(missing_ok=True)
    return work


def make_stack(args: argparse.Namespace, work: Path, settings):
    """The stack `up`'s options describe: its own Redis on this work dir's port and password, or lanes joining one."""
    from services.measurer.agent import BuilderSpec
    from sharetune.stack.local import LocalRedis, Stack

    lanes = None if args.lanes is None else [q for q in args.lanes.split(",") if q]
    families = args.builder_family.split(",") if args.builder_family else None
    options = dict(lanes=lanes, log_level=args.log_level, settings=settings,
                   builders=BuilderSpec(args.builders, args.builder_cores, families))
    if args.join:
        return Stack.joining(work, args.join, **options)
    return Stack(work, tuners=args.tuners, local_redis=LocalRedis(choose_port(work), recorded_password(work), restart=True),
                 **options)


def supervise(stack, work: Path, join_url: str | None, interval_s: float, log) -> int:
    """Start the stack, then write its state every `interval_s` until SIGTERM; stop what it started. The exit
    status: 0 when stopped, 1 when the stack failed."""
    from shared.store import masked_url

    def _term(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _term)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # the terminal `up` ran in may close
    _write_state(work, {"supervisor_pid": os.getpid(), "ready": False, "updated_at": time.time(), "work_dir": str(work),
                        "redis_url": join_url, "pids": {}, "services": []})
    try:
        stack.start()
        if stack.redis_server is not None:
            write_private(work / URL_FILE, stack.redis_url + "\n")
        log.info("stack ready: REDIS_URL=%s (in full: %s), %d processes supervised", masked_url(stack.redis_url),
                 work / URL_FILE if stack.redis_server is not None else JOIN_ENV, len(stack.procs))
        while True:
            try:
                _write_state(work, stack_state(stack, ready=True))
            except (OSError, RuntimeError, ValueError):  # a dict changed under us: the next write has it
                log.warning("state write failed", exc_info=True)
            time.sleep(interval_s)
    except SystemExit as stop:
        log.info("stopping (%s)", stop.code)
        return 0
    except BaseException as err:
        log.exception("stack failed")
        if not (read_state(work) or {}).get("ready"):
            _start_failed(work, err)
        return 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second `down` must not cut the stop short
        stack.stop()
        (work / STATE_FILE).unlink(missing_ok=True)
        log.info("stopped")


# ---- used by the CLI: `up` starts a supervisor and waits for it, `down` stops it ------------------------


def spawn(work_dir: Path, options: list[str], join_url: str | None = None) -> subprocess.Popen:
    """Start a supervisor in its own session (it outlives the terminal), its output in W/logs/supervisor.log;
    `join_url` (up --join) goes in its environment."""
    from services.measurer.agent import REPO

    work = Path(work_dir).resolve()
    (work / "logs").mkdir(parents=True, exist_ok=True)
    out = open(work / "logs" / "supervisor.log", "ab")
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop(JOIN_ENV, None)
    if join_url:
        env[JOIN_ENV] = join_url
    return subprocess.Popen([sys.executable, "-m", "sharetune.stack.supervisor", "--work-dir", str(work), *options],
                            cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=True)


def wait_ready(work_dir: Path, proc: subprocess.Popen, timeout_s: float = 900.0) -> dict:
    """The supervisor's state once its stack is up; RuntimeError (with its log's tail) if it ended first."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        state = read_state(work_dir)
        if state and state.get("supervisor_pid") == proc.pid and state.get("ready"):
            return state
        if proc.poll() is not None:
            log = Path(work_dir).resolve() / "logs" / "supervisor.log"
            why = Path(work_dir).resolve() / START_ERROR_FILE
            if why.exists():
                raise RuntimeError(f"the stack did not start: {why.read_text().strip()} (details: {log})")
            tail = log.read_text(errors="replace").splitlines()[-15:] if log.exists() else []
            raise RuntimeError(f"the stack did not start (supervisor exited {proc.returncode}; {log}):\n"
                               + "\n".join(tail))
        time.sleep(0.3)
    proc.terminate()  # it stops what it started
    raise TimeoutError(f"the stack did not come up in {timeout_s:.0f} s; see {Path(work_dir) / 'logs'}")


def stop(work_dir: Path, timeout_s: float = 120.0) -> list[str] | None:
    """Stop the stack running in `work_dir`: SIGTERM to its supervisor, which stops what it started; what
    is still alive after `timeout_s` (or when the supervisor is gone) is ended by PID. Returns the names
    of the processes stopped, or None when nothing was running."""
    from services.measurer.agent import signal_group

    work = Path(work_dir)
    state = read_state(work)
    if state is None:
        return None
    pids = state_pids(state)
    alive = {n: p for n, p in pids.items() if process_alive(p)}
    if not alive:
        (work / STATE_FILE).unlink(missing_ok=True)  # stale: left by a stack that died with its host
        return None
    sup = state.get("supervisor_pid")
    if sup and process_alive(sup):
        try:
            os.kill(sup, signal.SIGTERM)
        except ProcessLookupError:
            pass
        deadline = time.time() + timeout_s
        while time.time() < deadline and process_alive(sup):
            time.sleep(0.2)
        # the workers it runs now (restarted ones have new pids): its last state has them
        pids.update(state_pids(read_state(work) or {}))
    for name, pid in pids.items():  # whatever outlived the supervisor, each its own session
        if process_alive(pid):
            signal_group(pid, signal.SIGTERM)
    deadline = time.time() + 20
    while time.time() < deadline and any(process_alive(p) for p in pids.values()):
        time.sleep(0.1)
    for pid in pids.values():
        if process_alive(pid):
            signal_group(pid, signal.SIGKILL)
    stopped_itself = bool(sup) and not (work / STATE_FILE).exists()  # the supervisor removes it once all stopped
    if state.get("mps") and not stopped_itself:
        from services.measurer.gpu import MpsDaemon

        mps = MpsDaemon(Path(state["mps"]["pipe"]), Path(state["mps"]["log"]))
        mps.started = True  # recorded as ours by the supervisor
        try:
            mps.stop()
        except Exception:  # noqa: BLE001 - already stopped by the supervisor
            pass
    (work / STATE_FILE).unlink(missing_ok=True)
    return sorted(alive)


if __name__ == "__main__":
    sys.exit(main())

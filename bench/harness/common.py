"""Where results go and what each records of its making (command, code, host, date), the options the tuning
benchmarks share, waiting, and the command lines of child processes."""
from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "bench" / "results"
KEPT_DBS = RESULTS / "time_to_quality_dbs.tar.xz"  # databases of earlier runs, kept in the repo


def out_dir(default: str = "/tmp/out") -> Path:
    """$OUT (the device machine's folder that comes back), made if missing."""
    d = Path(os.environ.get("OUT", default))
    d.mkdir(parents=True, exist_ok=True)
    return d


def git(*args: str) -> str:
    """A git command's output in the repository ("" when git cannot answer)."""
    try:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def git_state() -> dict:
    """The code that ran: HEAD, its branch, and the tracked files that differed from it (the tree may be shared)."""
    return {"head": git("rev-parse", "HEAD").strip(), "branch": git("rev-parse", "--abbrev-ref", "HEAD").strip(),
            "modified": [line[3:] for line in git("status", "--porcelain", "--untracked-files=no").splitlines()]}


def command_line(module: str, argv=None) -> str:
    """How this run was started, as its results record it."""
    return " ".join(["python", "-m", module] + list(argv if argv is not None else sys.argv[1:]))


def results_path(name: str, out: str | None = None) -> Path:
    """A results file's path: `out` when given, else `name` under $OUT when set, else under bench/results."""
    return Path(out) if out else Path(os.environ.get("OUT") or RESULTS) / name


def write_results(body: dict, path, module: str, argv=None) -> Path:
    """A results file, with how it was made (what bench/results/MANIFEST.json lists for it): the command, the
    code (commit, branch, whether the tree differed), the host and the date."""
    code = git_state()
    body = {**body, "command": command_line(module, argv), "date": time.strftime("%Y-%m-%d %H:%M"),
            "git": {"commit": code["head"], "branch": code["branch"], "dirty": bool(code["modified"])},
            "host": {"node": platform.node(), "cores": os.cpu_count()}}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(body, indent=1, default=str) + "\n")
    return path


def tuning_options(ap, models: str | None, trials: int, serve_rounds: int, work_dir: str) -> None:
    """The options the scale and time-to-quality benchmarks share."""
    ap.add_argument("--models", default=models, help="comma-separated zoo or panel (bench/panel.py) names")
    ap.add_argument("--trials", type=int, default=trials)
    ap.add_argument("--per-iter", type=int, default=64)
    ap.add_argument("--tuners", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--serve-rounds", type=int, default=serve_rounds)
    ap.add_argument("--work-dir", default=work_dir)
    ap.add_argument("--rehearse", action="store_true", help="CPU lanes (llvm) on this host, small")


def wait_for(pred, timeout_s: float, poll_s: float = 0.1):
    """`pred()`'s first true answer within `timeout_s`, else None."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(poll_s)
    return None


def module_command(module: str, *args) -> list[str]:
    """A child process running one of the project's modules (children get child_env, so any cwd works)."""
    return [sys.executable, "-m", module, *(str(a) for a in args)]


def child_env(**extra: str) -> dict:
    """This environment for a child, with the repository importable wherever the child starts."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, PYTHONPATH=path, **extra)


def last_json_line(out: subprocess.CompletedProcess, fallback_key: str) -> dict:
    """A child's answer: its last line of output as JSON, else its error output under `fallback_key`."""
    try:
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return {fallback_key: (out.stderr or out.stdout)[-800:]}


def cores_of(spec: str) -> set[int]:
    """The cores of a spec such as "0-15" that this host has (all of them when none is)."""
    from services.measurer.lane_pool import parse_cores

    have = os.sched_getaffinity(0) | set(range(os.cpu_count() or 1))
    return {c for c in parse_cores(spec) if c in have} or have


def kept_in_repo(name: str) -> Path:
    """A folder of databases kept in the repo. They are kept as one xz archive (~50x smaller: the raw JSON would not
    fit a device call beside the staged wheels), unpacked on first use beside this process's work."""
    unpacked = Path(os.environ.get("TMPDIR", "/tmp")) / f"sharetune-kept-{KEPT_DBS.stat().st_mtime_ns}"
    if not unpacked.is_dir() and KEPT_DBS.exists():
        part = unpacked.with_suffix(f".{os.getpid()}")
        part.mkdir(parents=True, exist_ok=True)
        subprocess.run(["tar", "xJf", str(KEPT_DBS), "-C", str(part)], check=True)
        try:
            part.rename(unpacked)
        except OSError:  # another process unpacked it first
            shutil.rmtree(part, ignore_errors=True)
    return unpacked / name

"""What the operator's commands say of a stack from its state file alone (no stack runs here): a
given-up service makes `services` fail, a dead supervisor is named by `up`, and the commands that talk to
Redis say where they find it."""
import json
import os
import subprocess
import sys

from sharetune.cli import main
from sharetune.stack.supervisor import STATE_FILE


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _state(work, supervisor: int, given_up: str | None = None) -> None:
    rows = [{"name": "lane-measure.cpu.c0", "kind": "lane", "pid": os.getpid(), "alive": True, "restarts": 0,
             "given_up": None},
            {"name": "tuner0", "kind": "tuner", "pid": None, "alive": False, "restarts": 5, "given_up": given_up}]
    (work / STATE_FILE).write_text(json.dumps({
        "supervisor_pid": supervisor, "ready": True, "updated_at": 0, "work_dir": str(work),
        "redis_url": "redis://127.0.0.1:1/0", "services": rows, "pids": {"lane-measure.cpu.c0": os.getpid()}}))


def test_services_fails_when_a_service_was_given_up(tmp_path, capsys):
    _state(tmp_path, supervisor=os.getpid())
    assert main(["services", "--work-dir", str(tmp_path)]) == 0
    _state(tmp_path, supervisor=os.getpid(), given_up="5 restarts in 600 s")
    assert main(["services", "--work-dir", str(tmp_path)]) == 1
    assert main(["services", "--work-dir", str(tmp_path), "--json"]) == 1
    assert "GIVEN UP: 5 restarts in 600 s" in capsys.readouterr().out


def test_up_names_a_dead_supervisor_whose_processes_still_run(tmp_path, capsys):
    dead = _dead_pid()
    _state(tmp_path, supervisor=dead)
    assert main(["up", "--work-dir", str(tmp_path)]) == 1  # nothing started beside its orphans
    err = capsys.readouterr().err
    assert f"supervisor (pid {dead})" in err and "is dead" in err and "sharetune down" in err


def test_the_commands_that_talk_to_redis_say_where_they_find_it(capsys):
    for cmd in ("status", "submit", "results", "api"):
        assert main([cmd, "--help"]) == 0
        out = capsys.readouterr().out
        assert "REDIS_URL" in out and "SHARETUNE_WORK_DIR" in out, cmd
    assert main(["demo", "--help"]) == 0
    assert "REDIS_URL" not in capsys.readouterr().out  # the demo starts its own

"""The embedded store a stack starts is locked (a real redis-server, real Celery): no connection without the
password, the services' user cannot reconfigure, stop or wipe the server, the files that hold the URL and the
data are the owner's alone, and what is printed or logged masks the password."""
import os
import stat
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import redis

from services.broker.server import SERVICE_USER, EmbeddedRedis
from services.celery_app import make_celery
from shared import store
from sharetune.stack import supervisor

ROOT = Path(__file__).resolve().parent.parent


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture(scope="module")
def locked(tmp_path_factory):
    """The server exactly as Stack.start starts it (its own password, the services user), alone: the
    session stack's lanes and tuners are not needed to check the server's locks."""
    import secrets

    with EmbeddedRedis(tmp_path_factory.mktemp("redis"), password=secrets.token_urlsafe(24), user=SERVICE_USER) as srv:
        yield srv


def test_the_stack_url_carries_the_services_user_and_a_password(stack):
    parts = urlsplit(stack.redis_url)
    assert parts.username == SERVICE_USER and len(parts.password) >= 24
    assert stack.redis_server.password == parts.password and store.connect(stack.redis_url).ping()
    # the session stack's workers got it: its lanes and tuner clients announced themselves through it
    r = store.connect(stack.redis_url)
    assert store.live_lanes(r) and store.live_tuners(r) >= 1


def test_no_connection_without_the_password(stack):
    parts = urlsplit(stack.redis_url)
    for url in (f"redis://127.0.0.1:{parts.port}/0",  # the `default` user is off
                f"redis://:{parts.password}@127.0.0.1:{parts.port}/0",  # the password, as `default`'s
                f"redis://{SERVICE_USER}:wrong@127.0.0.1:{parts.port}/0"):
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis.from_url(url).ping()
    assert store.unreachable(f"redis://127.0.0.1:{parts.port}/0", 2.0) is not None


@pytest.mark.parametrize("command", [("CONFIG", "GET", "dir"), ("CONFIG", "SET", "dir", "/tmp"),
                                     ("MODULE", "LOAD", "/tmp/x.so"), ("DEBUG", "SLEEP", "0"), ("FLUSHALL",),
                                     ("FLUSHDB",), ("SHUTDOWN", "NOSAVE"), ("ACL", "SETUSER", "default", "on")])
def test_the_services_user_cannot_reconfigure_stop_or_wipe_the_server(stack, command):
    r = redis.Redis.from_url(stack.redis_url)
    with pytest.raises(redis.exceptions.NoPermissionError):
        r.execute_command(*command)
    assert r.ping()


def test_what_the_services_use_still_works_for_their_user(locked):
    """Lua by SHA (shared/store), MULTI/EXEC, INFO (the store's memory check) and Celery over kombu, pub/sub too."""
    r = store.connect(locked.url)
    script = r.register_script("return redis.call('INCRBY', KEYS[1], ARGV[1])")
    assert script(keys=["auth:n"], args=[2]) == 2 and script(keys=["auth:n"], args=[3]) == 5
    with r.pipeline() as p:
        p.set("auth:a", 1).incr("auth:a")
        assert p.execute() == [True, 2]
    assert store.memory(r)["max_bytes"] > 0
    sub = r.pubsub()
    sub.subscribe("auth-channel")
    assert sub.get_message(timeout=2)["type"] == "subscribe"
    assert r.publish("auth-channel", b"x") == 1
    sub.close()
    app = make_celery("test", locked.url)
    with app.connection_for_write() as conn:
        conn.ensure_connection(max_retries=1)
        app.send_task("sharetune.nothing", args=[{"x": 1}], queue="auth-test", connection=conn)
    assert r.llen("auth-test") == 1


def test_the_password_is_not_on_the_servers_command_line(locked):
    cmdline = Path(f"/proc/{locked.proc.pid}/cmdline").read_bytes().decode(errors="replace")
    assert locked.password not in cmdline
    digest_only = (locked.data_dir / "redis.log").read_text(errors="replace")
    assert locked.password not in digest_only


def test_the_data_dir_is_the_owners_alone(stack, locked):
    for srv in (stack.redis_server, locked):
        assert _mode(srv.data_dir) == 0o700
        for f in srv.data_dir.iterdir():  # the AOF, the log
            assert _mode(f) & 0o077 == 0, f


def test_a_data_dir_made_open_before_is_closed_at_start(tmp_path):
    data = tmp_path / "redis"
    data.mkdir(mode=0o755)
    os.chmod(data, 0o755)
    with EmbeddedRedis(data, password="pw-" + "x" * 20, user=SERVICE_USER):
        assert _mode(data) == 0o700


def test_the_state_files_are_the_owners_alone(tmp_path):
    """What the supervisor writes (W/redis_url, W/stack.json), also over files an older version left 0644."""
    url = f"redis://{SERVICE_USER}:pw-secret@127.0.0.1:1/0"
    for name in (supervisor.URL_FILE, supervisor.STATE_FILE):
        (tmp_path / name).write_text("old")
        os.chmod(tmp_path / name, 0o644)
    supervisor.write_private(tmp_path / supervisor.URL_FILE, url + "\n")
    supervisor._write_state(tmp_path, {"redis_url": url, "pids": {}})
    for name in (supervisor.URL_FILE, supervisor.STATE_FILE):
        assert _mode(tmp_path / name) == 0o600, name
    assert supervisor.recorded_url(tmp_path) == url and supervisor.recorded_password(tmp_path) == "pw-secret"
    assert not list(tmp_path.glob("*.tmp"))


def test_masked_urls():
    assert store.masked_url("redis://sharetune:s3cret@127.0.0.1:6379/0") == "redis://sharetune:****@127.0.0.1:6379/0"
    assert store.masked_url("redis://:s3cret@h:6379/0") == "redis://:****@h:6379/0"
    assert store.masked_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"


def test_the_cli_prints_the_url_masked_and_url_prints_it_for_the_owner(tmp_path):
    """`services` (from the state file alone) masks it; `url` prints the recorded one in full."""
    import json

    url = f"redis://{SERVICE_USER}:pw-secret-123@127.0.0.1:1/0"
    supervisor.write_private(tmp_path / supervisor.URL_FILE, url + "\n")
    supervisor._write_state(tmp_path, {"supervisor_pid": os.getpid(), "ready": True, "updated_at": 0,
                                      "work_dir": str(tmp_path), "redis_url": url, "pids": {}, "services": []})

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "sharetune", *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=60, env={k: v for k, v in os.environ.items() if k != "REDIS_URL"})

    for args in (("services", "--work-dir", str(tmp_path)), ("services", "--work-dir", str(tmp_path), "--json")):
        out = cli(*args)
        assert "pw-secret-123" not in out.stdout + out.stderr and "sharetune:****@127.0.0.1:1" in out.stdout, out
    assert json.loads(cli("services", "--work-dir", str(tmp_path), "--json").stdout)["redis_url"] == store.masked_url(url)
    full = cli("url", "--work-dir", str(tmp_path))
    assert full.returncode == 0 and full.stdout.strip() == url
    missing = cli("url", "--work-dir", str(tmp_path / "none"))
    assert missing.returncode == 1 and "no stack URL recorded" in missing.stderr


# A real `up` (the printed URL masked, W/redis_url 0600, the workers given it in their environment and not in
# their argv, the supervisor's log masked): tests/test_cli_up.py::test_up_then_down, beside what `down` stops

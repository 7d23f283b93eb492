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
    assert {"redis", "planner", "tuner", "updater", "measurer-cpu", "measurer-gpu", "mps", "flower"} <= set(compose["services"])


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


def test_every_sharetune_variable_is_a_setting(compose):
    fields = set()
    for cls in (CommonSettings, LaneSettings, TunerSettings, UpdaterSettings):
        fields |= {f"SHARETUNE_{f.upper()}" for f in cls.model_fields}
    fields.add("SHARETUNE_GPU_UUID")  # read by python -m services.measurer as well
    for name, svc in compose["services"].items():
        for var in (svc.get("environment") or {}):
            if var.startswith("SHARETUNE_"):
                assert var in fields, f"{name}: {var} is not a setting"


def test_redis_is_durable_and_password_protected(compose):
    cmd = " ".join(compose["services"]["redis"]["command"])
    assert "--appendonly yes" in cmd and "--maxmemory-policy noeviction" in cmd and "--requirepass" in cmd
    assert "REDIS_PASSWORD" in compose["services"]["planner"]["environment"]["REDIS_URL"]


def test_gpu_lanes_get_the_mps_pipe(compose):
    gpu = compose["services"]["measurer-gpu"]
    mps = compose["services"]["mps"]
    assert gpu["environment"]["CUDA_MPS_PIPE_DIRECTORY"] == mps["environment"]["CUDA_MPS_PIPE_DIRECTORY"]
    assert any(v.startswith("mps:") for v in gpu["volumes"]) and any(v.startswith("mps:") for v in mps["volumes"])
    names.LaneName.parse(gpu["environment"]["SHARETUNE_LANE"].split(":-")[-1].rstrip("}"))

"""The Helm chart (deploy/helm/sharetune): rendered with `helm template` under two value sets when helm is
there (.ci/run installs it: deploy/helm/install-helm.sh), the manifests parsed, and checked against what
docker-compose.yml runs: the same images, the same queues. Without helm, the rendering tests skip and the
values are still checked. Nothing here installs the chart on a cluster."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from shared import names
from services.tuner.__main__ import ROLES

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "deploy" / "helm" / "sharetune"

# the second value set: an external Redis, KEDA on, two GPU nodes halved (two 50 % lanes each), a registry
CLUSTER_VALUES = ["--set", "redis.enabled=false", "--set", "redis.externalUrl=redis://:pw@redis.example:6379/0",
                  "--set", "keda.enabled=true", "--set", "keda.redisAddress=redis.example:6379",
                  "--set", "lanes.gpuNodes=2", "--set", "lanes.mpsReplicas=2",
                  "--set", "image.registry=registry.example/", "--set", "image.tag=0.1.0",
                  "--set", "api.token=s3cret"]


def _helm() -> str | None:
    local = ROOT / ".dev" / "bin" / "helm"
    return os.environ.get("SHARETUNE_HELM") or shutil.which("helm") or (str(local) if local.exists() else None)


@pytest.fixture(scope="module")
def helm():
    exe = _helm()
    if exe is None:
        pytest.skip("helm is not installed (deploy/helm/install-helm.sh): the chart is not rendered")
    return exe


def _render(helm: str, *args: str) -> list[dict]:
    out = subprocess.run([helm, "template", "st", str(CHART), *args], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def _compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def _compose_images() -> set[str]:
    """The images compose builds, without their tag."""
    return {s["image"].split(":")[0] for s in _compose()["services"].values() if "build" in s}


def _containers(docs: list[dict]) -> dict[str, dict]:
    return {d["metadata"]["name"]: c for d in docs if d["kind"] in ("Deployment", "StatefulSet")
            for c in d["spec"]["template"]["spec"]["containers"]}


def _env(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


@pytest.mark.parametrize("values", [[], CLUSTER_VALUES], ids=["defaults", "external-redis-keda-2-gpus"])
def test_the_chart_renders_to_manifests_that_parse(helm, values):
    docs = _render(helm, *values)
    kinds = sorted(d["kind"] for d in docs)
    assert kinds.count("Deployment") == 6  # planner, tuner, updater, builder, lane, api
    assert ("StatefulSet" in kinds) == (values == [])  # the chart's Redis, or none with an external one
    assert ("ScaledObject" in kinds) == (values != [])
    for d in docs:
        assert d["apiVersion"] and d["metadata"]["name"].startswith("st-sharetune"), d["metadata"]
    lint = subprocess.run([helm, "lint", str(CHART), *values], capture_output=True, text=True, timeout=120)
    assert lint.returncode == 0, lint.stdout + lint.stderr


def test_rendered_images_and_queues_are_compose_s(helm):
    """The chart runs the images compose builds and the workers on the queues compose's services consume."""
    docs = _render(helm, *CLUSTER_VALUES)
    containers = _containers(docs)
    images = {re.sub(r"^registry\.example/", "", c["image"]).split(":")[0] for c in containers.values()}
    assert images <= _compose_images(), images - _compose_images()
    assert all(c["image"].endswith(":0.1.0") for c in containers.values())
    queues = {c["command"][c["command"].index("--queue") + 1] for c in containers.values() if "--queue" in c["command"]}
    compose_queues = {s["command"][s["command"].index("--queue") + 1]
                      for s in _compose()["services"].values() if "--queue" in s.get("command", [])}
    assert queues == compose_queues == set(ROLES)
    scaled = {d["metadata"]["name"]: d["spec"]["triggers"][0]["metadata"] for d in docs if d["kind"] == "ScaledObject"}
    assert scaled["st-sharetune-tuner"]["listName"] == names.TUNE_QUEUE
    assert scaled["st-sharetune-builder"]["listName"] == names.build_queue("cuda.sm_90")
    assert all(s["address"] == "redis.example:6379" for s in scaled.values())
    targets = {d["spec"]["scaleTargetRef"]["name"] for d in docs if d["kind"] == "ScaledObject"}
    assert targets <= {d["metadata"]["name"] for d in docs if d["kind"] == "Deployment"}


def test_gpu_lanes_are_the_device_plugins_mps_replicas(helm):
    """gpuNodes x mpsReplicas lane pods, each one `nvidia.com/gpu` (one MPS replica), at 100/replicas %."""
    docs = _render(helm, *CLUSTER_VALUES)
    lane = next(d for d in docs if d["metadata"]["name"] == "st-sharetune-lane")
    assert lane["spec"]["replicas"] == 4
    container = lane["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"] == {"nvidia.com/gpu": 1}
    assert _env(container)["SHARETUNE_LANE_SHARE"] == "50"
    assert "services.measurer" in " ".join(container["command"])
    builder = _containers(docs)["st-sharetune-builder"]
    assert "nvidia.com/gpu" not in str(builder.get("resources")) and _env(builder)["NVIDIA_VISIBLE_DEVICES"] == "void"


def test_every_worker_is_probed_and_the_api_on_health(helm):
    docs = _render(helm)
    for name, c in _containers(docs).items():
        if name.endswith("-api"):
            assert c["readinessProbe"]["httpGet"]["path"] == "/health"
        elif not name.endswith("-redis"):
            assert c["livenessProbe"]["exec"]["command"] == ["python", "-m", "services.healthcheck"], name


def test_values_name_the_images_compose_builds():
    """Checked with or without helm: values.yaml's images are compose's, and the SHARETUNE_* variables the
    templates set are settings."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    chart_images = {values["image"][k] for k in ("tuner", "api", "measurerGpu")}
    assert chart_images <= _compose_images()
    from pydantic_settings import BaseSettings

    from shared import settings as settings_module

    settings = {f"SHARETUNE_{f.upper()}" for cls in vars(settings_module).values()
                if isinstance(cls, type) and issubclass(cls, BaseSettings) for f in cls.model_fields}
    for template in (CHART / "templates").glob("*.yaml"):
        for var in re.findall(r"\b(SHARETUNE_[A-Z_]+)\b", template.read_text()):
            assert var in settings, f"{template.name}: {var} is not a setting"

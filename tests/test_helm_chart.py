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


def _render_fails(helm: str, *args: str) -> str:
    """helm template's error message for values it must refuse."""
    out = subprocess.run([helm, "template", "st", str(CHART), *args], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0, "rendered values it should refuse"
    return out.stderr


def _pod(docs: list[dict], name: str) -> dict:
    return next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == name)["spec"]["template"]["spec"]


def _secret_ref(container: dict, var: str) -> dict | None:
    return next((e["valueFrom"]["secretKeyRef"] for e in container.get("env", []) if e["name"] == var), None)


def _flag(command: list[str], flag: str) -> str | None:
    return command[command.index(flag) + 1] if flag in command else None


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
    assert "nvidia.com/gpu" not in str(builder.get("resources"))


def test_every_worker_is_probed_and_the_api_on_health(helm):
    docs = _render(helm)
    for name, c in _containers(docs).items():
        if name.endswith("-api"):  # from inside the pod: a loopback-only API is not on the pod's address
            for probe in ("readinessProbe", "livenessProbe"):
                assert "127.0.0.1:8000/health" in " ".join(c[probe]["exec"]["command"]), probe
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


def test_cuda_builders_get_the_drivers_libcuda_but_no_gpu_on_nodes_with_the_driver(helm):
    """A cuda.* builder needs libcuda, not a device: without it TVM ships CUDA source and the builder exits at its
    warm-up (build.check_built). NVIDIA's runtime mounts the driver's libraries with NVIDIA_VISIBLE_DEVICES=none
    ("void" mounts nothing: the crash loop this replaces); only nodes with the driver have it: the GPU nodes."""
    pod = _pod(_render(helm), "st-sharetune-builder")
    c = pod["containers"][0]
    assert pod["runtimeClassName"] == "nvidia"
    assert _env(c)["NVIDIA_VISIBLE_DEVICES"] == "none"
    assert "compute" in _env(c)["NVIDIA_DRIVER_CAPABILITIES"].split(",")  # libcuda is the compute capability's
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert "nvidia.com/gpu" not in str(c["resources"])  # no device, no MPS share taken from the lanes
    from services.measurer.lane_pool import builder_environment

    assert builder_environment("cuda.sm_90")["CUDA_VISIBLE_DEVICES"] == ""  # and its process opens no GPU anyway
    # the lanes run under the same runtime class, on the same nodes
    lane = _pod(_render(helm), "st-sharetune-lane")
    assert lane["runtimeClassName"] == "nvidia" and lane["nodeSelector"] == pod["nodeSelector"]

    other = _pod(_render(helm, "--set", "nvidia.runtimeClassName=nvidia-legacy",
                         "--set", "builders.nodeSelector.pool=build-gpu"), "st-sharetune-builder")
    assert other["runtimeClassName"] == "nvidia-legacy" and other["nodeSelector"] == {"pool": "build-gpu"}
    # "": the nodes' default runtime is NVIDIA's; the environment still asks it for the driver without a device
    default_runtime = _pod(_render(helm, "--set", "nvidia.runtimeClassName="), "st-sharetune-builder")
    assert "runtimeClassName" not in default_runtime
    assert _env(default_runtime["containers"][0])["NVIDIA_VISIBLE_DEVICES"] == "none"
    # an LLVM builder needs no driver: no NVIDIA runtime, any node
    llvm = _pod(_render(helm, "--set", "builders.family=llvm.znver3"), "st-sharetune-builder")
    assert "runtimeClassName" not in llvm and "nodeSelector" not in llvm and "tolerations" not in llvm
    assert "NVIDIA_VISIBLE_DEVICES" not in _env(llvm["containers"][0])


def test_the_api_beyond_its_pod_always_runs_with_a_token(helm):
    """The API listens on the pod's address, which every pod and any Ingress reach, whatever the Service type:
    it gets SHARETUNE_API_TOKEN from a Secret (generated, given, or the user's), and its own exposure check
    would refuse to start without one."""
    from shared.errors import ExposureError
    from sharetune.api import check_exposure

    for values in ([], ["--set", "api.service.type=LoadBalancer"]):
        docs = _render(helm, *values)
        c = _containers(docs)["st-sharetune-api"]
        host, published = _flag(c["command"], "--host"), _flag(c["command"], "--published-on")
        with pytest.raises(ExposureError):  # what it binds is reachable: a token is what lets it start
            check_exposure(host, "", published)
        assert "--no-token" in c["command"]  # it never makes a token of its own, unseen, inside the pod
        assert _secret_ref(c, "SHARETUNE_API_TOKEN") == {"name": "st-sharetune-api", "key": "token"}
        secret = next(d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"] == "st-sharetune-api")
        token = secret["stringData"]["token"]
        assert re.fullmatch(r"[A-Za-z0-9]{32}", token)  # generated: no token was given
        check_exposure(host, token, published)
        assert any(d["kind"] == "Service" and d["metadata"]["name"] == "st-sharetune-api" for d in docs)

    given = _render(helm, "--set", "api.token=s3cret")
    assert next(d for d in given if d["metadata"]["name"] == "st-sharetune-api" and d["kind"] == "Secret")[
        "stringData"] == {"token": "s3cret"}
    # the user's Secret: referenced, not rendered
    theirs = _render(helm, "--set", "api.existingSecret=my-api", "--set", "api.existingSecretKey=bearer")
    assert _secret_ref(_containers(theirs)["st-sharetune-api"], "SHARETUNE_API_TOKEN") == {"name": "my-api", "key": "bearer"}
    assert not any(d["kind"] == "Secret" and d["metadata"]["name"] == "st-sharetune-api" for d in theirs)


def test_without_a_token_the_chart_refuses_unless_loopback_only(helm):
    err = _render_fails(helm, "--set", "api.generateToken=false")
    assert "needs a token" in err and "api.token" in err and "api.loopbackOnly" in err
    # loopback only: 127.0.0.1 in its pod, for a sidecar; no Service, and no token needed
    from sharetune.api import check_exposure

    docs = _render(helm, "--set", "api.generateToken=false", "--set", "api.loopbackOnly=true",
                   "--set-json", 'api.sidecars=[{"name":"proxy","image":"example/proxy:1"}]')
    pod = _pod(docs, "st-sharetune-api")
    c = pod["containers"][0]
    assert _flag(c["command"], "--host") == "127.0.0.1" and _flag(c["command"], "--published-on") is None
    check_exposure("127.0.0.1", "")
    assert _secret_ref(c, "SHARETUNE_API_TOKEN") is None
    assert [s["name"] for s in pod["containers"][1:]] == ["proxy"]
    assert not any(d["kind"] in ("Service", "Secret") and d["metadata"]["name"] == "st-sharetune-api" for d in docs)


def test_scaling_down_lets_each_worker_finish_its_task(helm):
    """KEDA scales on queue length, and a running task is off its queue: a scale-down takes busy pods. Each
    removed pod gets SIGTERM (celery itself: exec form) and its grace period to end its task in Celery's warm
    shutdown; the HPA removes them a few at a time; cooldownPeriod paces a scale to zero."""
    from shared import timeouts
    from services.celery_app import make_celery
    from services.workers import worker_argv

    docs = _render(helm, *CLUSTER_VALUES)
    scaled = {d["spec"]["scaleTargetRef"]["name"]: d["spec"] for d in docs if d["kind"] == "ScaledObject"}
    assert set(scaled) == {"st-sharetune-builder", "st-sharetune-tuner"}
    for target, spec in scaled.items():
        assert spec["cooldownPeriod"] >= 300
        down = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]
        assert down["stabilizationWindowSeconds"] >= 300
        assert down["policies"] and all(p["type"] == "Pods" and p["value"] <= 2 for p in down["policies"])
        command = _pod(docs, target)["containers"][0]["command"]
        assert command[:3] in (["python", "-m", "services.tuner"], ["python", "-m", "services.measurer"]), command
    grace = {t: _pod(docs, t)["terminationGracePeriodSeconds"] for t in scaled}
    # a builder's task is one candidate's build: past a run timeout + the batch grace a tuner has re-sent it
    assert grace["st-sharetune-builder"] > timeouts.RUN_TIMEOUT_S + timeouts.BATCH_GRACE_S
    # a stopping tuner client hands its shard back at its next round: a job's default round (trials_per_iter),
    # all on one lane, bounded by the batch watch (candidates x run timeout + batch grace)
    from shared.messages import JobSpec

    per_round = JobSpec.model_fields["trials_per_iter"].default
    assert grace["st-sharetune-tuner"] > per_round * timeouts.RUN_TIMEOUT_S + timeouts.BATCH_GRACE_S
    # a worker stopped anyway loses nothing for good: acknowledged after its task, one message at a time
    conf = make_celery("chart-test", "redis://127.0.0.1:1/0").conf
    assert conf.task_acks_late and conf.task_reject_on_worker_lost and conf.worker_prefetch_multiplier == 1
    argv = worker_argv("services.tuner.tasks", "tune", "tuner")
    assert _flag(argv, "-P") == "solo" and _flag(argv, "--prefetch-multiplier") == "1"

    tuned = _render(helm, *CLUSTER_VALUES, "--set", "tuner.terminationGracePeriodSeconds=3600",
                    "--set", "keda.cooldownPeriod=900", "--set", "keda.tuner.scaleDown.stabilizationWindowSeconds=1200")
    assert _pod(tuned, "st-sharetune-tuner")["terminationGracePeriodSeconds"] == 3600
    tuner = next(d["spec"] for d in tuned if d["kind"] == "ScaledObject" and d["metadata"]["name"].endswith("-tuner"))
    assert tuner["cooldownPeriod"] == 900
    assert tuner["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 1200

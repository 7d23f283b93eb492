"""The HTTP API over a real stack: in-process through FastAPI's test client, and once as a real
`sharetune api` server process."""
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def http(client):
    from fastapi.testclient import TestClient

    from sharetune.api import make_app

    return TestClient(make_app(client=client))


def test_openapi_describes_the_routes(http):
    spec = http.get("/openapi.json").json()
    assert {"/jobs", "/jobs/{job_id}", "/jobs/{job_id}/results", "/jobs/{job_id}/cancel", "/lanes",
            "/jobs/{job_id}/database", "/jobs/{job_id}/module"} <= set(spec["paths"])
    assert "post" in spec["paths"]["/jobs"] and "SubmitRequest" in spec["components"]["schemas"]


def test_status_and_results_of_a_finished_job(http, tuned_tiny):
    st = http.get(f"/jobs/{tuned_tiny.job_id}").json()
    assert st["state"] == "done" and st["trials"] == tuned_tiny.result().trials and st["eta_s"] == 0.0
    assert st["advice"] is None  # 24 trials at 8 a round reach both of tiny's tasks
    assert st["accounting"]["recorded"] == st["trials"] and st["accounting"]["lost"] == 0
    res = http.get(f"/jobs/{tuned_tiny.job_id}/results").json()
    assert res["job_id"] == tuned_tiny.job_id and {t["name"] for t in res["tasks"]} == {t["task"] for t in st["tasks"]}
    assert tuned_tiny.job_id in http.get("/jobs", params={"limit": 10_000}).json()  # the session has made many
    assert http.get(f"/jobs/{tuned_tiny.job_id}/module").content == open(tuned_tiny.result().tuned_module_path, "rb").read()
    assert http.get(f"/jobs/{tuned_tiny.job_id}/database").headers["content-type"] == "application/zip"
    # a finished job stays finished
    assert http.post(f"/jobs/{tuned_tiny.job_id}/cancel").json()["state"] == "done"


def test_errors_are_clear(http):
    assert http.get("/jobs/nosuchjob").status_code == 404
    assert http.post("/jobs/nosuchjob/cancel").status_code == 404
    bad = http.post("/jobs", json={"model": "tiny", "share": 150})
    assert bad.status_code == 422 and "share" in bad.json()["detail"]
    assert http.post("/jobs", json={"share": 50}).status_code == 422  # no model at all
    assert http.post("/jobs", json={"onnx_base64": "bm90IG9ubng=", "share": 50}).status_code == 422  # not ONNX


def test_submit_then_cancel_over_http(http, lane_share):
    sub = http.post("/jobs", json={"model": "tiny", "share": lane_share, "trials": 2000, "trials_per_iter": 4})
    assert sub.status_code == 201, sub.text
    job_id = sub.json()["job_id"]
    assert http.post(f"/jobs/{job_id}/cancel").json()["state"] == "cancelled"
    assert http.get(f"/jobs/{job_id}").json()["state"] == "cancelled"
    # its partial results come once the tuner has finished it on what was measured (tests/test_cancel_results.py)
    assert http.get(f"/jobs/{job_id}/results").status_code in (200, 409)


def test_submit_without_a_share_takes_the_live_lanes_share(http, lane_share):
    sub = http.post("/jobs", json={"model": "tiny", "trials": 2000, "trials_per_iter": 4})
    assert sub.status_code == 201, sub.text
    job_id = sub.json()["job_id"]
    try:
        assert http.get(f"/jobs/{job_id}").json()["share"] == lane_share
    finally:
        http.post(f"/jobs/{job_id}/cancel")


def test_a_real_api_server(stack, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "REDIS_URL": stack.redis_url, "SHARETUNE_WORK_DIR": str(tmp_path)}
    env.pop("SHARETUNE_API_TOKEN", None)
    proc = subprocess.Popen([sys.executable, "-m", "sharetune", "api", "--port", str(port)], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.time() + 120
        while True:
            try:
                token = (tmp_path / "api_token").read_text().strip()  # made by default, for its owner only
                assert (tmp_path / "api_token").stat().st_mode & 0o777 == 0o600
                request = urllib.request.Request(f"http://127.0.0.1:{port}/lanes",
                                                 headers={"Authorization": f"Bearer {token}"})
                with urllib.request.urlopen(request, timeout=5) as resp:
                    lanes = json.load(resp)
                break
            except OSError:
                assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
                assert time.time() < deadline, "the API server did not answer"
                time.sleep(0.3)
        assert {l["queue"] for l in lanes} >= set(stack.lanes)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/openapi.json", timeout=5) as resp:
            assert json.load(resp)["info"]["title"] == "sharetune"
        with pytest.raises(urllib.error.HTTPError) as refused:  # no token, or a wrong one: 401
            urllib.request.urlopen(f"http://127.0.0.1:{port}/lanes?token=wrong", timeout=5)
        assert refused.value.code == 401
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/lanes?token={token}", timeout=5) as resp:
            assert resp.status == 200  # the printed link works in a browser
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)


def test_a_token_guards_every_route_but_the_apis_description(client):
    from fastapi.testclient import TestClient

    from sharetune.api import make_app

    guarded = TestClient(make_app(client=client, token="s3cret"))
    assert guarded.get("/jobs").status_code == 401
    wrong = guarded.get("/lanes", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.headers["www-authenticate"] == "Bearer"
    assert "Authorization: Bearer" in wrong.json()["detail"]
    assert guarded.post("/jobs", json={"zoo": "tiny"}).status_code == 401  # nothing submitted without it
    assert guarded.get("/jobs", headers={"Authorization": "Bearer s3cret"}).status_code == 200
    assert guarded.get("/openapi.json").status_code == 200


def test_the_api_is_not_reachable_beyond_this_host_without_a_token(monkeypatch, capsys):
    from shared.errors import ExposureError
    from sharetune.api import check_exposure
    from sharetune.cli import main

    for host in ("127.0.0.1", "localhost", "::1"):
        check_exposure(host, "")
    check_exposure("0.0.0.0", "tok")
    check_exposure("0.0.0.0", "", published_on="127.0.0.1")  # compose: a container port on the host's loopback
    for host, published in (("0.0.0.0", None), ("10.1.2.3", None), ("0.0.0.0", "0.0.0.0")):
        with pytest.raises(ExposureError, match="SHARETUNE_API_TOKEN"):
            check_exposure(host, "", published_on=published)
    monkeypatch.delenv("SHARETUNE_API_TOKEN", raising=False)
    # --no-token is a choice for loopback only: refused before it listens
    assert main(["api", "--host", "0.0.0.0", "--port", "1", "--no-token"]) == 2
    assert "no token" in capsys.readouterr().err


def test_health_answers_probes_without_a_token_and_says_when_redis_is_gone(tmp_path):
    """compose's and the chart's probe of the api: 200 while Redis answers, 503 with the reason when not."""
    from fastapi.testclient import TestClient

    from services.broker.server import EmbeddedRedis
    from sharetune.api import make_app
    from sharetune.client import Client

    with EmbeddedRedis(tmp_path / "redis") as srv:
        probe = TestClient(make_app(client=Client(srv.url), token="s3cret"))
        up = probe.get("/health")
        assert up.status_code == 200 and up.json() == {"status": "ok"}
    down = probe.get("/health")
    assert down.status_code == 503 and down.json()["redis"]
    # every other route too, at once (not after the store client's minute of retries), with the reason
    away = probe.get("/jobs", headers={"Authorization": "Bearer s3cret"})
    assert away.status_code == 503 and "store (Redis) is unreachable" in away.json()["detail"]
    assert away.headers["retry-after"] == "5"

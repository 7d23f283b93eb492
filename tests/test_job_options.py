"""A job's options are declared once (shared.messages.JobOptions): the CLI's `submit` flags, the HTTP API's
request body and `Client.submit`'s keywords are the same set, with the same defaults, validated once."""
from __future__ import annotations

import pytest

from shared.messages import JobOptions

DEFAULTS = {name: field.default for name, field in JobOptions.model_fields.items()}


def test_the_cli_submit_flags_are_the_job_options():
    from sharetune.cli import cli

    params = {p.name: p.default for p in cli.commands["submit"].params
              if p.name not in ("model", "wait", "watch", "json")}
    assert params == DEFAULTS


def test_the_api_request_body_is_the_job_options_and_a_model():
    from sharetune.api import make_app

    schema = make_app(client=object(), token="t").openapi()["components"]["schemas"]["SubmitRequest"]["properties"]
    assert set(schema) - {"model", "onnx_base64"} == set(DEFAULTS)
    assert {k: v.get("default") for k, v in schema.items() if k in DEFAULTS} == DEFAULTS


def test_client_submit_takes_the_job_options_and_refuses_others(tmp_path):
    from services.broker.server import EmbeddedRedis
    from shared import store
    from shared.errors import SpecError
    from sharetune.client import Client

    with EmbeddedRedis(tmp_path / "redis") as srv:
        client = Client(srv.url)
        with pytest.raises(SpecError, match="per_iter is not a job option"):
            client.submit("tiny", per_iter=8)
        with pytest.raises(SpecError, match=r"trials per round \(--per-iter\) must be less than or equal to 1024"):
            client.submit("tiny", trials_per_iter=4096)
        assert store.jobs(client.redis) == []  # refused before anything was recorded

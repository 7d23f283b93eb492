"""A small HTTP API over the same store as the Python client (which stays the first way in):
submit, status, results (and their files: the exported database, the compiled module), cancel, lanes. OpenAPI at /openapi.json, docs at /docs.

The handlers are plain functions of a Client (`Handlers`), so they are tested without a server; the
FastAPI app only maps routes and errors onto them. Start it with `sharetune api` or in compose."""
from __future__ import annotations

import base64
import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, model_validator

from shared.errors import ExposureError, JobError, ModelError, SharetuneError
from shared.messages import JobOptions, JobResult, LaneInfo, TrialAccounting


class SubmitRequest(JobOptions):
    """A model by zoo name, or an ONNX file as base64; the job's options as `Client.submit`'s (JobOptions)."""

    model: str | None = Field(default=None, description="zoo name: tiny, small_cnn, resnet18, mobilenetv2, transformer")
    onnx_base64: str | None = Field(default=None, description="an ONNX model file, base64-encoded")

    def options(self) -> dict:
        return {k: getattr(self, k) for k in JobOptions.model_fields}

    @model_validator(mode="after")
    def _one_model(self):
        if (self.model is None) == (self.onnx_base64 is None):
            raise ValueError("give exactly one of `model` (a zoo name) or `onnx_base64`")
        return self


class Submitted(BaseModel):
    job_id: str
    state: str


class TaskStatus(BaseModel):
    task: str
    weight: int
    trials: int
    errors: int
    best_us: float | None
    reused_trials: int


class JobStatus(BaseModel):
    job_id: str
    name: str
    state: str | None
    error: str | None
    target: str
    share: int
    budget: int
    trials: int
    submitted_at: float
    times: dict[str, float]
    tasks: list[TaskStatus]
    eta_s: float | None = None
    advice: str | None = None  # the budget that would give every task one round, when the job's does not
    waiting_for: str | None = None  # a job parked until a lane of its share lives
    accounting: TrialAccounting | None = None  # claimed, recorded, outstanding, lost, reused, re-sends


class Cancelled(BaseModel):
    job_id: str
    state: str


class Handlers:
    """The API's logic: each method maps to one route and raises SharetuneError subclasses."""

    def __init__(self, client):
        self.client = client

    def submit(self, req: SubmitRequest) -> Submitted:
        if req.onnx_base64 is not None:
            try:
                model: Any = base64.b64decode(req.onnx_base64, validate=True)
            except ValueError as err:
                raise ModelError(f"onnx_base64 is not base64: {err}") from None
        else:
            model = req.model
        options = req.options()
        options["name"] = req.name or (req.model or "onnx")
        job = self.client.submit(model, **options)
        return Submitted(job_id=job.job_id, state=job.state().get("state"))

    def status(self, job_id: str) -> JobStatus:
        import time

        from sharetune.progress import estimates

        st = self.client.job(job_id).status()
        return JobStatus(**st, eta_s=estimates(st, time.time())["eta_s"])

    def results(self, job_id: str) -> JobResult:
        return self.client.job(job_id).result()

    def database(self, job_id: str) -> bytes:
        """The job's exported TVM database (database_workload.json, database_tuning_record.json and the
        repeats) as a zip: stock TVM's JSONDatabase reads the unpacked folder."""
        import io
        import os
        import zipfile

        res = self.client.job(job_id).result()
        if not res.database_dir or not os.path.isdir(res.database_dir):
            raise JobError(f"job {job_id} has no exported database on this host ({res.database_dir})")
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
            for name in sorted(os.listdir(res.database_dir)):
                zf.write(os.path.join(res.database_dir, name), arcname=f"database/{name}")
        return buf.getvalue()

    def module(self, job_id: str) -> str:
        """The path of the job's compiled tuned module (a shared library: tvm.runtime.load_module)."""
        import os

        res = self.client.job(job_id).result()
        if not res.tuned_module_path or not os.path.isfile(res.tuned_module_path):
            raise JobError(f"job {job_id} has no compiled module on this host ({res.tuned_module_path})")
        return res.tuned_module_path

    def cancel(self, job_id: str) -> Cancelled:
        return Cancelled(job_id=job_id, state=self.client.job(job_id).cancel())

    def jobs(self, limit: int = 50) -> list[str]:
        return [j.job_id for j in self.client.jobs(limit)]

    def lanes(self) -> list[LaneInfo]:
        return self.client.lanes()

    def health(self, timeout_s: float = 2.0) -> str | None:
        """None while the API reaches its Redis, else why not: one ping without the client's retries, so a
        probe gets its answer in seconds."""
        from shared import store

        return store.unreachable(self.client.redis_url, timeout_s=timeout_s)


def http_status(err: SharetuneError) -> int:
    """404 for an unknown job, 409 for a job without a result yet or failed, 422 for bad input."""
    msg = str(err)
    if isinstance(err, JobError):
        return 404 if msg.startswith("no job") else 409
    return 422


# readable without the token: they describe the API or say it is up (probes carry no token), they do not
# touch a job
STORE_PROBE_S = 0.5  # how long a request waits to learn that Redis is away
OPEN_PATHS = frozenset({"/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc", "/health"})


def check_exposure(host: str, token: str, published_on: str | None = None) -> None:
    """ExposureError when the API would be reachable beyond this host with no token. `published_on`: in a
    container, the host address its port is published on (docker-compose.yml: 127.0.0.1 unless
    SHARETUNE_API_PUBLISH says otherwise); that address, not the container's own, is what others reach."""
    where = published_on or host
    if token or _loopback(where):
        return
    raise ExposureError(f"the API would be reachable on {where} with no token: set SHARETUNE_API_TOKEN (every "
                        f"request then carries 'Authorization: Bearer <token>'), or serve on 127.0.0.1")


def _loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def authorised(header: str | None, token: str, query_token: str | None = None) -> bool:
    """Does an Authorization header (or a `?token=` in the URL, as a browser opens the printed link) carry
    the token (constant-time compare)?"""
    import hmac

    scheme, _, given = (header or "").partition(" ")
    if scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode()):
        return True
    return query_token is not None and hmac.compare_digest(query_token.encode(), token.encode())


def new_token(work_dir: Path) -> tuple[str, Path]:
    """A fresh API token, written to work_dir/api_token readable by its owner only (0600)."""
    import secrets

    token = secrets.token_urlsafe(24)
    work_dir.mkdir(parents=True, exist_ok=True)
    path = work_dir / "api_token"
    path.unlink(missing_ok=True)  # a file another user made is not written through
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token, path


def make_app(redis_url: str | None = None, client=None, token: str = ""):
    """The API over a Client; with `token`, every route but the API's description answers 401 to a request
    without 'Authorization: Bearer <token>'."""
    from fastapi import FastAPI

    from sharetune.client import Client

    handlers = Handlers(client or Client(redis_url))
    app = FastAPI(title="sharetune", version="0.1.0",
                  description="Autotuning with spatially shared lanes. The Python client (sharetune.client) "
                              "is the first way in; this API is the same operations over HTTP.")
    answer_503_while_the_store_is_away(app, handlers)
    if token:
        require_token(app, token)  # added after the store's check, so it runs first
    answer_errors_as_json(app)
    add_routes(app, handlers)
    return app


def answer_503_while_the_store_is_away(app, handlers: Handlers) -> None:
    """While Redis is away, a route answers 503 with the reason at once: its store calls would retry for a
    minute (riding out a restart is right for the services, not for someone waiting on a request)."""
    from fastapi import Request
    from fastapi.responses import JSONResponse

    @app.middleware("http")
    async def _store_reachable(request: Request, call_next):
        if request.url.path in OPEN_PATHS:
            return await call_next(request)
        from starlette.concurrency import run_in_threadpool

        why = await run_in_threadpool(handlers.health, STORE_PROBE_S)
        if why:
            return JSONResponse(status_code=503, headers={"Retry-After": "5"},
                                content={"detail": f"the store (Redis) is unreachable: {why}",
                                         "error": "StoreUnavailable"})
        return await call_next(request)


def require_token(app, token: str) -> None:
    """Every route but the API's description answers 401 to a request that does not carry `token`."""
    from fastapi import Request
    from fastapi.responses import JSONResponse

    @app.middleware("http")
    async def _require_token(request: Request, call_next):
        if request.url.path in OPEN_PATHS or authorised(request.headers.get("authorization"), token,
                                                        request.query_params.get("token")):
            return await call_next(request)
        return JSONResponse(status_code=401, headers={"WWW-Authenticate": "Bearer"},
                            content={"detail": "missing or wrong API token: send 'Authorization: Bearer <token>'",
                                     "error": "Unauthorized"})


def answer_errors_as_json(app) -> None:
    """A SharetuneError and a request body that breaks its contract answer with their status and one line."""
    from fastapi import Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse

    @app.exception_handler(SharetuneError)
    async def _error(request: Request, err: SharetuneError):
        return JSONResponse(status_code=http_status(err), content={"detail": str(err), "error": type(err).__name__})

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError):
        """422 and one line naming each field, as every other error."""
        parts = [f"{'.'.join(str(p) for p in e.get('loc', ())[1:]) or 'body'}: {e.get('msg', '')}"
                 for e in err.errors()[:5]]
        return JSONResponse(status_code=422, content={"detail": "; ".join(parts), "error": "RequestValidationError"})


def add_routes(app, handlers: Handlers) -> None:
    """The operations, each a route over its handler."""
    from fastapi.responses import FileResponse, JSONResponse, Response

    # sync handlers: FastAPI runs them in a thread pool, so a slow submit (model intake) blocks nothing
    app.post("/jobs", response_model=Submitted, status_code=201, summary="Submit a model for tuning")(handlers.submit)
    app.get("/jobs", response_model=list[str], summary="The newest job ids")(handlers.jobs)
    app.get("/jobs/{job_id}", response_model=JobStatus, summary="State and per-task progress")(handlers.status)
    app.get("/jobs/{job_id}/results", response_model=JobResult, summary="Best per task, module paths")(handlers.results)
    @app.get("/jobs/{job_id}/database", summary="The exported TVM database (zip)", response_class=Response,
             responses={200: {"content": {"application/zip": {}}}})
    def database(job_id: str):
        return Response(handlers.database(job_id), media_type="application/zip",
                        headers={"Content-Disposition": f'attachment; filename="{job_id}-database.zip"'})

    @app.get("/jobs/{job_id}/module", summary="The compiled tuned module (.so)", response_class=FileResponse)
    def module(job_id: str):
        return FileResponse(handlers.module(job_id), media_type="application/octet-stream",
                            filename=f"{job_id}-tuned.so")

    app.post("/jobs/{job_id}/cancel", response_model=Cancelled, summary="Stop after the round in flight")(handlers.cancel)
    app.get("/lanes", response_model=list[LaneInfo], summary="Live measurer lanes")(handlers.lanes)

    @app.get("/health", summary="200 while the API reaches Redis, else 503 with the reason (probes)")
    def health():
        why = handlers.health()
        return JSONResponse(status_code=503 if why else 200,
                            content={"status": "unavailable", "redis": why} if why else {"status": "ok"})

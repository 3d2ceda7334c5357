"""The coordinator's REST API (FastAPI): submit, list, inspect, cancel and follow jobs.

Every route but ``/healthz`` needs ``Authorization: Bearer TOKEN`` (declared
in the OpenAPI document): 401 without a valid token, 403 on another user's
job. A submission is answered only after its row is committed. A model is a
``package.module:factory`` name or a ``.py`` file under one of the server's
allowed roots; it is never run through a shell.
"""


# No ``from __future__ import annotations`` here: FastAPI reads the routes' dependency aliases at runtime.
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

from fastapi import Depends, FastAPI, HTTPException, Query, Request, Response, status
from fastapi import Path as PathParam
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse
from fastapi.routing import APIRoute
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.exceptions import HTTPException as StarletteHTTPException
from pydantic import BaseModel

from deeppool.coordinator.jobs import Job, JobKind, JobRequest, JobStatus
from deeppool.coordinator.metrics import CONTENT_TYPE, exposition
from deeppool.coordinator.page import render
from deeppool.coordinator.store import Store

if TYPE_CHECKING:
    from deeppool.coordinator.service import Service

MAX_ID = 2**63 - 1  # SQLite's INTEGER
JobId = Annotated[int, PathParam(ge=1, le=MAX_ID, description="a job id")]
FACTORY = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
LOG_CHUNK = 1 << 20


@dataclass(frozen=True, kw_only=True)
class ServerSettings:
    gpus: int
    allowed_roots: tuple[Path, ...]
    log_dir: Path
    device: str = "cpu"
    nodes: int = 1
    """the machines a foreground job spans (``serve --nodes``): its GPUs must split evenly over them"""


class Problem(BaseModel):
    detail: str | list[dict[str, object]]


def errors(*codes: int) -> dict[int | str, dict[str, object]]:
    """The error responses a route declares (every one has a ``detail`` message)."""
    return {code: {"model": Problem} for code in codes}


class Allocation(BaseModel):
    job_id: int
    kind: str
    gpus: int
    state: JobStatus


class Cluster(BaseModel):
    gpus: int
    device: str
    allocated: int
    allocations: list[Allocation]


def create_app(store: Store, settings: ServerSettings, service: "Service | None" = None) -> FastAPI:
    """The API over ``store``; with a ``service``, its loop runs while the app does (recovering first)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if service is not None:
            service.start()
        yield
        if service is not None:
            service.stop()

    app = FastAPI(title="deeppool coordinator", version="1", lifespan=lifespan,
                  description="Submit foreground (burst-parallel) and background training jobs.")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        """As FastAPI answers, but a 405 lists every method of the path (routes are per method)."""
        headers = dict(error.headers or {})
        if error.status_code == status.HTTP_405_METHOD_NOT_ALLOWED:
            headers["Allow"] = ", ".join(sorted(allowed_methods(app, request.url.path)))
        return JSONResponse({"detail": error.detail}, status_code=error.status_code, headers=headers)
    bearer = HTTPBearer(auto_error=False, description="a token from `deeppool token create NAME`")

    def user(credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]) -> str:
        name = store.user(credentials.credentials) if credentials is not None else None
        if name is None:
            raise HTTPException(status.HTTP_401_UNAUTHORIZED, "a valid bearer token is required",
                                headers={"WWW-Authenticate": "Bearer"})
        return name

    User = Annotated[str, Depends(user)]

    def owned(job_id: int, name: str) -> Job:
        job = store.job(job_id)
        if job is None:
            raise HTTPException(status.HTTP_404_NOT_FOUND, f"job {job_id} does not exist")
        if job.owner != name:
            raise HTTPException(status.HTTP_403_FORBIDDEN, f"job {job_id} belongs to another user")
        return job

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    def page() -> HTMLResponse:
        """The read-only status page: every job, and GPUs over time (no token: it shows no secrets)."""
        jobs = store.jobs()
        return HTMLResponse(render(jobs, {j.id: store.events(j.id) for j in jobs}, settings.gpus))

    @app.get("/metrics", response_class=PlainTextResponse, include_in_schema=False)
    def metrics() -> Response:
        """Prometheus metrics (no token, as the status page: counts, no secrets)."""
        return Response(exposition(store.jobs(), settings.gpus), media_type=CONTENT_TYPE)

    @app.get("/healthz")
    def healthz() -> dict[str, bool]:
        return {"ok": True}

    @app.post("/v1/jobs", status_code=status.HTTP_201_CREATED, responses={200: {"model": Job}, **errors(400, 401, 403, 422)})
    def submit(request: JobRequest, name: User, response: Response) -> Job:
        check_model(request.model, settings.allowed_roots)
        if request.script is not None:
            if request.kind is not JobKind.FOREGROUND:
                raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, "only a foreground job runs a script")
            check_script(request.script, settings.allowed_roots)
        if request.gpus > settings.gpus:
            raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT,
                                f"gpus {request.gpus} is more than this cluster's {settings.gpus}")
        if request.kind is JobKind.FOREGROUND and request.gpus % settings.nodes:
            raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT,
                                f"gpus {request.gpus} do not split evenly over the {settings.nodes} nodes a foreground "
                                f"job spans: ask for a multiple of {settings.nodes}")
        job, new = store.submit(name, request)
        if not new:
            response.status_code = status.HTTP_200_OK
        return job

    @app.get("/v1/jobs", responses=errors(401))
    def jobs(name: User) -> list[Job]:
        return store.jobs(owner=name)

    @app.get("/v1/jobs/{job_id}", responses=errors(401, 403, 404, 422))
    def job(job_id: JobId, name: User) -> Job:
        return owned(job_id, name)

    @app.post("/v1/jobs/{job_id}/cancel", responses=errors(401, 403, 404, 409, 422))
    def cancel(job_id: JobId, name: User) -> Job:
        current = owned(job_id, name)
        if current.state.terminal:
            raise HTTPException(status.HTTP_409_CONFLICT, f"job {job_id} is already {current.state.value}")
        if not store.transition(job_id, JobStatus.CANCELLED, f"cancelled by {name}"):
            raise HTTPException(status.HTTP_409_CONFLICT, f"job {job_id} finished before it could be cancelled")
        return owned(job_id, name)

    @app.get("/v1/jobs/{job_id}/logs", response_class=Response, responses={
        200: {"content": {"text/plain": {"schema": {"type": "string"}}},
              "headers": {"X-Next-Offset": {"schema": {"type": "integer"}, "description": "where to read on"}}},
        **errors(401, 403, 404, 422)})
    def logs(job_id: JobId, name: User, offset: Annotated[int, Query(ge=0, le=MAX_ID)] = 0) -> PlainTextResponse:
        owned(job_id, name)
        path = settings.log_dir / f"job-{job_id}.log"
        text = b""
        if path.exists():
            with path.open("rb") as log:
                log.seek(offset)
                text = log.read(LOG_CHUNK)
        return PlainTextResponse(text.decode(errors="replace"), headers={"X-Next-Offset": str(offset + len(text))})

    @app.get("/v1/cluster", responses=errors(401))
    def cluster(name: User) -> Cluster:
        del name
        live = store.jobs(states=(JobStatus.STARTING, JobStatus.RUNNING))
        allocations = [Allocation(job_id=j.id, kind=j.kind.value, gpus=j.gpus, state=j.state) for j in live]
        return Cluster(gpus=settings.gpus, device=settings.device, allocated=sum(a.gpus for a in allocations),
                       allocations=allocations)

    return app


def allowed_methods(app: FastAPI, path: str) -> set[str]:
    methods: set[str] = set()
    for route in app.routes:
        if isinstance(route, APIRoute) and route.path_regex.match(path):
            methods |= route.methods
    return methods


def check_script(script: str, roots: tuple[Path, ...]) -> None:
    """A .py file that exists under an allowed root (after resolving links and '..')."""
    if not script.endswith(".py"):
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, f"script '{script}' is not a .py file")
    check_model(script, roots)


def check_model(model: str, roots: tuple[Path, ...]) -> None:
    """A factory name, or a .py file that exists under an allowed root (after resolving links and '..')."""
    if FACTORY.match(model):
        return
    if not model.endswith(".py"):
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT,
                            f"model '{model}' is neither a .py file nor package.module:factory")
    path = Path(model).resolve()
    if not any(path.is_relative_to(root.resolve()) for root in roots):
        raise HTTPException(status.HTTP_403_FORBIDDEN, f"model '{model}' is outside the server's allowed roots")
    if not path.is_file():
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, f"model file '{model}' does not exist")

"""The coordinator's REST API (FastAPI): submit, list, inspect, cancel and follow jobs.

Every route but ``/healthz`` needs ``Authorization: Bearer TOKEN`` (declared
in the OpenAPI document): 401 without a valid token, 403 on another user's
job. A submission is answered only after its row is committed. A model is a
``package.module:factory`` name or a ``.py`` file under one of the server's
allowed roots; it is never run through a shell.

Limits: a request body over ``max_body_bytes`` (1 MiB unless ``serve
--max-body-kb`` says otherwise) is answered 413 before it is read: at once
when its ``Content-Length`` says so, else as soon as the bytes streamed in
pass the limit (:class:`BodyLimit`); the 413 closes the connection, so the rest is never read. A refused request's 422 lists where and
what is wrong, never the input. Lists come in pages (``GET /v1/jobs?after=ID``,
``/?before=ID``), and the page's timeline reads only the events that moved a
job, so neither grows with what jobs report. Logs are served in byte ranges
cut at UTF-8 character boundaries (``X-Next-Offset``, ``X-Log-Size``).
"""


# No ``from __future__ import annotations`` here: FastAPI reads the routes' dependency aliases at runtime.
import json
import math
import re
import sqlite3
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

from fastapi import Depends, FastAPI, HTTPException, Query, Request, Response, status
from fastapi import Path as PathParam
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse
from fastapi.routing import APIRoute
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from deeppool.coordinator.jobs import Job, JobKind, JobRequest, JobSpeed, JobStatus, differences
from deeppool.coordinator.metrics import CONTENT_TYPE, exposition
from deeppool.coordinator.page import by_job, render
from deeppool.coordinator.retention import Retention, disk_short, removed_reason
from deeppool.coordinator.store import QuotaExceeded, Store

if TYPE_CHECKING:
    from deeppool.coordinator.service import Service

MAX_ID = 2**63 - 1  # SQLite's INTEGER
JobId = Annotated[int, PathParam(ge=1, le=MAX_ID, description="a job id")]
FACTORY = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
LOG_CHUNK = 1 << 20
PAGE = 100
"""Jobs on one status page."""
MAX_LIST = 1000
"""The most jobs one ``GET /v1/jobs`` returns."""


@dataclass(frozen=True, kw_only=True)
class ServerSettings:
    gpus: int
    allowed_roots: tuple[Path, ...]
    log_dir: Path
    device: str = "cpu"
    nodes: int = 1
    """the machines a foreground job spans (``serve --nodes``): its GPUs must split evenly over them"""
    max_body_bytes: int = 1 << 20
    """a request body over this is refused (413) before it is read"""
    max_pending: int = 1000
    """a user with this many jobs waiting gets 429 for a new one (0: no limit)"""
    submits_per_minute: int = 600
    """a user's submissions past this rate (a bucket of this many, refilled over a minute) get 429 (0: no limit)"""
    retention: Retention = field(default_factory=lambda: Retention(keep_s=None, min_free_bytes=0))
    """when ended jobs' files leave ``log_dir`` (:mod:`deeppool.coordinator.retention`)"""


class BodyTooLarge(StarletteHTTPException):
    def __init__(self, limit: int) -> None:
        super().__init__(status.HTTP_413_CONTENT_TOO_LARGE,
                         f"the request body is over the server's limit of {limit} bytes (serve --max-body-kb)")


class BodyLimit:
    """ASGI middleware: 413 for a body over ``limit`` bytes, before any of it is read.

    A ``Content-Length`` over the limit is answered at once, without calling the app. A body streamed without
    one (chunked) is counted as it arrives, and the read that passes the limit raises :class:`BodyTooLarge`,
    which the app turns into the 413.
    """

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length", b"0")
        if not length.isdigit() or int(length) > self.limit:
            error = BodyTooLarge(self.limit)
            response = JSONResponse({"detail": error.detail}, status_code=error.status_code,
                                    headers={"Connection": "close"})
            await response(scope, receive, send)
            return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise BodyTooLarge(self.limit)
            return message

        async def closing(message: Message) -> None:
            if message["type"] == "http.response.start" and seen > self.limit:  # the rest is never read:
                message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
            await send(message)  # the connection closes after the 413

        await self.app(scope, counted, closing)


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
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        """Where and what is wrong, never the input (it may be large, or not printable)."""
        del request
        return JSONResponse({"detail": [{"loc": [str(part)[:100] for part in problem.get("loc", ())],
                                         "msg": str(problem.get("msg", ""))[:300]} for problem in error.errors()[:20]]},
                            status_code=status.HTTP_422_UNPROCESSABLE_CONTENT)

    @app.exception_handler(sqlite3.OperationalError)
    async def unavailable(request: Request, error: sqlite3.OperationalError) -> JSONResponse:
        """A database that cannot write now (a full disk, a lock held too long): 503 with one line, never 500."""
        del request
        return JSONResponse({"detail": f"the database cannot answer now ({str(error).splitlines()[0][:200]}): "
                                       "try again later"}, status_code=status.HTTP_503_SERVICE_UNAVAILABLE,
                            headers={"Retry-After": "60"})

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        """As FastAPI answers, but a 405 lists every method of the path (routes are per method)."""
        headers = dict(error.headers or {})
        if error.status_code == status.HTTP_405_METHOD_NOT_ALLOWED:
            headers["Allow"] = ", ".join(sorted(allowed_methods(app, request.url.path)))
        return JSONResponse({"detail": error.detail}, status_code=error.status_code, headers=headers)
    rate = RateLimit(settings.submits_per_minute)
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
    def page(before: Annotated[int | None, Query(ge=1, le=MAX_ID)] = None) -> HTMLResponse:
        """The read-only status page: the newest jobs (older ones a link away), and GPUs over time
        (no token: it shows no secrets)."""
        jobs = store.jobs(before=before, limit=PAGE, newest_first=True)
        older = jobs[-1].id if len(jobs) == PAGE else None
        ids = [j.id for j in jobs]
        return HTMLResponse(render(jobs, store.moves(ids), settings.gpus, total=store.count(), older=older,
                                   resizes=by_job(store.resizes_of(ids)), speeds=store.speeds(ids)))

    @app.get("/metrics", response_class=PlainTextResponse, include_in_schema=False)
    def metrics() -> Response:
        """Prometheus metrics (no token, as the status page: counts, no secrets)."""
        live = store.jobs(states=(JobStatus.STARTING, JobStatus.RUNNING))  # the history is in the counters
        resizes, last = store.resize_counts()
        return Response(exposition(live, settings.gpus, store.counts(), resizes=resizes, last_resize=last,
                                   speeds=store.speeds([j.id for j in live])), media_type=CONTENT_TYPE)

    @app.get("/healthz", responses={503: {"model": Health}})
    def healthz() -> JSONResponse:
        """ok while the scheduling loop runs (503 with what failed while it does not)."""
        health = service.health if service is not None else None
        full = store.space() or disk_short(settings.log_dir, settings.retention)
        if full is not None:
            return JSONResponse({"ok": False, "detail": full}, status_code=status.HTTP_503_SERVICE_UNAVAILABLE)
        if health is None or health.ok:
            return JSONResponse({"ok": True})
        return JSONResponse({"ok": False, "detail": health.detail}, status_code=status.HTTP_503_SERVICE_UNAVAILABLE)

    @app.post("/v1/jobs", status_code=status.HTTP_201_CREATED,
              responses={200: {"model": Job}, **errors(400, 401, 403, 409, 413, 422, 429)})
    def submit(request: JobRequest, name: User, response: Response) -> Job:
        wait_s = rate.take(name)
        if wait_s > 0:
            raise HTTPException(status.HTTP_429_TOO_MANY_REQUESTS,
                                f"you submitted more than {settings.submits_per_minute} jobs in a minute (serve "
                                f"--max-submits-per-minute): try again in {wait_s:.1f} s",
                                headers={"Retry-After": str(math.ceil(wait_s))})
        check_model(request.model, settings.allowed_roots)
        check_inputs(request)
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
        full = store.space()  # a full disk: 503 with the reason, and the database's reserve kept for its jobs
        if full is not None:
            raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, full, headers={"Retry-After": "60"})
        try:
            job, new = store.submit(name, request, max_pending=settings.max_pending)
        except QuotaExceeded as err:
            raise HTTPException(status.HTTP_429_TOO_MANY_REQUESTS, str(err)) from None
        except sqlite3.OperationalError as err:  # the disk filled in between (or the database is locked)
            raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, f"the database cannot take the job now "
                                f"({str(err).splitlines()[0][:200]}): try again later",
                                headers={"Retry-After": "60"}) from None
        if not new:
            changed = differences(job, request)
            if changed:
                raise HTTPException(status.HTTP_409_CONFLICT,
                                    f"idempotency key {_shown(request.idempotency_key)} was used for job {job.id} "
                                    f"with other parameters ({'; '.join(changed)}): use another key for another job")
            response.status_code = status.HTTP_200_OK
        return job

    @app.get("/v1/jobs", responses=errors(401, 422))
    def jobs(name: User, page: Annotated[JobsPage, Query()]) -> list[Job]:
        """Your jobs by id, a page at a time: the next page is after the last id listed."""
        return store.jobs(owner=name, after=page.after, limit=page.limit)

    @app.get("/v1/jobs/{job_id}", responses=errors(401, 403, 404, 422))
    def job(job_id: JobId, name: User) -> Job:
        return owned(job_id, name)

    @app.get("/v1/jobs/{job_id}/speed", responses=errors(401, 403, 404, 422))
    def speed(job_id: JobId, name: User) -> JobSpeed:
        """The job's measured speed points (per GPUs and batch) and its resizes: what its speed model is fitted
        to, and its width over time."""
        owned(job_id, name)
        return JobSpeed(job_id=job_id, points=store.speeds([job_id])[job_id], resizes=store.resizes(job_id))

    @app.post("/v1/jobs/{job_id}/cancel", responses=errors(401, 403, 404, 409, 422))
    def cancel(job_id: JobId, name: User) -> Job:
        current = owned(job_id, name)
        if current.state.terminal:
            raise HTTPException(status.HTTP_409_CONFLICT, f"job {job_id} is already {current.state.value}")
        if not store.transition(job_id, JobStatus.CANCELLED, "cancelled by its owner"):
            raise HTTPException(status.HTTP_409_CONFLICT, f"job {job_id} finished before it could be cancelled")
        return owned(job_id, name)

    @app.get("/v1/jobs/{job_id}/logs", response_class=Response, responses={
        200: {"content": {"text/plain": {"schema": {"type": "string"}}},
              "headers": {"X-Next-Offset": {"schema": {"type": "integer"}, "description": "where to read on"},
                          "X-Log-Size": {"schema": {"type": "integer"}, "description": "the log's size now"}}},
        **errors(401, 403, 404, 410, 416, 422)})
    def logs(job_id: JobId, name: User, where: Annotated[LogRange, Query()]) -> Response:
        """The log's bytes from ``offset``: at most 1 MiB, ending on a whole UTF-8 character, as written."""
        owned(job_id, name)
        offset = where.offset
        path = settings.log_dir / f"job-{job_id}.log"
        text, size = b"", 0
        if path.exists():
            with path.open("rb") as log:
                size = log.seek(0, 2)
                if offset > size:
                    raise HTTPException(status.HTTP_416_RANGE_NOT_SATISFIABLE,
                                        f"offset {offset} is past the end of job {job_id}'s log ({size} bytes)")
                log.seek(offset)
                text = whole_characters(log.read(LOG_CHUNK), at_end=offset + LOG_CHUNK >= size)
        elif (removed := removed_reason(store, job_id)) is not None:
            raise HTTPException(status.HTTP_410_GONE, f"job {job_id}'s log is gone: {removed}")
        elif offset > 0:
            raise HTTPException(status.HTTP_416_RANGE_NOT_SATISFIABLE,
                                f"offset {offset} is past the end of job {job_id}'s log (it has none yet)")
        return Response(text, media_type="text/plain; charset=utf-8",
                        headers={"X-Next-Offset": str(offset + len(text)), "X-Log-Size": str(size)})

    @app.get("/v1/cluster", responses=errors(401))
    def cluster(name: User) -> Cluster:
        del name
        live = store.jobs(states=(JobStatus.STARTING, JobStatus.RUNNING))
        allocations = [Allocation(job_id=j.id, kind=j.kind.value, gpus=j.held, state=j.state) for j in live]
        return Cluster(gpus=settings.gpus, device=settings.device, allocated=sum(a.gpus for a in allocations),
                       allocations=allocations)

    return app


class RateLimit:
    """Per user, a bucket of ``per_minute`` submissions refilled evenly over a minute (0: no limit)."""

    def __init__(self, per_minute: int) -> None:
        self.per_minute = per_minute
        self._lock = threading.Lock()
        self._buckets: dict[str, tuple[float, float]] = {}  # user: (submissions left, when counted)

    def take(self, user: str) -> float:
        """Take one submission from ``user``'s bucket: 0 if there was one, else the seconds until there is."""
        if self.per_minute <= 0:
            return 0.0
        now = time.monotonic()
        with self._lock:
            left, then = self._buckets.get(user, (float(self.per_minute), now))
            left = min(float(self.per_minute), left + (now - then) * self.per_minute / 60)
            if left < 1:
                self._buckets[user] = (left, now)
                return (1 - left) * 60 / self.per_minute
            self._buckets[user] = (left - 1, now)
            return 0.0


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


class JobsPage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    after: int = Field(default=0, ge=0, le=MAX_ID, description="list the jobs after this id")
    limit: int = Field(default=MAX_LIST, ge=1, le=MAX_LIST, description="the most jobs to list")


class LogRange(BaseModel):
    model_config = ConfigDict(extra="forbid")

    offset: int = Field(default=0, ge=0, le=MAX_ID, description="the byte to read from")


class Health(BaseModel):
    ok: bool
    detail: str | None = None


def whole_characters(data: bytes, *, at_end: bool) -> bytes:
    """``data`` without a UTF-8 character cut at its end (unless it is the log's end, or holds no whole one)."""
    if at_end:
        return data
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte < 0x80:
            return data  # ASCII: nothing is cut
        if byte >= 0xC0:  # the lead byte of the last character: is the character whole?
            need = 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4
            return data if back >= need or back == len(data) else data[:-back]
    return data


def _shown(text: str | None) -> str:
    """User text in a message: quoted, and cut to 80 characters."""
    text = text or ""
    return json.dumps(text if len(text) <= 80 else text[:77] + "...")


def check_model(model: str, roots: tuple[Path, ...]) -> None:
    """A factory name, or a .py file given by its absolute path that exists under an allowed root (after
    resolving links and '..'). A relative path is refused: the server's folder is not the sender's, and the job
    is launched from neither."""
    if FACTORY.match(model):
        return
    if not model.endswith(".py"):
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT,
                            f"model {_shown(model)} is neither a .py file nor package.module:factory")
    if not Path(model).is_absolute():
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT,
                            f"model {_shown(model)} is a relative path: send its absolute path (the server does not "
                            "know the folder it is relative to; `deeppool submit` sends absolute paths)")
    try:
        path = Path(model).resolve()
    except (RuntimeError, OSError, ValueError):  # Python 3.11 raises RuntimeError for a link loop
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT,
                            f"model {_shown(model)} cannot be resolved: a symbolic link loop") from None
    if not any(path.is_relative_to(root.resolve()) for root in roots):
        raise HTTPException(status.HTTP_403_FORBIDDEN, f"model {_shown(model)} is outside the server's allowed roots")
    try:
        found = path.is_file()
    except (OSError, ValueError) as err:  # a name too long, a link loop found late
        reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT,
                            f"model file {_shown(model)} cannot be opened: {reason}") from None
    if not found:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, f"model file {_shown(model)} does not exist")


def check_inputs(request: JobRequest) -> None:
    """A factory needs its input's shape (and token ids their range); a model file makes its own inputs."""
    given = [name for name in ("input_shape", "input_dtype", "vocab_size") if getattr(request, name) is not None]
    if not FACTORY.match(request.model):
        if given:
            raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT,
                                f"{given[0]} is for a factory model (package.module:fn): model file "
                                f"{_shown(request.model)} makes its own inputs with inputs(batch_size)")
        return
    if request.input_shape is None:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT,
                            f"model {_shown(request.model)} is a factory: give its per-sample input_shape, e.g. "
                            "[3, 224, 224] (or [128] with input_dtype int64 and vocab_size)")
    if (request.input_dtype or "float32").startswith(("int", "uint")) and request.vocab_size is None:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT,
                            f"input_dtype {request.input_dtype} gives token ids: also give vocab_size")

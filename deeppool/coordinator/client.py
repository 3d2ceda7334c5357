"""The Python client of the coordinator; the CLI is a thin layer over it.

It finds the server in ``DEEPPOOL_URL`` (default ``http://127.0.0.1:8470``)
and the token in ``DEEPPOOL_TOKEN``. A refused request raises
:class:`~deeppool.errors.DeeppoolError` with the server's message.
"""

from __future__ import annotations

import codecs
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx

from deeppool.coordinator.jobs import Job, JobRequest, JobSpeed
from deeppool.errors import DeeppoolError

DEFAULT_URL = "http://127.0.0.1:8470"
PAGE = 1000
"""Jobs asked for per ``GET /v1/jobs`` (the server's most)."""


@dataclass(frozen=True, kw_only=True)
class LogChunk:
    data: bytes
    """the log's bytes from the offset asked, as written (the server ends a chunk on a whole UTF-8 character)"""
    next_offset: int
    size: int
    """the log's size when it was read"""

    @property
    def text(self) -> str:
        return self.data.decode(errors="replace")


class Client:
    def __init__(self, url: str | None = None, token: str | None = None, *, timeout_s: float = 30.0,
                 http: httpx.Client | None = None) -> None:
        """``http``: an existing client to send through (an in-process test client); else one to ``url``."""
        self.url = (url or os.environ.get("DEEPPOOL_URL") or DEFAULT_URL).rstrip("/")
        token = token or os.environ.get("DEEPPOOL_TOKEN")
        if not token:
            raise DeeppoolError("no token: set DEEPPOOL_TOKEN to one from `deeppool token create NAME --db DB`")
        self._auth = {"Authorization": f"Bearer {token}"}
        self._http = http or httpx.Client(base_url=self.url, timeout=timeout_s)

    def close(self) -> None:
        self._http.close()

    def _call(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = self._http.request(method, path, headers=self._auth, **kwargs)
        except httpx.TransportError as err:
            raise DeeppoolError(f"cannot reach the coordinator at {self.url} ({err}): start it with "
                                "`deeppool serve`, or set DEEPPOOL_URL") from None
        if response.is_error:
            raise DeeppoolError(f"the coordinator refused {method} {path}: {_message(response)}")
        return response

    def submit(self, request: JobRequest) -> Job:
        return Job.model_validate(self._call("POST", "/v1/jobs", json=request.model_dump(mode="json")).json())

    def jobs(self) -> list[Job]:
        """All your jobs, read a page at a time."""
        found: list[Job] = []
        while True:
            page = [Job.model_validate(j) for j in self._call("GET", "/v1/jobs", params={
                "after": found[-1].id if found else 0, "limit": PAGE}).json()]
            found += page
            if len(page) < PAGE:
                return found

    def job(self, job_id: int) -> Job:
        return Job.model_validate(self._call("GET", f"/v1/jobs/{job_id}").json())

    def speed(self, job_id: int) -> JobSpeed:
        """The job's measured speed points and its resizes."""
        return JobSpeed.model_validate(self._call("GET", f"/v1/jobs/{job_id}/speed").json())

    def cancel(self, job_id: int) -> Job:
        return Job.model_validate(self._call("POST", f"/v1/jobs/{job_id}/cancel").json())

    def logs(self, job_id: int, offset: int = 0) -> LogChunk:
        """One chunk of the log from byte ``offset`` (at most 1 MiB)."""
        response = self._call("GET", f"/v1/jobs/{job_id}/logs", params={"offset": offset})
        return LogChunk(data=response.content, next_offset=int(response.headers.get("X-Next-Offset", offset)),
                        size=int(response.headers.get("X-Log-Size", 0)))

    def log(self, job_id: int) -> Iterator[str]:
        """The whole log as it is now (up to its size at the first read), in chunks of whole characters."""
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        chunk = self.logs(job_id)
        end = chunk.size
        while True:
            yield decoder.decode(chunk.data, final=not chunk.data or chunk.next_offset >= end)
            if not chunk.data or chunk.next_offset >= end:
                return
            chunk = self.logs(job_id, chunk.next_offset)

    def follow(self, job_id: int, poll_s: float = 1.0) -> Iterator[str]:
        """Log text as it grows, until the job is in a final state and the log is read to its end."""
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        offset = 0
        while True:
            chunk = self.logs(job_id, offset)
            offset = chunk.next_offset
            if chunk.data:
                yield decoder.decode(chunk.data)
                continue
            if self.job(job_id).state.terminal:
                yield decoder.decode(b"", final=True)
                return
            time.sleep(poll_s)

    def cluster(self) -> dict[str, Any]:
        return dict(self._call("GET", "/v1/cluster").json())


def _message(response: httpx.Response) -> str:
    try:
        detail = response.json().get("detail", response.text)
    except ValueError:
        return f"HTTP {response.status_code} {response.text.strip()[:200]}"
    if isinstance(detail, list):  # pydantic's validation errors
        detail = "; ".join(f"{'.'.join(str(p) for p in d.get('loc', ())[1:])}: {d.get('msg')}" for d in detail)
    return f"HTTP {response.status_code}: {detail}"

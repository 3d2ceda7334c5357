"""What one client may cost the server in connections and descriptors, and logs that say a thing once.

uvicorn's HTTP protocol (h11) closes a connection idle between requests
(``timeout_keep_alive``), but not one that opens and sends a header line now
and then: 1,100 of those took all of a server's descriptors in a review.
:func:`guarded_protocol` makes uvicorn's protocol with three more limits:

* a request's head (request line and headers) must arrive within
  ``head_timeout_s`` of the connection's opening or of the previous answer;
* a request's body must keep coming: no more than ``body_timeout_s`` without
  a byte;
* one client holds at most ``per_client`` connections at once, and the server
  at most what its descriptor limit allows (:func:`connection_budget`). A client is
  its peer address; on loopback, where every local account shares
  127.0.0.1, it is the peer socket's account (its uid, from
  ``/proc/net/tcp``), so a job's connections never use up its neighbours'.
  A connection past the cap is answered 429 and closed at once.

:func:`raise_descriptor_limit` lifts ``RLIMIT_NOFILE``'s soft limit to its
hard one at start, as systemd's ``LimitNOFILE`` would. :class:`Once` is a
logging filter: a condition (a logger and a message, such as asyncio's
"socket.accept() out of system resource") is logged the first time, and its
repeats are counted and reported once a minute at most, never one traceback
per request.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import resource
import time
from collections import Counter
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("deeppool.coordinator")
_REFUSAL = b'{"detail": "too many connections from one client at once: close some"}'
TOO_MANY = (b"HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(_REFUSAL), _REFUSAL))
REPEAT_WINDOW_S = 60.0


def raise_descriptor_limit() -> tuple[int, int]:
    """Lift the soft limit on open files to the hard one; the soft limit now, and the one before."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            return soft, soft
        return target, soft
    return soft, soft


def connection_budget(descriptors: int) -> tuple[int, int]:
    """Of a process's ``descriptors``: the accept backlog (asyncio accepts up to that many at once, before any
    is looked at) and the most connections held, leaving the rest to the database, logs and jobs."""
    backlog = max(16, min(2048, descriptors // 8))
    return backlog, max(8, descriptors - backlog - max(64, descriptors // 8))


def _hex_port(field: str) -> int:
    return int(field.rsplit(":", 1)[1], 16)


def peer_uid(peer_port: int, our_port: int) -> int | None:
    """The account of the local socket at ``peer_port`` connected to ``our_port`` (None if not found)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as lines:
                next(lines, None)
                for line in lines:
                    fields = line.split()
                    if len(fields) > 7 and _hex_port(fields[1]) == peer_port and _hex_port(fields[2]) == our_port:
                        return int(fields[7])
        except (OSError, ValueError):
            return None
    return None


def client_key(peer: Any, local: Any) -> str:
    """Who a connection is from: ``uid N`` on loopback (when it can be found), else the peer's address."""
    if not isinstance(peer, tuple) or len(peer) < 2:
        return "unknown"
    host = str(peer[0])
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if loopback and isinstance(local, tuple) and len(local) >= 2:
        uid = peer_uid(int(peer[1]), int(local[1]))
        if uid is not None:
            return f"uid {uid}"
    return host


def guarded_protocol(*, per_client: int, head_timeout_s: float, body_timeout_s: float,
                     total: int = 1 << 30) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a head timeout, a body timeout, a cap on one client's connections and one on
    all (``total``: past it a connection is closed unread, keeping descriptors for the server's own files)."""
    held: Counter[str] = Counter()  # connections open per client, shared by every connection of the server
    check_s = max(0.05, min(1.0, head_timeout_s / 4, body_timeout_s / 4))

    class Guarded(H11Protocol):
        _key: str | None = None
        _timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > total:
                log.warning("refused a connection: the server holds %d, the most it may (its descriptor limit)",
                            len(self.connections) - 1)
                transport.abort()
                return
            key = client_key(transport.get_extra_info("peername"), transport.get_extra_info("sockname"))
            if held[key] >= per_client:
                log.warning("refused a connection from %s: it holds %d, the most one client may (serve "
                            "--max-client-connections)", key, held[key])
                transport.write(TOO_MANY)
                transport.close()
                return
            self._key = key
            held[key] += 1
            self._since = self._last_data = self.loop.time()
            self._timer = self.loop.call_later(check_s, self._check)

        def connection_lost(self, exc: Exception | None) -> None:
            if self._key is not None:
                held[self._key] -= 1
                if held[self._key] <= 0:
                    del held[self._key]
                self._key = None
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            self._last_data = self.loop.time()
            super().data_received(data)

        def on_response_complete(self) -> None:
            self._since = self.loop.time()  # the next request's head is timed from here
            super().on_response_complete()

        def _check(self) -> None:
            self._timer = None
            if self.transport.is_closing():
                return
            now, theirs = self.loop.time(), self.conn.their_state
            waiting_head = theirs is h11.IDLE and (self.cycle is None or self.cycle.response_complete)
            if waiting_head and now - self._since > head_timeout_s:
                log.warning("closed a connection whose request head took over %g s (serve --head-timeout-s)",
                            head_timeout_s)
                self.transport.close()
                return
            if theirs is h11.SEND_BODY and now - self._last_data > body_timeout_s:
                log.warning("closed a connection whose request body stalled for over %g s (serve "
                            "--body-timeout-s)", body_timeout_s)
                if self.cycle is not None:
                    self.cycle.keep_alive = False
                self.transport.close()
                return
            self._timer = self.loop.call_later(check_s, self._check)

    return Guarded


class Once(logging.Filter):
    """Let a condition (logger, message template) through once; count its repeats and report them at most once
    every :data:`REPEAT_WINDOW_S` seconds, in one line without a traceback."""

    def __init__(self) -> None:
        super().__init__()
        self._seen: dict[tuple[str, str, str], tuple[float, int]] = {}  # condition: (last reported, repeats)

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        first = str(record.msg).split("\n", 1)[0]  # asyncio adds the socket's details on later lines
        key = (record.name, first, type(error).__name__ if error is not None else "")
        now = time.monotonic()
        if key not in self._seen:
            self._seen[key] = (now, 0)
            return True
        reported, repeats = self._seen[key]
        repeats += 1
        if now - reported < REPEAT_WINDOW_S:
            self._seen[key] = (reported, repeats)
            return False
        self._seen[key] = (now, 0)
        record.msg = f"{record.getMessage()} [{repeats} times in the last {now - reported:.0f} s]"
        record.args, record.exc_info, record.exc_text = None, None, None
        return True


def log_once(names: tuple[str, ...] = ("", "uvicorn", "uvicorn.error", "asyncio")) -> Once:
    """Put one :class:`Once` filter on the handlers of these loggers (the root's included)."""
    once = Once()
    for name in names:
        for handler in logging.getLogger(name).handlers:
            handler.addFilter(once)
    return once

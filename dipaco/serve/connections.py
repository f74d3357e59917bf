"""Idle and slow-header connections cannot crowd out requests: a deadline for a request's headers and a
bound on open connections, in uvicorn's own HTTP protocol (subclassed, not replaced).

- Header deadline: a connection must complete a request's headers within ``header_timeout_s`` of opening,
  and of finishing its previous answer (keep-alive). Otherwise it is closed. A request answered before
  its body arrived (a 413, a 401) may still be sending the body, which uvicorn reads and discards so
  that the client can read the answer: meanwhile the deadline restarts with every chunk, and runs whole
  from the body's end. uvicorn alone closes a
  kept-alive connection only while it sends nothing, and a new one never: 272 idle and slow-header
  connections were still open after 61 s. (A body that stalls once the headers are in is ``BodyLimit``'s
  408.)
- Connection bound: at most ``max_connections`` open. A new connection beyond it closes the connection
  that has waited longest for its next request's headers (idle or slow: one that costs the server nothing
  to drop, with no request in progress; one whose request bytes have arrived, unread yet, is passed over),
  or, when every connection has a request in progress, is closed itself. Without the bound, idle
  connections used up the process's file descriptors (``ulimit -n``), the event loop could not accept,
  and a valid request timed out at 15 s.
- Descriptor budget: asyncio accepts every pending connection in one go (up to the listen backlog) before
  any of them reaches the protocol, so a burst could still exhaust ``ulimit -n``; asyncio then stops
  accepting for a whole second, valid clients included. The listening socket (:class:`AdmissionSocket`)
  therefore accepts only while fewer than ``max_connections + ACCEPT_HEADROOM`` accepted sockets are open;
  beyond, the connection waits in the kernel's queue for the next turn of the loop, by which the
  evicted connections' descriptors are free.
- :func:`default_max_connections`: the descriptors this process may still open, less ``FD_RESERVE`` for
  the files serving itself opens and ``ACCEPT_HEADROOM`` for connections accepted before any is evicted.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import resource
import socket
import struct
import termios
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

DEFAULT_HEADER_TIMEOUT_S = 5.0
FD_RESERVE = 32  # descriptors kept free for everything but client connections
ACCEPT_HEADROOM = 32  # sockets accepted beyond max_connections, whose admission evicts others


def open_descriptors() -> int | None:
    """File descriptors this process has open now (Linux's /proc; None where it cannot tell)."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return None


def default_max_connections() -> int:
    """The connection bound the descriptor limit allows: RLIMIT_NOFILE less those open now, ``FD_RESERVE``
    and ``ACCEPT_HEADROOM``."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 16
    used = open_descriptors() or 0
    return max(1, soft - used - FD_RESERVE - ACCEPT_HEADROOM)


class AdmissionSocket(socket.socket):
    """A listening socket that accepts only while ``admit()`` says there is room: otherwise ``accept``
    answers as if no connection were pending, and asyncio's accept loop tries again on the next turn of
    the event loop (the socket stays readable), instead of failing with EMFILE and pausing a second."""

    admit: Callable[[], bool] | None = None
    accepted: Callable[[], None] | None = None

    def accept(self):
        if self.admit is not None and not self.admit():
            raise BlockingIOError("no room for another connection until one closes")
        conn = super().accept()
        if self.accepted is not None:
            self.accepted()
        return conn


@dataclass
class ConnectionGuard:
    """What the connections of one server share: the header deadline, the bound, and who waits longest."""

    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    max_connections: int = 1024
    on_count: Callable[[int], None] | None = None  # the number of open connections, as it changes
    on_close: Callable[[str], None] | None = None  # the reason of each connection the guard closed
    open: set = field(default_factory=set)
    waiting: OrderedDict = field(default_factory=OrderedDict)  # connections awaiting headers, longest first
    sockets: int = 0  # accepted and not yet closed (a closed connection's descriptor is freed with its loss)

    def __post_init__(self) -> None:
        if not self.header_timeout_s > 0:
            raise ValueError(f"header_timeout_s must be > 0, got {self.header_timeout_s}")
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections}")

    def opened(self, conn: Any) -> bool:
        """Admits ``conn``; at the bound, closes the longest-waiting connection for it. False: ``conn`` itself
        was closed (every open connection has a request in progress)."""
        if len(self.open) >= self.max_connections:
            if not self.waiting:
                self._close(conn, "refused")
                return False
            self._close(self._victim(), "evicted")
        self.open.add(conn)
        self._count()
        return True

    def _victim(self) -> Any:
        """The connection that has waited longest for its headers, passing over any whose request bytes
        have arrived but are not read yet (a busy loop): closing it would reset a valid request. When every
        waiting connection has bytes pending, the longest waiting still goes: the bound holds."""
        victim = next((conn for conn in self.waiting if not _bytes_pending(conn)), next(iter(self.waiting)))
        self.waiting.pop(victim)
        return victim

    def room_to_accept(self) -> bool:
        return self.sockets < self.max_connections + ACCEPT_HEADROOM

    def socket_accepted(self) -> None:
        self.sockets += 1

    def guard_listener(self, sock: AdmissionSocket) -> None:
        sock.admit = self.room_to_accept
        sock.accepted = self.socket_accepted

    def awaiting_headers(self, conn: Any) -> None:
        if conn in self.open:
            self.waiting[conn] = None
            self.waiting.move_to_end(conn)

    def request_started(self, conn: Any) -> None:
        self.waiting.pop(conn, None)

    def closed(self, conn: Any) -> None:
        self.sockets = max(0, self.sockets - 1)
        self.waiting.pop(conn, None)
        if conn in self.open:
            self.open.discard(conn)
            self._count()

    def header_timeout(self, conn: Any) -> None:
        self._close(conn, "header_timeout")

    def _close(self, conn: Any, reason: str) -> None:
        self.waiting.pop(conn, None)
        if conn in self.open:
            self.open.discard(conn)  # now: its descriptor is freed on the loop's next turn
            self._count()
        conn.transport.close()
        if self.on_close is not None:
            self.on_close(reason)

    def _count(self) -> None:
        if self.on_count is not None:
            self.on_count(len(self.open))


def _bytes_pending(conn: Any) -> bool:
    """Whether ``conn``'s socket has received bytes the event loop has not read (FIONREAD)."""
    sock = conn.transport.get_extra_info("socket")
    try:
        count = fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0")
    except (OSError, AttributeError, ValueError):
        return False
    return struct.unpack("i", count)[0] > 0


def guarded_protocol(guard: ConnectionGuard) -> type:
    """uvicorn's HTTP protocol class (httptools' when installed, else h11's: uvicorn's own choice) with
    ``guard``'s header deadline and connection bound. Both keep the request in progress as ``self.cycle``,
    created while the headers' bytes are received, and call ``on_response_complete`` after each answer."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    base: Any = AutoHTTPProtocol

    class GuardedHTTPProtocol(base):
        _header_timer: asyncio.TimerHandle | None = None
        _draining = False  # answered, the request's body still arriving (read and discarded)
        _message_done = True  # httptools: the parser has seen the end of the current request

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if guard.opened(self):
                self._await_headers()

        def data_received(self, data: bytes) -> None:
            cycle = self.cycle
            super().data_received(data)
            if self.cycle is not cycle:  # these bytes completed a request's headers
                self._request_started()
            elif self._draining and not self.transport.is_closing():
                self._draining = self._body_arriving()
                self._await_headers()

        def on_response_complete(self) -> None:
            cycle = self.cycle
            super().on_response_complete()
            if self.cycle is not cycle:  # a pipelined request was already waiting
                self._request_started()
            elif not self.transport.is_closing():
                self._draining = self._body_arriving()
                self._await_headers()

        # httptools' parser callbacks (h11's protocol has none: its state machine says it instead)
        def on_message_begin(self) -> None:
            self._message_done = False
            super().on_message_begin()

        def on_message_complete(self) -> None:
            self._message_done = True
            super().on_message_complete()

        def _body_arriving(self) -> bool:
            """Whether the client is still sending the current request (its body)."""
            conn = getattr(self, "conn", None)
            if conn is not None and hasattr(conn, "their_state"):  # h11
                import h11

                return conn.their_state is h11.SEND_BODY
            return not self._message_done

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_header_timer()
            guard.closed(self)
            super().connection_lost(exc)

        def _await_headers(self) -> None:
            self._cancel_header_timer()
            guard.awaiting_headers(self)
            self._header_timer = self.loop.call_later(guard.header_timeout_s, self._headers_too_late)

        def _request_started(self) -> None:
            self._cancel_header_timer()
            guard.request_started(self)

        def _headers_too_late(self) -> None:
            self._header_timer = None
            if (self.cycle is None or self.cycle.response_complete) and not self.transport.is_closing():
                guard.header_timeout(self)

        def _cancel_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

    return GuardedHTTPProtocol

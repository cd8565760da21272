"""`BoundedHTTPServer`: the standard library's threading HTTP server with bounds on idle, slow and
surplus connections. It serves the coordinator's pages (ftjax/coordinator/http.py) and a replica's
catch-up snapshots (ftjax/runtime/catchup.py), so it sits here, below both: catch-up loads no
coordinator state, page or Prometheus for it.
"""

from __future__ import annotations

import io
import selectors
import socket
import socketserver
import ssl
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import cast

from ftjax.base import net

# BoundedHTTPServer's defaults: a client is idle for 10 s at most, and a few peers or scrapers
# at a time are the normal load, so 64 connections leave room without letting a flood in.
IDLE_TIMEOUT_S = 10.0
MAX_CONNECTIONS = 64
# A request's line and headers must all arrive within HEADER_TIMEOUT_S of its connection (a total,
# not per read: a client that drips a byte at a time is dropped then). Until they have, a connection
# holds no thread, only its bytes: MAX_PENDING of them at once, then new ones are refused.
HEADER_TIMEOUT_S = 10.0
MAX_PENDING = 256
_MAX_HEAD = 64 << 10  # a request line and headers longer than this are not a client of ours
_BUSY_BODY = b"too many connections: retry later\n"
_BUSY = (
    b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: text/plain\r\nConnection: close\r\n"
    b"Content-Length: %d\r\n\r\n%s" % (len(_BUSY_BODY), _BUSY_BODY)
)


class BoundedHTTPServer(ThreadingHTTPServer):
    """A threading HTTP server (a daemon thread per request) that idle, slow or surplus connections
    cannot exhaust:

    - a new connection holds no thread until its request line and headers have all arrived: one
      thread (`_HeadReader`, a selector) reads every connection's head, and hands a complete one to
      a thread of its own. A head must arrive within `header_timeout_s` of the connection in all
      (a client that sends a byte at a time is dropped then, however often it sends one), and at
      most `max_pending` connections wait for theirs; one more is refused (503) at once;
    - every wait for the client, for its head or later, lasts at most `idle_timeout_s`: one that
      sends nothing, or stops reading its response, is dropped then. After the head, that bounds
      idleness, not duration: a long response that keeps moving (a rate-limited snapshot) is never
      cut, nor is a handler's wait that does not touch the socket (one `sendall` must finish within
      the timeout, though: a long response is written in chunks);
    - at most `max_connections` requests are served at once. One more is answered 503 and closed at
      once by the reading thread, without a thread of its own: queueing it instead would let slow
      requests pile up in the queue, and its client learns at once that it should retry.

    With `ssl_context` (a server-side `ssl.SSLContext`) every connection is TLS: its handshake is
    made in the reading thread too, under the same deadline. The host of `address` may be "" (every
    interface: one dual-stack IPv6 socket where the kernel has IPv6), an IPv4 or an IPv6 address.
    """

    daemon_threads = True
    request_queue_size = 128  # the listen backlog: a burst of connections is accepted, then judged

    def __init__(
        self,
        address: tuple[str, int],
        handler: type[BaseHTTPRequestHandler],
        *,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
        max_connections: int = MAX_CONNECTIONS,
        header_timeout_s: float = HEADER_TIMEOUT_S,
        max_pending: int = MAX_PENDING,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        for name, value in (("idle_timeout_s", idle_timeout_s), ("header_timeout_s", header_timeout_s)):
            if value <= 0:
                raise ValueError(f"{name} must be positive, not {value}")
        for name, value in (("max_connections", max_connections), ("max_pending", max_pending)):
            if value < 1:
                raise ValueError(f"{name} must be at least 1, not {value}")
        self.idle_timeout_s = idle_timeout_s
        self.ssl_context = ssl_context
        self._slots = threading.BoundedSemaphore(max_connections)
        host, port = address
        self.address_family = net.family_of(host)
        super().__init__((net.sockaddr_host(host, self.address_family), port), handler)
        self._heads = _HeadReader(self._dispatch, header_timeout_s, idle_timeout_s, max_pending)

    def server_bind(self) -> None:
        # HTTPServer.server_bind would look up this host's name (socket.getfqdn), which waits on DNS
        # where there is none (a network namespace, a cluster node): not needed, so skipped.
        if self.address_family == socket.AF_INET6 and self.server_address[0] == "::":
            self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        socketserver.TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name, self.server_port = str(host), int(port)

    def process_request(self, request: socket.socket, client_address) -> None:  # type: ignore[override]  # (TCP only: never a datagram pair)
        """A new connection (the accepting thread): to the head reader, or refused if it is full."""
        try:
            request.setblocking(False)
            if self.ssl_context is not None:
                request = self.ssl_context.wrap_socket(request, server_side=True, do_handshake_on_connect=False)
        except OSError:
            self.shutdown_request(request)
            return
        if not self._heads.add(request, client_address):
            if self.ssl_context is None:  # (a TLS client could not read a plain 503)
                _refuse(request)
            self.shutdown_request(request)

    def _dispatch(self, request: socket.socket, client_address, head: bytes) -> None:
        """A connection whose head has arrived (the reading thread): a thread serves it, if a slot is free."""
        if not self._slots.acquire(blocking=False):
            _refuse(request)
            self.shutdown_request(request)
            return
        try:
            request.settimeout(self.idle_timeout_s)
            super().process_request(_Received(request, head), client_address)  # type: ignore[arg-type]  # (a socket with its head replayed)  # starts the request's thread
        except BaseException:
            self._slots.release()
            self.shutdown_request(request)
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def server_close(self) -> None:
        super().server_close()
        self._heads.close()

    def handle_error(self, request, client_address) -> None:
        # A client that hung up or went idle mid-response is its own business, not a server error:
        # no traceback on stderr for it (a flood of them would drown the process's output).
        if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError, ssl.SSLError)):
            super().handle_error(request, client_address)


def _refuse(request: socket.socket) -> None:
    """Best effort, never blocking: a 503 fits the empty send buffer of a new connection, and what
    the client sent already is read (closing on unread bytes resets the connection, and the client
    may then lose the 503)."""
    try:
        request.setblocking(False)
        request.send(_BUSY)
        request.recv(1 << 16)
    except OSError:
        pass


class _Replay(io.RawIOBase):
    """A connection's bytes as a raw stream: the head read already, then the socket's."""

    def __init__(self, head: bytes, sock: socket.socket) -> None:
        self._head, self._sock = memoryview(head), sock

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        if self._head:
            n = min(len(b), len(self._head))
            b[:n], self._head = self._head[:n], self._head[n:]
            return n
        return self._sock.recv_into(b)


class _Received:
    """A connection whose head `_HeadReader` read: the handler's `rfile` replays it, then reads the
    socket; everything else is the socket's."""

    def __init__(self, sock: socket.socket, head: bytes) -> None:
        self._sock, self._head = sock, head

    def __getattr__(self, name: str):
        return getattr(self._sock, name)

    def makefile(self, mode: str = "r", buffering: int | None = None, **kwargs):
        if "r" not in mode:
            return self._sock.makefile(mode, buffering, **kwargs)  # type: ignore[call-overload]  # (socket's own overloads decide)
        raw = _Replay(self._head, self._sock)
        return raw if buffering == 0 else io.BufferedReader(raw, io.DEFAULT_BUFFER_SIZE)


class _Pending:
    """A connection whose head is still arriving."""

    def __init__(self, sock: socket.socket, address, deadline: float, idle_s: float) -> None:
        self.sock, self.address, self.deadline, self.idle_s = sock, address, deadline, idle_s
        self.expires = min(deadline, time.monotonic() + idle_s)  # the deadline, or sooner if it sends nothing
        self.head = b""
        self.handshaken = not isinstance(sock, ssl.SSLSocket)
        self.events = selectors.EVENT_READ
        self.gone = False  # dropped or handed over: no longer the reader's (its socket may be closed)


class _HeadReader:
    """Reads the request line and headers of every new connection in one thread (a selector, so a
    slow client costs a buffer, not a thread), and calls `ready(sock, address, head)` (in that
    thread) once a head has arrived. A connection past its deadline, over `_MAX_HEAD` bytes, closed
    or failing its TLS handshake is dropped."""

    def __init__(self, ready, timeout_s: float, idle_s: float, max_pending: int) -> None:
        self._ready, self._timeout_s, self._idle_s, self._max = ready, timeout_s, idle_s, max_pending
        self._lock = threading.Lock()
        self._new: list[_Pending] = []
        self._count, self._closed = 0, False
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        for s in (self._wake_r, self._wake_w):
            s.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._thread = threading.Thread(target=self._run, name="http-heads", daemon=True)
        self._thread.start()

    def add(self, sock: socket.socket, address) -> bool:
        """Whether the connection was taken (False: closing, or `max_pending` are waiting already)."""
        with self._lock:
            if self._closed or self._count >= self._max:
                return False
            self._count += 1
            self._new.append(_Pending(sock, address, time.monotonic() + self._timeout_s, self._idle_s))
        self._wake()
        return True

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._wake()
        self._thread.join(10)

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except OSError:  # its buffer is full: the thread wakes anyway
            pass

    def _run(self) -> None:
        try:
            while self._turn():
                pass
        finally:
            for key in list(self._selector.get_map().values()):
                cast(socket.socket, key.fileobj).close()  # (only sockets are registered)
            for p in self._new:
                p.sock.close()
            self._selector.close()
            self._wake_w.close()

    def _turn(self) -> bool:
        """One wait and what arrived; False once closed."""
        with self._lock:
            new, self._new, closed = self._new, [], self._closed
        if closed:
            self._new = new
            return False
        for p in new:
            self._selector.register(p.sock, p.events, p)
        pending = [k.data for k in self._selector.get_map().values() if k.data is not None]
        wait = min((p.expires for p in pending), default=time.monotonic() + 1.0) - time.monotonic()
        for key, _ in self._selector.select(max(0.0, wait)):
            if key.data is None:
                _drain(self._wake_r)
            else:
                self._advance(key.data)
        now = time.monotonic()
        for p in pending:
            if p.expires <= now and not p.gone:
                self._drop(p)  # idle, or its head did not arrive in time however often it sent a byte
        return True

    def _advance(self, p: _Pending) -> None:
        """Reads what `p` sent (after its TLS handshake); hands it over once its head is complete."""
        try:
            if not p.handshaken:
                cast(ssl.SSLSocket, p.sock).do_handshake()  # (not handshaken: a TLS connection)
                p.handshaken = True
            while True:
                data = p.sock.recv(1 << 16)
                if not data:
                    return self._drop(p)
                seen, p.head = len(p.head), p.head + data
                p.expires = min(p.deadline, time.monotonic() + p.idle_s)
                tail = p.head[max(0, seen - 3) :]  # where the head's end can be, not the whole head again
                if b"\r\n\r\n" in tail or b"\n\n" in tail:
                    return self._hand_over(p)
                if len(p.head) > _MAX_HEAD:
                    return self._drop(p)
        except ssl.SSLWantWriteError:
            self._want(p, selectors.EVENT_READ | selectors.EVENT_WRITE)
        except (ssl.SSLWantReadError, BlockingIOError):
            self._want(p, selectors.EVENT_READ)
        except OSError:  # reset, or a TLS handshake that failed (a plain client, another CA)
            self._drop(p)

    def _want(self, p: _Pending, events: int) -> None:
        if events != p.events:
            p.events = events
            self._selector.modify(p.sock, events, p)

    def _forget(self, p: _Pending) -> None:
        p.gone = True
        self._selector.unregister(p.sock)
        with self._lock:
            self._count -= 1

    def _drop(self, p: _Pending) -> None:
        self._forget(p)
        p.sock.close()

    def _hand_over(self, p: _Pending) -> None:
        self._forget(p)
        try:
            self._ready(p.sock, p.address, p.head)
        except Exception:  # (no thread could start): this connection only, never the reader
            p.sock.close()


def _drain(sock: socket.socket) -> None:
    try:
        while sock.recv(4096):
            pass
    except OSError:
        pass

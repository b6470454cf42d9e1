"""uvicorn's httptools protocol, bounded in what a client makes the front spend before its request is read.

httptools has no limit on a request's head and uvicorn no timeout for it: 1 GiB of header lines on one connection
took serve-repo from 80 MB to 1.3 GB (then the OOM killer, Triton with it), a 64 MiB header value fed a byte at a
time burned a core, and a half-sent request stayed open for minutes -- all before the token is checked (the
application sees a request only once its headers are complete). Here, on each of the front's three ports:
  - a request line and headers over MAX_HEAD_BYTES: 431, and the connection closed, before more is parsed;
  - a request head that is not complete HEAD_TIMEOUT_S after its first byte (or after the connection opened):
    408, closed;
  - a body from which no byte arrives for HEAD_TIMEOUT_S: the connection is closed (the application, reading it,
    sees the client gone). A request joins TorchServe's job queue only once its body is read (inference.py).
TorchServe's own front (Netty) refuses heads over 8 KB; this bound is looser, so no client of TorchServe is refused.
"""
from __future__ import annotations

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

MAX_HEAD_BYTES = 64 * 1024
HEAD_TIMEOUT_S = 10.0
_REASONS = {408: b"Request Timeout", 431: b"Request Header Fields Too Large"}


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._head_bytes = 0
        self._tail = b""  # the last 3 bytes of the head so far: its end may span two reads
        self._reading_head = True
        self._head_timer = self.loop.call_later(HEAD_TIMEOUT_S, self._head_timed_out)

    def data_received(self, data: bytes) -> None:
        if self._reading_head:
            if self._head_timer is None:  # the next request on a kept-alive connection: its first bytes
                self._head_timer = self.loop.call_later(HEAD_TIMEOUT_S, self._head_timed_out)
            seen = self._tail + data
            end = seen.find(b"\r\n\r\n")
            self._head_bytes += len(data) if end < 0 else max(0, end + 4 - len(self._tail))
            if self._head_bytes > MAX_HEAD_BYTES:
                self._refuse(431, f"the request line and headers exceed {MAX_HEAD_BYTES} bytes")
                return
            self._tail = seen[-3:]
        super().data_received(data)

    def on_headers_complete(self) -> None:
        self._reading_head = False
        self._cancel_head_timer()
        super().on_headers_complete()
        self._head_timer = self.loop.call_later(HEAD_TIMEOUT_S, self._body_stalled)  # re-armed by each body byte

    def on_body(self, body: bytes) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = self.loop.call_later(HEAD_TIMEOUT_S, self._body_stalled)
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._cancel_head_timer()
        super().on_message_complete()
        self._reading_head, self._head_bytes, self._tail = True, 0, b""  # the timer starts with the next bytes

    def connection_lost(self, exc) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._reading_head and not self.transport.is_closing():
            self._refuse(408, f"the request line and headers did not arrive within {HEAD_TIMEOUT_S:g} s")

    def _body_stalled(self) -> None:
        self._head_timer = None
        if not self._reading_head and not self.transport.is_closing():
            self.transport.close()

    def _refuse(self, status: int, why: str) -> None:
        """TorchServe's error body ({"code", "type", "message"}), then the connection is closed."""
        self._cancel_head_timer()
        self._reading_head = False
        body = ('{"code": %d, "type": "%s", "message": "%s"}'
                % (status, _REASONS[status].decode().replace(" ", ""), why)).encode()
        self.transport.write(b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                             b"connection: close\r\n\r\n%s" % (status, _REASONS[status], len(body), body))
        self.transport.close()

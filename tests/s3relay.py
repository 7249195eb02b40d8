"""A misbehaving S3 server for the mirror's tests: a small HTTP relay in front of a real one (tests/s3server.py).

Every request is passed to the real server and its answer passed back, except a GET of an object whose key ends
with one of the relay's ``targets``, which the relay answers as told (``mode``):

* ``"oversize"`` -- the object's bytes, then ``extra`` bytes of junk, with no Content-Length and the Range asked
  for ignored (the connection's end marks the body's): a server that answers a 4 KiB read with gigabytes;
* ``"drip"`` -- the object's real headers, then its body one byte every ``interval`` seconds;
* ``"error"`` -- a 403 whose S3 error message holds ``message`` (control characters, a terminal's escapes);
* ``"cut"`` -- the first ``cuts`` such GETs answered with their real headers and half their body, then the
  connection closed (a transfer cut off mid-way); later ones passed through. ``ranges`` records the Range of each.

``sent`` counts the body bytes the relay managed to write for those GETs before the client hung up: what a capped
reader let through.
"""

from __future__ import annotations

import http.client
import http.server
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host"}


class Relay(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(
        self,
        upstream: str,
        mode: str,
        targets: tuple[str, ...],
        *,
        extra: int = 0,
        interval: float = 0.2,
        message: str = "",
        cuts: int = 1,
    ):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.upstream = upstream.split("://", 1)[1]
        self.mode, self.targets, self.extra, self.interval, self.message = mode, targets, extra, interval, message
        self.sent = 0
        self.cuts = cuts
        self.ranges: list[str | None] = []
        self.endpoint = f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Relay

    def log_message(self, *args: Any) -> None:  # quiet
        pass

    def _forward(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else None
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
        conn = http.client.HTTPConnection(self.server.upstream, timeout=30)
        target = self.command == "GET" and self.path.split("?", 1)[0].endswith(self.server.targets)
        if target:
            self.server.ranges.append(self.headers.get("Range"))
        if target and self.server.mode != "cut":
            headers.pop("Range", None)
            headers.pop("range", None)
        conn.request(self.command, self.path, body=body, headers={**headers, "Host": self.server.upstream})
        resp = conn.getresponse()
        data = resp.read()
        conn.close()
        if target and resp.status < 300 and (self.server.mode != "cut" or self.server.cuts > 0):
            self._misbehave(resp, data)
            return
        self.send_response(resp.status)
        for k, v in resp.getheaders():
            if k.lower() not in _HOP:
                self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _misbehave(self, resp: http.client.HTTPResponse, data: bytes) -> None:
        relay = self.server
        if relay.mode == "error":
            body = (
                '<?xml version="1.0" encoding="UTF-8"?><Error><Code>AccessDenied</Code>'
                f"<Message>{relay.message}</Message></Error>"
            ).encode()
            self.send_response(403)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        if relay.mode == "cut":
            relay.cuts -= 1
            self.send_response(resp.status)
            for k, v in resp.getheaders():
                if k.lower() not in _HOP:
                    self.send_header(k, v)
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Connection", "close")
            self.end_headers()
            self.close_connection = True
            self.wfile.write(data[: len(data) // 2])
            relay.sent += len(data) // 2
            return
        self.send_response(200)
        for k, v in resp.getheaders():
            if k.lower() not in _HOP and k.lower() != "content-range":
                self.send_header(k, v)
        if relay.mode == "drip":
            self.send_header("Content-Length", str(len(data)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        try:
            if relay.mode == "oversize":
                for chunk in _chunks(data, relay.extra):
                    self.wfile.write(chunk)
                    relay.sent += len(chunk)
            else:
                for i in range(len(data)):
                    self.wfile.write(data[i : i + 1])
                    self.wfile.flush()
                    relay.sent += 1
                    time.sleep(relay.interval)
        except OSError:  # the client hung up: what a capped reader does
            pass

    do_GET = do_PUT = do_HEAD = do_DELETE = do_POST = _forward


def _chunks(data: bytes, extra: int) -> Iterator[bytes]:
    yield data
    junk = b"\0" * (1 << 16)
    while extra > 0:
        yield junk[: min(extra, len(junk))]
        extra -= len(junk)


@contextmanager
def relay(upstream: str, mode: str, targets: tuple[str, ...], **kw: Any) -> Iterator[Relay]:
    server = Relay(upstream, mode, targets, **kw)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()

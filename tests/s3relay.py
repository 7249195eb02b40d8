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

A relay given ``forged`` (:class:`Forged`: steps the real server does not hold) also lists, beside the real objects, one
or more objects in each of those steps (ListObjectsV2, paginated as S3 does, a continuation token per page), answers a
GET of one with its bytes and forgets one deleted: a listing of 100,000 steps costs the server nothing. ``pages``
counts the listing pages it answered, ``gets`` the GETs of forged objects, ``deleted`` the forged objects deleted.
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import http.client
import http.server
import threading
import time
import urllib.parse
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any
from xml.sax.saxutils import escape

_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host"}


@dataclasses.dataclass
class Forged:
    """Steps a relay lists that the real server does not hold: ``prefix/step_N/<name>`` for each N in ``steps`` and
    each ``objects`` name (its bytes), in ``bucket``."""

    bucket: str
    prefix: str
    steps: Iterable[int]
    objects: dict[str, bytes]
    most_gets: int | None = None  # GETs of forged objects answered; later ones are refused (403): a bounded test

    def keys(self) -> list[str]:
        return sorted(f"{self.prefix}/step_{n:09d}/{name}" for n in self.steps for name in self.objects)


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
        forged: Forged | None = None,
    ):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.upstream = upstream.split("://", 1)[1]
        self.mode, self.targets, self.extra, self.interval, self.message = mode, targets, extra, interval, message
        self.sent = 0
        self.cuts = cuts
        self.ranges: list[str | None] = []
        self.forged = forged
        self.forged_keys = forged.keys() if forged else []
        self.pages = self.gets = self.deleted = 0
        self.lock = threading.Lock()
        self.endpoint = f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Relay

    def log_message(self, *args: Any) -> None:  # quiet
        pass

    def _forward(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else None
        if self.server.forged is not None and self._forged(body):
            return
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

    # -- forged steps --------------------------------------------------------------------------------------------

    def _forged(self, body: bytes | None) -> bool:
        """Answers a request about the forged steps (True), or leaves it to the real server (False)."""
        relay, forged = self.server, self.server.forged
        assert forged is not None
        path, _, query = self.path.partition("?")
        params = dict(urllib.parse.parse_qsl(query, keep_blank_values=True))
        bucket, _, key = urllib.parse.unquote(path.lstrip("/")).partition("/")
        if bucket != forged.bucket:
            return False
        if not key and self.command == "GET" and params.get("list-type") == "2":
            self._list(params)
            return True
        if not key and self.command == "POST" and "delete" in params and body:
            gone = {e.text for e in ET.fromstring(body).iter() if e.tag.endswith("Key")}
            with relay.lock:
                before = len(relay.forged_keys)
                relay.forged_keys = [k for k in relay.forged_keys if k not in gone]
                relay.deleted += before - len(relay.forged_keys)
            return False  # the real server answers (a key it does not hold is deleted all the same)
        with relay.lock:
            i = bisect.bisect_left(relay.forged_keys, key)
            held = i < len(relay.forged_keys) and relay.forged_keys[i] == key
            if held and self.command == "DELETE":
                relay.forged_keys.pop(i)
                relay.deleted += 1
        if not held or self.command not in ("GET", "HEAD", "DELETE"):
            return False
        if self.command == "DELETE":
            self.send_response(204)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return True
        data = forged.objects[key.rsplit("/", 1)[1]]
        status, start, end = 200, 0, len(data)
        wanted = self.headers.get("Range")
        if wanted and wanted.startswith("bytes="):
            first, _, last = wanted[6:].partition("-")
            start, end, status = int(first), min(len(data), int(last) + 1 if last else len(data)), 206
        if self.command == "GET":
            relay.gets += 1
            if forged.most_gets is not None and relay.gets > forged.most_gets:
                refused = b"<Error><Code>AccessDenied</Code><Message>the relay's GETs are spent</Message></Error>"
                self.send_response(403)
                self.send_header("Content-Length", str(len(refused)))
                self.end_headers()
                self.wfile.write(refused)
                return True
        self.send_response(status)
        self.send_header("Content-Length", str(max(0, end - start)))
        self.send_header("ETag", f'"{hashlib.md5(data).hexdigest()}"')
        self.send_header("Last-Modified", "Thu, 01 Jan 2026 00:00:00 GMT")
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
        self.end_headers()
        if self.command == "GET":
            self.wfile.write(data[start:end])
        return True

    def _list(self, params: dict[str, str]) -> None:
        """One page of ListObjectsV2: the real server's objects and the forged ones, in S3's order."""
        relay = self.server
        assert relay.forged is not None
        prefix = params.get("prefix", "")
        after = params.get("continuation-token") or params.get("start-after") or ""
        if params.get("continuation-token"):
            after = urllib.parse.unquote(after)
        most = min(1000, int(params.get("max-keys") or 1000))
        real = sorted(o for o in self._real(prefix) if o[0] > after)
        with relay.lock:
            keys = relay.forged_keys
            i = bisect.bisect_right(keys, after)
            if prefix:
                i = max(i, bisect.bisect_left(keys, prefix))
            ours = [(k, len(relay.forged.objects[k.rsplit("/", 1)[1]])) for k in keys[i : i + most + 1]]
            ours = [o for o in ours if o[0].startswith(prefix)]
        page = sorted(real[: most + 1] + ours)[: most + 1]
        truncated = len(page) > most
        page = page[:most]
        contents = "".join(
            f"<Contents><Key>{escape(k)}</Key><LastModified>2026-01-01T00:00:00.000Z</LastModified>"
            f'<ETag>"0"</ETag><Size>{size}</Size><StorageClass>STANDARD</StorageClass></Contents>'
            for k, size in page
        )
        token = f"<NextContinuationToken>{urllib.parse.quote(page[-1][0])}</NextContinuationToken>" if truncated else ""
        doc = (
            '<?xml version="1.0" encoding="UTF-8"?><ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
            f"<Name>{relay.forged.bucket}</Name><Prefix>{escape(prefix)}</Prefix><KeyCount>{len(page)}</KeyCount>"
            f"<MaxKeys>{most}</MaxKeys><IsTruncated>{'true' if truncated else 'false'}</IsTruncated>{token}"
            f"{contents}</ListBucketResult>"
        ).encode()
        relay.pages += 1
        self.send_response(200)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(doc)))
        self.end_headers()
        self.wfile.write(doc)

    def _real(self, prefix: str) -> list[tuple[str, int]]:
        """The real server's objects under ``prefix`` (all its pages)."""
        relay = self.server
        assert relay.forged is not None
        out: list[tuple[str, int]] = []
        token = ""
        while True:
            query = {"list-type": "2", "prefix": prefix, **({"continuation-token": token} if token else {})}
            conn = http.client.HTTPConnection(relay.upstream, timeout=30)
            conn.request("GET", f"/{relay.forged.bucket}?{urllib.parse.urlencode(query)}", headers=self._signed())
            doc = ET.fromstring(conn.getresponse().read())
            conn.close()
            ns = "{http://s3.amazonaws.com/doc/2006-03-01/}"
            for c in doc.iter(f"{ns}Contents"):
                out.append((c.findtext(f"{ns}Key") or "", int(c.findtext(f"{ns}Size") or 0)))
            token = doc.findtext(f"{ns}NextContinuationToken") or ""
            if doc.findtext(f"{ns}IsTruncated") != "true" or not token:
                return out

    def _signed(self) -> dict[str, str]:
        """The client's authorization, passed on (moto does not check signatures against the URL)."""
        return {k: v for k, v in self.headers.items() if k.lower() in ("authorization", "x-amz-date")}

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

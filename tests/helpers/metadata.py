"""Emulated metadata services of AWS (IMDSv2), GCE and Azure (Scheduled Events), on 127.0.0.1 only.

Each is a small HTTP server that a test starts (``with MetadataService("aws") as service:``), points the run at
(:meth:`MetadataService.env`: the variable each platform's clients read), and tells when the machine goes
(:meth:`MetadataService.give_notice`). It answers as the platform documents, refuses a request without the header
the platform requires (AWS: the session token, asked for with a PUT first; GCE: ``Metadata-Flavor: Google``;
Azure: ``Metadata: true``), and keeps every request (:attr:`MetadataService.requests`). Bounded: at most
:data:`MAX_REQUESTS` requests, and a hanging GET (GCE's ``wait_for_change``) waits at most its ``timeout_sec`` and
never past :meth:`MetadataService.close`.
"""

from __future__ import annotations

import email.utils
import http.server
import json
import threading
import time
import urllib.parse
from dataclasses import dataclass
from typing import Any

MAX_REQUESTS = 10_000
MAX_HANG_S = 30.0
VM_NAME = "vm-under-test"


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    status: int


class MetadataService:
    """One platform's metadata service on 127.0.0.1 (see the module docstring)."""

    def __init__(self, platform: str, *, notice_in_s: float = 120.0) -> None:
        assert platform in ("aws", "gce", "azure"), platform
        self.platform = platform
        self.notice_in_s = notice_in_s  # the notice's deadline, from the moment it is given
        self.requests: list[Request] = []
        self.deadline: float | None = None  # set by give_notice
        self.version = 0  # GCE: the value's ETag
        self.tokens: set[str] = set()
        self._cond = threading.Condition()
        self._closed = False
        service = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def do_GET(self) -> None:
                service._handle(self, "GET")

            def do_PUT(self) -> None:
                service._handle(self, "PUT")

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, name="metadata-emulator", daemon=True)

    def __enter__(self) -> MetadataService:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self.server.shutdown()
        self.server.server_close()

    def env(self) -> dict[str, str]:
        """The variable that points the platform's clients (and preempt) at this service."""
        if self.platform == "aws":
            return {"AWS_EC2_METADATA_SERVICE_ENDPOINT": f"http://127.0.0.1:{self.port}/"}
        if self.platform == "gce":
            return {"GCE_METADATA_HOST": f"127.0.0.1:{self.port}"}
        return {"PREEMPT_AZURE_METADATA_ENDPOINT": f"http://127.0.0.1:{self.port}"}

    def give_notice(self) -> None:
        """The machine goes ``notice_in_s`` from now: every later answer says so (a hanging GET returns now)."""
        with self._cond:
            self.deadline = time.time() + self.notice_in_s
            self.version += 1
            self._cond.notify_all()

    def wait_requests(self, n: int, timeout: float = 60.0) -> bool:
        """Waits until ``n`` requests have come (False after ``timeout``)."""
        end = time.monotonic() + timeout
        with self._cond:
            while len(self.requests) < n:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    # ---- the answers

    def _handle(self, h: http.server.BaseHTTPRequestHandler, method: str) -> None:
        url = urllib.parse.urlsplit(h.path)
        query = dict(urllib.parse.parse_qsl(url.query))
        headers = {k: v for k, v in h.headers.items()}
        if h.headers.get("Content-Length"):
            h.rfile.read(int(h.headers["Content-Length"]))
        with self._cond:
            over = len(self.requests) >= MAX_REQUESTS
        status, body, extra = (429, b"too many requests", {}) if over else self._answer(method, url.path, query, h)
        with self._cond:
            self.requests.append(Request(method, url.path, query, headers, status))
            self._cond.notify_all()
        try:
            h.send_response(status)
            for k, v in extra.items():
                h.send_header(k, v)
            h.send_header("Content-Length", str(len(body)))
            h.end_headers()
            h.wfile.write(body)
        except OSError:  # the client hung up (a watcher closed while its GET hung): nothing to answer
            h.close_connection = True

    def _answer(
        self, method: str, path: str, query: dict[str, str], h: http.server.BaseHTTPRequestHandler
    ) -> tuple[int, bytes, dict[str, str]]:
        if self.platform == "aws":
            return self._aws(method, path, h)
        if self.platform == "gce":
            return self._gce(method, path, query, h)
        return self._azure(method, path, query, h)

    def _aws(self, method: str, path: str, h: Any) -> tuple[int, bytes, dict[str, str]]:
        if path == "/latest/api/token":
            if method != "PUT" or not h.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
                return 400, b"", {}
            token = f"token-{len(self.tokens)}"
            self.tokens.add(token)
            return 200, token.encode(), {}
        if path == "/latest/meta-data/spot/instance-action" and method == "GET":
            if h.headers.get("X-aws-ec2-metadata-token") not in self.tokens:
                return 401, b"", {}
            if self.deadline is None:
                return 404, b"Not Found", {}
            when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.deadline))
            return 200, json.dumps({"action": "terminate", "time": when}).encode(), {}
        return 404, b"", {}

    def _gce(self, method: str, path: str, query: dict[str, str], h: Any) -> tuple[int, bytes, dict[str, str]]:
        if h.headers.get("Metadata-Flavor") != "Google":
            return 403, b"Missing Metadata-Flavor:Google header.", {}
        google = {"Metadata-Flavor": "Google"}
        if path == "/computeMetadata/v1/instance/maintenance-event":
            return 200, b"NONE", google
        if path != "/computeMetadata/v1/instance/preempted":
            return 404, b"", google
        if query.get("wait_for_change") == "true":
            hang = min(float(query.get("timeout_sec", "60")), MAX_HANG_S)
            end = time.monotonic() + hang
            seen = query.get("last_etag")
            with self._cond:
                start = self.version
                while not self._closed:
                    current = f"etag-{self.version}"
                    if (seen is not None and seen != current) or (seen is None and self.version != start):
                        break
                    left = end - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
        with self._cond:
            value, etag = (b"TRUE" if self.deadline is not None else b"FALSE"), f"etag-{self.version}"
        return 200, value, {**google, "ETag": etag}

    def _azure(self, method: str, path: str, query: dict[str, str], h: Any) -> tuple[int, bytes, dict[str, str]]:
        if h.headers.get("Metadata") != "true":
            return 400, b'{"error": "Bad request. Required metadata header not specified"}', {}
        if path == "/metadata/instance/compute/name":
            return 200, VM_NAME.encode(), {}
        if path != "/metadata/scheduledevents" or "api-version" not in query:
            return 404, b"", {}
        events = []
        if self.deadline is not None:
            events.append(
                {
                    "EventId": "602d9444-d2cd-49c7-8624-8643e7171297",
                    "EventType": "Preempt",
                    "ResourceType": "VirtualMachine",
                    "Resources": [VM_NAME],
                    "EventStatus": "Scheduled",
                    "NotBefore": email.utils.formatdate(self.deadline, usegmt=True),
                    "Description": "",
                    "EventSource": "Platform",
                    "DurationInSeconds": -1,
                }
            )
            # another VM's event of the same scale set, which is not this one's notice
        events.append(
            {
                "EventId": "11111111-0000-0000-0000-000000000000",
                "EventType": "Reboot",
                "ResourceType": "VirtualMachine",
                "Resources": ["another-vm"],
                "EventStatus": "Scheduled",
                "NotBefore": email.utils.formatdate(time.time() + 600, usegmt=True),
            }
        )
        return 200, json.dumps({"DocumentIncarnation": self.version + 1, "Events": events}).encode(), {}

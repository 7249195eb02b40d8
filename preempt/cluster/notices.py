"""Advance notices from the cloud: the machine is about to be taken away, before any signal comes.

Off unless asked for (``notices="aws" | "gce" | "azure"``, or ``PREEMPT_NOTICES``): nothing is ever probed by
default. When asked, :class:`Watcher` polls the platform's metadata service from a named daemon thread and calls
``on_notice`` once, with a :class:`Notice`, the first time the service says the machine goes; the run then stops at
its next step exactly as on SIGTERM (:mod:`preempt.run.stopping`). What each platform answers, and how it is read
(each reading a pure function of the answer, :func:`parse_aws`, :func:`parse_gce_preempted`,
:func:`parse_gce_maintenance`, :func:`parse_azure`):

* **AWS** (IMDSv2): a session token first (``PUT /latest/api/token`` with
  ``X-aws-ec2-metadata-token-ttl-seconds``), then ``GET /latest/meta-data/spot/instance-action`` with
  ``X-aws-ec2-metadata-token``: 404 until a spot interruption is scheduled, then ``{"action": "terminate" | "stop" |
  "hibernate", "time": "2026-12-01T12:02:00Z"}``, the time about two minutes ahead. A 401 is an expired token:
  a new one is asked for. Endpoint: ``AWS_EC2_METADATA_SERVICE_ENDPOINT`` (as botocore reads it).
* **GCE**: ``GET /computeMetadata/v1/instance/preempted`` with ``Metadata-Flavor: Google``, as a hanging GET
  (``wait_for_change=true`` with the last ``ETag``: it answers as soon as the value changes), ``TRUE`` once the
  spot or preemptible VM is preempted; the VM is stopped about 30 s later (:data:`GCE_PREEMPT_S`). Each time that
  answer comes back, ``instance/maintenance-event``: ``TERMINATE_ON_HOST_MAINTENANCE`` is a stop (a live migration,
  ``MIGRATE_ON_HOST_MAINTENANCE``, is not). Endpoint: ``GCE_METADATA_HOST`` (host[:port], as google-auth reads it).
* **Azure** (Scheduled Events): ``GET /metadata/scheduledevents?api-version=2020-07-01`` with ``Metadata: true``:
  an event of type ``Preempt`` (spot eviction, at least 30 s ahead), ``Terminate``, ``Reboot`` or ``Redeploy`` whose
  ``Resources`` name this VM (``/metadata/instance/compute/name``, read once) is a stop, due at its ``NotBefore``.
  ``Freeze`` (a pause of seconds) is not. Events are never acknowledged: that would shorten the warning. Endpoint:
  ``PREEMPT_AZURE_METADATA_ENDPOINT``.

A service that does not answer (not on that cloud, a firewall, IMDSv2 hop limit) is one warning, then quiet retries
every :attr:`Watcher.retry_s`; the loop never waits for the thread. An error that is not the service's (a bug) is
kept and raised again by :meth:`Watcher.close`.

Knows nothing of torch; the standard library's ``http.client`` only.
"""

from __future__ import annotations

import calendar
import dataclasses
import email.utils
import enum
import http.client
import json
import logging
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable

log = logging.getLogger("preempt")

GCE_PREEMPT_S = 30.0
"""Seconds from GCE's preemption notice to the VM's stop (Google documents 30 s for spot and preemptible VMs)."""
AWS_TOKEN_TTL_S = 21600  # IMDSv2's longest session token
AZURE_STOPS = ("Preempt", "Terminate", "Reboot", "Redeploy")  # event types after which this VM's processes are gone


class Platform(str, enum.Enum):
    AWS = "aws"
    GCE = "gce"
    AZURE = "azure"
    RAY = "ray"  # a Ray node's draining, read from Ray's GCS (preempt.cluster.ray_notice)


DEFAULT_ENDPOINTS = {  # the metadata services' (not Ray's)
    Platform.AWS: "http://169.254.169.254",
    Platform.GCE: "http://metadata.google.internal",
    Platform.AZURE: "http://169.254.169.254",
}
VARIABLES = {
    Platform.AWS: "AWS_EC2_METADATA_SERVICE_ENDPOINT",
    Platform.GCE: "GCE_METADATA_HOST",
    Platform.AZURE: "PREEMPT_AZURE_METADATA_ENDPOINT",
}


class NoticeError(ValueError):
    """A metadata service's answer that cannot be read: what was expected and what came."""


@dataclasses.dataclass(frozen=True)
class Notice:
    """The platform said the machine goes.

    Attributes:
        platform: Whose notice.
        what: What it said, in its own words (``"spot instance-action: terminate"``).
        deadline: When the machine goes (unix seconds), when the notice says; None: not said.
        seen_at: When the watcher read it (unix seconds).
    """

    platform: Platform
    what: str
    deadline: float | None
    seen_at: float

    @property
    def cause(self) -> str:
        """The stop's cause, for the history and ``preempt report``: ``"aws notice: spot instance-action: ..."``."""
        return f"{self.platform.value} notice: {self.what}"

    def left(self, now: float) -> float | None:
        """Seconds from ``now`` to the deadline (None: unknown)."""
        return None if self.deadline is None else self.deadline - now

    def fields(self) -> dict[str, object]:
        """The notice as a history marker's fields."""
        return {
            "platform": self.platform.value,
            "what": self.what,
            "deadline": None if self.deadline is None else round(self.deadline, 3),
            "seen_at": round(self.seen_at, 3),
        }


# ---------------------------------------------------------------- the answers, read (pure)


def _iso_utc(text: str) -> float:
    """``2026-12-01T12:02:00Z`` (AWS's time of an instance-action) as unix seconds."""
    for fmt in ("%Y-%m-%dT%H:%M:%SZ", "%Y-%m-%dT%H:%M:%S.%fZ"):
        try:
            return float(calendar.timegm(time.strptime(text, fmt)))
        except ValueError:
            continue
    raise NoticeError(f"expected a time such as 2026-12-01T12:02:00Z, found {text!r}")


def _json(body: bytes, what: str) -> object:
    try:
        return json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise NoticeError(f"{what}: expected JSON, found {body[:200]!r}") from None


def parse_aws(status: int, body: bytes, now: float) -> Notice | None:
    """AWS's ``spot/instance-action`` answer: None (404, nothing scheduled) or the notice.

    Raises:
        NoticeError: Another status, or a body that is not the documented JSON.
    """
    if status == 404:
        return None
    if status != 200:
        raise NoticeError(f"spot/instance-action: expected status 200 or 404, found {status}")
    doc = _json(body, "spot/instance-action")
    if not isinstance(doc, dict) or not isinstance(doc.get("action"), str) or not isinstance(doc.get("time"), str):
        raise NoticeError(f"spot/instance-action: expected {{'action': ..., 'time': ...}}, found {body[:200]!r}")
    return Notice(Platform.AWS, f"spot instance-action: {doc['action'][:40]}", _iso_utc(doc["time"]), now)


def parse_gce_preempted(status: int, body: bytes, now: float) -> Notice | None:
    """GCE's ``instance/preempted``: ``TRUE`` is the notice (the VM stops :data:`GCE_PREEMPT_S` later).

    Raises:
        NoticeError: Another status, or a value other than TRUE/FALSE.
    """
    if status != 200:
        raise NoticeError(f"instance/preempted: expected status 200, found {status}")
    value = body.strip().upper()
    if value == b"FALSE":
        return None
    if value == b"TRUE":
        return Notice(Platform.GCE, "instance preempted", now + GCE_PREEMPT_S, now)
    raise NoticeError(f"instance/preempted: expected TRUE or FALSE, found {body[:100]!r}")


def parse_gce_maintenance(status: int, body: bytes, now: float) -> Notice | None:
    """GCE's ``instance/maintenance-event``: ``TERMINATE_ON_HOST_MAINTENANCE`` is a notice (its time is not said);
    ``NONE`` and a live migration are not.

    Raises:
        NoticeError: Another status.
    """
    if status != 200:
        raise NoticeError(f"instance/maintenance-event: expected status 200, found {status}")
    value = body.strip().decode("ascii", "replace")
    if value.startswith("TERMINATE"):
        return Notice(Platform.GCE, f"maintenance-event: {value[:60]}", None, now)
    return None


def _azure_time(text: object) -> float | None:
    """``NotBefore``: ``Mon, 19 Sep 2016 18:29:47 GMT``; empty once the event has started (None)."""
    if not isinstance(text, str) or not text.strip():
        return None
    try:
        return email.utils.parsedate_to_datetime(text).timestamp()
    except (TypeError, ValueError):
        raise NoticeError(
            f"scheduledevents: NotBefore: expected a date such as 'Mon, 19 Sep 2016 18:29:47 GMT', found {text!r}"
        ) from None


def parse_azure(status: int, body: bytes, now: float, vm_name: str | None) -> Notice | None:
    """Azure's scheduled events: the earliest event of :data:`AZURE_STOPS` for this VM (``vm_name``; None: any VM,
    when the name could not be read), or None.

    Raises:
        NoticeError: Another status than 200, or not the documented JSON.
    """
    if status != 200:
        raise NoticeError(f"scheduledevents: expected status 200, found {status}")
    doc = _json(body, "scheduledevents")
    events = doc.get("Events") if isinstance(doc, dict) else None
    if not isinstance(events, list):
        raise NoticeError(f"scheduledevents: expected {{'Events': [...]}}, found {body[:200]!r}")
    found: list[Notice] = []
    for event in events:
        if not isinstance(event, dict) or event.get("EventType") not in AZURE_STOPS:
            continue
        if event.get("EventStatus", "Scheduled") not in ("Scheduled", "Started"):
            continue
        resources = event.get("Resources")
        if vm_name is not None and isinstance(resources, list) and resources and vm_name not in resources:
            continue  # another VM of this availability set or scale set
        deadline = _azure_time(event.get("NotBefore"))
        found.append(Notice(Platform.AZURE, f"scheduled event {event['EventType']}", deadline, now))
    if not found:
        return None
    return min(found, key=lambda n: n.deadline if n.deadline is not None else -1.0)  # started (no time) first


def endpoint(platform: Platform, given: str | None) -> tuple[str, int, str]:
    """``(host, port, path prefix)`` of the platform's service: ``given`` (a URL; for GCE a host[:port]) or the
    platform's own address.

    Raises:
        ValueError: ``given`` is not an http:// address.
    """
    url = given if given is not None else DEFAULT_ENDPOINTS[platform]
    if platform is Platform.GCE and given is not None and "://" not in given:
        url = f"http://{given}"
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"{VARIABLES[platform]}={given!r}: expected an http:// address of the metadata service")
    return parts.hostname, parts.port or 80, parts.path.rstrip("/")


# ---------------------------------------------------------------- the thread


class Watcher:
    """Polls one platform's metadata service until it gives notice, or until :meth:`close`.

    Args:
        platform: Which service.
        address: ``(host, port, path prefix)`` (:func:`endpoint`).
        on_notice: Called once, from the thread, with the first notice.
        every_s: Seconds between polls (AWS, Azure; GCE's hanging GET answers at once on a change).
        timeout_s: Seconds a connection or an ordinary answer may take.
        hang_s: Seconds GCE's hanging GET waits for a change (``timeout_sec``).
        clock: Wall-clock seconds (a notice's times are the platform's, in unix seconds).
        on_trouble: Called once, from the thread, with the service's first failure (after its warning).
    """

    retry_s = 5.0

    def __init__(
        self,
        platform: Platform,
        address: tuple[str, int, str],
        on_notice: Callable[[Notice], None],
        *,
        every_s: float = 1.0,
        timeout_s: float = 2.0,
        hang_s: int = 10,
        clock: Callable[[], float] = time.time,
        on_trouble: Callable[[str], None] | None = None,
    ) -> None:
        self.platform = platform
        self.on_trouble = on_trouble
        self.host, self.port, self.prefix = address
        self.on_notice = on_notice
        self.every_s, self.timeout_s, self.hang_s = every_s, timeout_s, hang_s
        self.clock = clock
        self.notice: Notice | None = None
        self.requests = 0  # answered or not
        self.error: BaseException | None = None  # not the service's: raised again by close()
        self.trouble: str | None = None  # the service's latest failure, said once
        self._said = False
        self._stop = threading.Event()
        self._conn: http.client.HTTPConnection | None = None
        self._lock = threading.Lock()
        self._token: str | None = None  # AWS's session token
        self._etag: str | None = None  # GCE: the value's version the hanging GET waits past
        self._vm_name: str | None = None  # Azure: this VM's name
        self._named = False
        self._thread = threading.Thread(target=self._run, name=f"preempt-notices-{platform.value}", daemon=True)

    @property
    def where(self) -> str:
        return f"http://{self.host}:{self.port}{self.prefix}"

    def start(self) -> Watcher:
        self._thread.start()
        return self

    def close(self, timeout: float = 5.0) -> None:
        """Stops the thread (a hanging GET is cut off) and raises the error it kept, if any."""
        self._stop.set()
        with self._lock:
            conn = self._conn
        if conn is not None and conn.sock is not None:
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._thread.is_alive():
            self._thread.join(timeout)
        if self.error is not None:
            error, self.error = self.error, None
            raise error

    # ---- the loop

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    notice = self._poll()
                except (OSError, http.client.HTTPException, NoticeError) as e:
                    if self._stop.is_set():
                        return
                    self._failed(e)
                    self._stop.wait(self.retry_s)
                    continue
                self._answered()
                if notice is not None:
                    self.notice = notice
                    self.on_notice(notice)
                    return
                if self.platform is not Platform.GCE or self._etag is None:  # GCE's hanging GET paces itself
                    self._stop.wait(self.every_s)
        except BaseException as e:  # a bug, not the service: kept for close()
            self.error = e
        finally:
            self._disconnect()

    def _failed(self, e: BaseException) -> None:
        self._disconnect()
        self._token = None
        self.trouble = f"{type(e).__name__}: {e}"
        if not self._said:
            self._said = True
            log.warning(
                "notices=%s: the metadata service at %s does not answer as expected (%s): no advance notice can stop"
                " this run until it does (retried every %s; a signal still stops it). Off this cloud, leave"
                " notices unset",
                self.platform.value,
                self.where,
                self.trouble,
                f"{self.retry_s:g} s",
            )
            if self.on_trouble is not None:
                self.on_trouble(self.trouble)

    def _answered(self) -> None:
        if self.trouble is not None:
            log.info("notices=%s: the metadata service at %s answers again", self.platform.value, self.where)
            self.trouble = None

    def _poll(self) -> Notice | None:
        if self.platform is Platform.AWS:
            return self._poll_aws()
        if self.platform is Platform.GCE:
            return self._poll_gce()
        return self._poll_azure()

    def _poll_aws(self) -> Notice | None:
        if self._token is None:
            status, body, _ = self._request(
                "PUT", "/latest/api/token", {"X-aws-ec2-metadata-token-ttl-seconds": str(AWS_TOKEN_TTL_S)}
            )
            if status != 200 or not body.strip():
                raise NoticeError(f"/latest/api/token: expected status 200 and a token, found status {status}")
            self._token = body.strip().decode("ascii", "replace")
        status, body, _ = self._request(
            "GET", "/latest/meta-data/spot/instance-action", {"X-aws-ec2-metadata-token": self._token}
        )
        if status == 401:  # the token expired: a new one at the next poll
            self._token = None
            return None
        return parse_aws(status, body, self.clock())

    def _poll_gce(self) -> Notice | None:
        google = {"Metadata-Flavor": "Google"}
        status, body, _ = self._request("GET", "/computeMetadata/v1/instance/maintenance-event", google)
        notice = parse_gce_maintenance(status, body, self.clock())
        if notice is not None:
            return notice
        path = "/computeMetadata/v1/instance/preempted"
        if self._etag is None:  # the value now, and its version: the hanging GETs wait past it
            status, body, headers = self._request("GET", path, google)
        else:
            query = f"?wait_for_change=true&timeout_sec={self.hang_s}&last_etag={urllib.parse.quote(self._etag)}"
            status, body, headers = self._request("GET", path + query, google, timeout=self.hang_s + self.timeout_s)
        self._etag = headers.get("etag", self._etag)
        return parse_gce_preempted(status, body, self.clock())

    def _poll_azure(self) -> Notice | None:
        azure = {"Metadata": "true"}
        if not self._named:
            status, body, _ = self._request(
                "GET", "/metadata/instance/compute/name?api-version=2021-02-01&format=text", azure
            )
            self._named = True
            name = body.strip().decode("utf-8", "replace")
            self._vm_name = name if status == 200 and name else None
        status, body, _ = self._request("GET", "/metadata/scheduledevents?api-version=2020-07-01", azure)
        return parse_azure(status, body, self.clock(), self._vm_name)

    def _request(
        self, method: str, path: str, headers: dict[str, str], timeout: float | None = None
    ) -> tuple[int, bytes, dict[str, str]]:
        """One request on the kept connection (made again when the service closed it)."""
        with self._lock:
            if self._stop.is_set():
                raise OSError("closed")
            if self._conn is None:
                self._conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
            conn = self._conn
        self.requests += 1
        conn.timeout = timeout if timeout is not None else self.timeout_s
        if conn.sock is not None:
            conn.sock.settimeout(conn.timeout)
        conn.request(method, self.prefix + path, headers=headers)
        response = conn.getresponse()
        body = response.read(1 << 16)
        if response.will_close or not response.isclosed():  # (an answer longer than read: not reused)
            self._disconnect()
        return response.status, body, {k.lower(): v for k, v in response.getheaders()}  # names: any case

    def _disconnect(self) -> None:
        with self._lock:
            conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

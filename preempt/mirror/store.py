"""One place in object storage that mirrors a save_dir: the only module that imports fsspec.

A mirror is a URL prefix (``s3://bucket/runs/a``, or any fsspec URL: ``gs://``, ``az://``, ``file://``). Its layout
is the save_dir's, flattened into object names::

    <prefix>/step_000000120/model.safetensors    the data objects of a checkpoint
    <prefix>/step_000000120/manifest.json        written last: a step is complete when its manifest is there and
                                                 every file the manifest lists is there with its size
    <prefix>/train.log, <prefix>/history.jsonl   the run's records, replaced after each upload

:class:`MirrorStore` is a thin face over one fsspec filesystem: list, read (capped), put a file, get a file, copy
server-side, delete. It knows nothing of manifests or of the order of uploads (:mod:`preempt.mirror.plan`,
:mod:`preempt.mirror.uploader`, :mod:`preempt.mirror.pull`). Every failure is a
:class:`~preempt.errors.MirrorError` naming the URL without its credentials (:attr:`MirrorStore.display`) and the
operation; option values are never printed.

fsspec (and s3fs for ``s3://``) is imported when a store is made, never by ``import preempt``: the extra
``pip install 'preempt-torch[mirror]'``.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import time
import urllib.parse
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import xxhash

from .. import _secrets
from .._secrets import userinfo
from ..checkpoint.hashed_io import FileDigest
from ..checkpoint.names import checkpoint_name, parse_checkpoint_name
from ..checkpoint.safe_io import printable
from ..errors import MirrorError
from . import backoff

log = logging.getLogger("preempt")

# Our own option, taken out of ``mirror_options`` before the rest goes to fsspec: create a missing bucket
# (the tests do; a production bucket is made by its owner, with its policies).
CREATE_BUCKET = "create_bucket"
# s3 defaults, each overridable through ``mirror_options`` (``config_kwargs`` goes to botocore's Config): an
# unreachable or stopped server fails an operation in seconds, not in minutes (botocore's defaults are 60 s per read,
# s3fs retries 5 times on top); the uploader retries with its own backoff, and a stop waits its deadline at most.
S3_CONFIG = {"connect_timeout": 3, "read_timeout": 10, "retries": {"max_attempts": 2, "mode": "standard"}}
S3_RETRIES = 2  # s3fs's own retry loop around each call (S3FileSystem.retries: a class attribute, not an argument)
# Our own option too: every operation of an async client (s3fs, gcsfs, adlfs) is cancelled after this many seconds,
# plus one second per MIN_RATE bytes it moves. The client's read timeout does not cover everything: a PUT sent with
# "Expect: 100-continue" (botocore adds it to every upload) waits for the server's "100" with no timeout in aiohttp,
# forever when the server is stopped or the network black-holes the connection.
OP_TIMEOUT = "op_timeout"
DEFAULT_OP_TIMEOUT = 20.0
MAX_KEYS = 1 << 20  # objects a listing of the prefix may hold
LIST_PAGE = 1000  # objects asked for in each page of a listing (S3's most)
LIST_PAGE_SECONDS = 5.0  # a listing's budget grows by this much a page (each page has op_timeout of its own)
DELETE_BATCH = 1000  # objects deleted by one request (S3's DeleteObjects takes at most 1000)
MIN_RATE = 1 << 20  # bytes per second: a slower transfer is taken for a hung one
DOWNLOAD_CHUNK = 1 << 20  # bytes asked of a download's stream at a time (it hands what has arrived, up to this)
RESUMES = 4  # times a download cut off mid-way is taken up again from where it stopped (as s3fs's get retries)
MAX_TEXT_BYTES = 256 << 20  # a run record read back (history.jsonl of a very long run)
_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}", re.ASCII)  # an object name inside a step, or a record


def redact(url: str) -> str:
    """``url`` without its userinfo (``user:secret@``, a secret with ``/`` in it too) and without its query (a SAS
    token, a signature)."""
    secret = userinfo(url)
    if secret:
        url = url.replace(secret + "@", "", 1)
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        return "<a mirror URL that does not parse>"
    host = parts.netloc.rpartition("@")[2]
    return urllib.parse.urlunsplit((parts.scheme, host, parts.path, "", ""))


def hold_secrets(url: str, options: Mapping[str, Any] | None) -> None:
    """The secrets a mirror is reached with kept out of everything this process records and prints
    (:mod:`preempt._secrets`): the URL's credentials, the values of ``options`` under secret-like keys, and the AWS
    variables the client reads (``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ...), as botocore reads them."""
    _secrets.hold(_secrets.of_mirror(url, options))
    _secrets.hold(_secrets.of_environ(os.environ))


def check_name(name: str) -> str:
    """``name`` if it is one plain object name (no slash, no ``..``); ValueError otherwise."""
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name) or ".." in name:
        raise ValueError(f"mirror object name {name!r} is not a plain name (letters, digits, '_', '.', '-')")
    return name


class MirrorStore:
    """One fsspec filesystem at one URL prefix.

    Args:
        url: The prefix, e.g. ``s3://bucket/runs/a``. Credentials and endpoints come the ecosystem's way: the
            AWS environment variables (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ...) and profiles work with no
            code; ``options`` are fsspec storage options.
        options: Passed to ``fsspec.url_to_fs`` (e.g. ``{"endpoint_url": ..., "key": ..., "secret": ...}``,
            ``{"config_kwargs": {"read_timeout": 30}}``), less our own key ``create_bucket`` (default False: a
            missing bucket is an error).

    Raises:
        MirrorError: fsspec (or the protocol's client) is not installed, or the URL is not one it knows.
    """

    def __init__(self, url: str, options: Mapping[str, Any] | None = None) -> None:
        if not isinstance(url, str) or "://" not in url:
            raise ValueError(f"mirror: expected a URL such as 's3://bucket/prefix', found {redact(str(url))!r}")
        self.url = url
        self.display = redact(url)
        hold_secrets(url, options)
        self.clock = time.monotonic  # what a transfer's pace is measured by (a test's own clock too)
        self.sleep = time.sleep  # the pause before a cut-off download is taken up again
        opts = dict(options or {})
        self.create_bucket = bool(opts.pop(CREATE_BUCKET, False))
        self.op_timeout = float(opts.pop(OP_TIMEOUT, DEFAULT_OP_TIMEOUT))
        if not self.op_timeout > 0:
            raise ValueError(f"mirror_options[{OP_TIMEOUT!r}]: expected a number of seconds > 0")
        self._secrets = [str(v) for v in _leaves(opts) if isinstance(v, str) and len(v) >= 4]
        self.protocol = url.split("://", 1)[0].lower()
        try:
            import fsspec  # the optional extra: imported only when a mirror is used
        except ImportError:
            raise MirrorError(
                f"mirror {self.display}: fsspec is not installed; pip install 'preempt-torch[mirror]'"
            ) from None
        if self.protocol in ("s3", "s3a"):
            config = {**S3_CONFIG, **dict(opts.get("config_kwargs") or {})}
            opts = {**opts, "config_kwargs": config}
            opts.setdefault("skip_instance_cache", True)  # our timeouts and options, not a cached instance's
            opts.setdefault("use_listings_cache", False)  # a listing is always the server's
        elif self.protocol in ("file", "local"):
            opts.setdefault("auto_mkdir", True)
        try:
            self.fs, root = fsspec.url_to_fs(url, **opts)
        except ImportError as e:
            raise MirrorError(
                f"mirror {self.display}: the client for {self.protocol}:// is not installed ({self._scrub(e)});"
                " pip install 'preempt-torch[mirror]' (s3fs), or the fsspec package of that protocol"
            ) from None
        except Exception as e:
            raise MirrorError(f"mirror {self.display}: cannot be opened: {self._describe(e)}") from None
        if self.protocol in ("s3", "s3a"):
            _check_s3fs(self.fs, self.display)
            self.fs.retries = S3_RETRIES
        self.root = root.rstrip("/")
        self._async = bool(getattr(self.fs, "async_impl", False))

    def __repr__(self) -> str:
        return f"MirrorStore({self.display!r})"

    # -- paths -------------------------------------------------------------------------------------------------

    def key(self, step: int | None, name: str) -> str:
        """The object's path for fsspec: ``<root>/step_N/<name>``, or ``<root>/<name>`` for a run record."""
        check_name(name)
        return f"{self.root}/{name}" if step is None else f"{self.root}/{checkpoint_name(step)}/{name}"

    def where(self, step: int | None, name: str = "") -> str:
        """The object as people read it: the redacted URL, the step directory and the name."""
        parts = [self.display.rstrip("/")]
        if step is not None:
            parts.append(checkpoint_name(step))
        if name:
            parts.append(name)
        return "/".join(parts)

    # -- operations --------------------------------------------------------------------------------------------

    def check(self) -> None:
        """Makes sure the mirror can be used: its bucket exists (created when ``create_bucket``), it answers.

        Raises:
            MirrorError: Unreachable, refused, or the bucket is missing (and not to be created).
        """
        if self.protocol not in ("s3", "s3a"):
            with self._op("open", None):
                if not self.fs.exists(self.root):
                    self.fs.makedirs(self.root, exist_ok=True)
            return
        bucket = self.root.split("/", 1)[0]
        try:
            with self._op("open the bucket of", None):
                self.fs.call_s3("head_bucket", Bucket=bucket, **self._limit())
        except MirrorError as e:
            if e.errno != errno.ENOENT:
                raise
            if not self.create_bucket:
                missing = MirrorError(
                    f"mirror {self.display}: the bucket {bucket!r} does not exist; create it (or pass"
                    f" mirror_options={{'{CREATE_BUCKET}': True}} to have preempt create it)"
                )
                missing.errno = errno.ENOENT
                raise missing from None
            with self._op("create the bucket of", None):
                self.fs.mkdir(bucket, **self._limit())

    def steps(self) -> dict[int, dict[str, int]]:
        """Every ``step_N`` "directory" under the prefix: ``{step: {object name: size in bytes}}``.

        One listing of the prefix (paginated by the client). Objects deeper than one level, or with other names,
        are ignored.
        """
        found = self._list_s3() if self.protocol in ("s3", "s3a") and self._async else self._find()
        out: dict[int, dict[str, int]] = {}
        prefix = self.root + "/"
        for path, info in found.items():
            if not path.startswith(prefix) or info.get("type", "file") != "file":
                continue
            parts = path[len(prefix) :].split("/")
            if len(parts) != 2 or not _NAME_RE.fullmatch(parts[1]):
                continue
            step = parse_checkpoint_name(parts[0])
            if step is not None:
                out.setdefault(step, {})[parts[1]] = int(info.get("size") or 0)
        return out

    def _find(self) -> dict[str, Any]:
        with self._op("list", None):
            found: dict[str, Any] = self.fs.find(self.root, detail=True, **self._limit())
        return found

    def _list_s3(self) -> dict[str, Any]:
        """The prefix listed page by page: each page with the time of one operation, the listing as a whole
        :meth:`list_budget` of the pages it has so far (a listing of many pages that all answer is never "no
        answer"; one whose pages all crawl in just under their time ends), and at most :data:`MAX_KEYS` objects (a
        bucket's count is not ours to pay for without end)."""
        bucket, _, prefix = self.root.partition("/")
        found: dict[str, Any] = {}
        token: str | None = None
        start, pages = self.clock(), 0
        while True:
            page: dict[str, Any] = {"Bucket": bucket, "Prefix": f"{prefix}/" if prefix else "", "MaxKeys": LIST_PAGE}
            if token:
                page["ContinuationToken"] = token
            spent = self.clock() - start
            left = self.list_budget(pages + 1) - spent
            if left <= 0:
                raise MirrorError(
                    f"mirror {self.display}: listing not finished after {pages} pages ({len(found)} objects) in"
                    f" {spent:.0f} s, its budget ({self.op_timeout:g} s and {LIST_PAGE_SECONDS:g} s a page:"
                    f" mirror_options[{OP_TIMEOUT!r}])"
                )
            with self._op(f"list (page {pages + 1} of)", None):
                got = self.fs.call_s3("list_objects_v2", **page, timeout=min(self.op_timeout, left))
            pages += 1
            for obj in got.get("Contents") or ():
                found[f"{bucket}/{obj['Key']}"] = {"size": obj.get("Size", 0), "type": "file"}
            if len(found) > MAX_KEYS:
                raise MirrorError(
                    f"mirror {self.display}: more than {MAX_KEYS} objects under the prefix; a run's mirror holds far"
                    " fewer (give the run a prefix of its own)"
                )
            token = got.get("NextContinuationToken")
            if not got.get("IsTruncated") or not token:
                log.debug("mirror %s: listed %d objects in %d pages, %.2f s", self.display, len(found), pages, spent)
                return found

    def list_budget(self, pages: int) -> float:
        """Seconds a listing of ``pages`` pages may take in all: one operation's time, and LIST_PAGE_SECONDS a page."""
        return self.op_timeout + pages * LIST_PAGE_SECONDS

    def read(self, step: int | None, name: str, limit: int) -> bytes:
        """The bytes of one object, at most ``limit`` (more is an error, read no further than ``limit + 1``)."""
        with self._op("read", self.where(step, name)):
            data = self._cat(self.key(step, name), 0, limit + 1)
        if len(data) > limit:
            raise MirrorError(f"mirror {self.where(step, name)}: larger than {limit} bytes, the most accepted")
        return bytes(data)

    def read_range(self, step: int, name: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of one object (one ranged GET, bounded like every operation)."""
        with self._op(f"read bytes {start}-{end} of", self.where(step, name)):
            return self._cat(self.key(step, name), start, end)

    def _cat(self, key: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of an object. From S3, streamed and capped (:meth:`_stream`)."""
        if not self._streams:
            return bytes(self.fs.cat_file(key, start=start, end=end, **self._limit(end - start)))
        out = bytearray()
        self._stream(key, start, end, out.extend, 1 << 16)
        return bytes(out)

    @property
    def _streams(self) -> bool:
        """Whether objects are read here, chunk by chunk (an async S3 client), rather than by the client's calls."""
        return self.protocol in ("s3", "s3a") and self._async

    def _stream(self, key: str, start: int, end: int, sink: Callable[[bytes], object], chunk: int) -> None:
        """Hands ``sink`` the bytes ``[start, end)`` of an S3 object as they arrive, capped: a server that ignores
        the Range or sends more than asked is cut off after ``end - start`` bytes (with no Content-Length, a client
        that reads the whole answer would take all it sends), and one slower than MIN_RATE after op_timeout
        (:class:`Paced`). An empty object, or one shorter than ``start``, hands nothing."""
        from fsspec.asyn import sync

        bucket, _, name = key.partition("/")
        paced = Paced(end - start, self.op_timeout, self.clock)

        async def stream() -> None:
            try:
                got = await self.fs._call_s3("get_object", Bucket=bucket, Key=name, Range=f"bytes={start}-{end - 1}")
            except OSError as e:
                if "range is not satisfiable" in str(e).lower() or "InvalidRange" in str(e):
                    return
                raise
            body = got["Body"]
            try:
                while data := await body.read(chunk):
                    paced.relative_update(len(data))
                    sink(data)
            finally:
                body.close()

        sync(self.fs.loop, stream, **self._limit(end - start))

    def put(self, local_path: str | Path, step: int, name: str) -> int:
        """Uploads a local file (multipart and parallel where the client does it, s3fs above 50 MiB); its size."""
        size = Path(local_path).stat().st_size
        with self._op("upload", self.where(step, name)):
            self.fs.put_file(str(local_path), self.key(step, name), **self._limit(size))
        return size

    def put_bytes(self, step: int | None, name: str, data: bytes) -> int:
        """Writes one small object (a manifest, a run record) whole; its size."""
        with self._op("write", self.where(step, name)):
            self.fs.pipe_file(self.key(step, name), bytes(data), **self._limit(len(data)))
        return len(data)

    def get(self, step: int, name: str, local_path: str | Path, size: int = 0) -> FileDigest | None:
        """Downloads one object (of about ``size`` bytes) into a new local file; the caller checks its size and
        digest: a transfer cut off mid-way leaves a short or wrong file, never a trusted one.

        From S3 the object is streamed here, capped at ``size`` bytes (:meth:`_stream`), and hashed as it is
        written: the size and xxh3 of what was written are returned, and the file is not read again. Other
        clients write the file themselves (ranged and parallel where they do it), and None is returned."""
        with self._op("download", self.where(step, name)):
            if self._streams and size:
                digest, written = xxhash.xxh3_128(), 0
                with open(local_path, "wb") as f:

                    def sink(data: bytes) -> None:
                        nonlocal written
                        f.write(data)
                        digest.update(data)
                        written += len(data)

                    for attempt in range(RESUMES + 1):  # a transfer cut off mid-way goes on from where it stopped
                        try:
                            self._stream(self.key(step, name), written, size, sink, DOWNLOAD_CHUNK)
                            break
                        except _cut_off() as e:
                            if attempt == RESUMES or written >= size:
                                raise
                            log.debug("%s: cut off after %d bytes (%s); going on", self.where(step, name), written, e)
                            self.sleep(backoff.delay(attempt + 1, 0.1, 2.0))
                return FileDigest(written, digest.hexdigest())
            paced = Paced(size, self.op_timeout, self.clock) if size else None
            self.fs.get_file(self.key(step, name), str(local_path), **self._limit(size), **_callback(paced))
            return None

    def copy(self, src_step: int, name: str, dst_step: int, size: int = 0) -> None:
        """Server-side copy of ``step_src/name`` to ``step_dst/name``: no byte goes through this machine."""
        with self._op(f"copy {self.where(src_step, name)} to", self.where(dst_step, name)):
            self.fs.copy(self.key(src_step, name), self.key(dst_step, name), **self._limit(size // 8))

    def delete(self, step: int, name: str) -> None:
        """Deletes one object; one already gone is fine."""
        with self._op("delete", self.where(step, name)), contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self.key(step, name), **self._limit())

    def delete_step(self, step: int) -> None:
        """Deletes every object of one step; the manifest first, so that the step never looks complete meanwhile."""
        from ..checkpoint.names import MANIFEST

        self.delete(step, MANIFEST)
        path = f"{self.root}/{checkpoint_name(step)}"
        with self._op("delete", self.where(step)), contextlib.suppress(FileNotFoundError):
            self.fs.rm(path, recursive=True, **self._limit())

    def delete_steps(self, listing: Mapping[int, Mapping[str, int]]) -> None:
        """Deletes the objects ``listing`` names (step: object names), every manifest first (no step ever looks
        complete meanwhile); from S3 up to DELETE_BATCH objects a request, so that a thousand steps of debris cost
        two requests, not thousands. Objects already gone are fine."""
        from ..checkpoint.names import MANIFEST

        if not self._streams:
            for step in listing:
                self.delete_step(step)
            return
        first = [self.key(s, MANIFEST) for s, objects in sorted(listing.items()) if MANIFEST in objects]
        rest = [self.key(s, n) for s, objects in sorted(listing.items()) for n in sorted(objects) if n != MANIFEST]
        bucket = self.root.split("/", 1)[0]
        for keys in (first, rest):
            for i in range(0, len(keys), DELETE_BATCH):
                batch = [{"Key": k.split("/", 1)[1]} for k in keys[i : i + DELETE_BATCH]]
                with self._op(f"delete {len(batch)} objects of", None):
                    got = self.fs.call_s3(
                        "delete_objects", Bucket=bucket, Delete={"Objects": batch, "Quiet": True}, **self._limit()
                    )
                failed = [e for e in got.get("Errors") or () if e.get("Code") != "NoSuchKey"]
                if failed:
                    e = failed[0]
                    raise MirrorError(
                        f"mirror: cannot delete {len(failed)} of {len(batch)} objects of {self.display}, such as"
                        f" {printable(str(e.get('Key')))!r}: {printable(str(e.get('Code')))}"
                        f" {self._scrub(RuntimeError(e.get('Message') or ''))}"
                    )

    def put_text(self, name: str, data: bytes) -> int:
        """Replaces a run record (``train.log``, ``history.jsonl``) at the prefix's root."""
        return self.put_bytes(None, name, data)

    def read_text(self, name: str, limit: int = MAX_TEXT_BYTES) -> bytes | None:
        """A run record's bytes, or None when there is none."""
        try:
            return self.read(None, name, limit)
        except MirrorError as e:
            if e.errno == errno.ENOENT:
                return None
            raise

    def _limit(self, nbytes: int = 0) -> dict[str, float]:
        """The ``timeout`` of one operation of an async client (fsspec's ``sync`` cancels it after that), none for
        a blocking one (a local or mounted filesystem)."""
        return {"timeout": self.op_timeout + nbytes / MIN_RATE} if self._async else {}

    # -- errors ------------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _op(self, what: str, where: str | None) -> Iterator[None]:
        """Turns the client's errors into one MirrorError naming the operation and the (redacted) object."""
        try:
            yield
        except MirrorError:
            raise
        except Exception as e:  # (fsspec's FSTimeoutError too: the operation was cancelled after its timeout)
            target = where or self.display
            err = MirrorError(f"mirror: cannot {what} {target}: {self._describe(e)}")
            err.errno = errno.ENOENT if isinstance(e, FileNotFoundError) else getattr(e, "errno", None) or errno.EIO
            raise err from None

    def _describe(self, error: BaseException) -> str:
        return f"{type(error).__name__}: {self._scrub(error)}"

    def _scrub(self, error: BaseException) -> str:
        """The error's text with the URL's userinfo and any option value taken out: credentials never go to a log."""
        text = str(error) or type(error).__name__
        if not str(error) and "Timeout" in type(error).__name__:
            text = f"no answer within {self.op_timeout:g} s (mirror_options[{OP_TIMEOUT!r}], more for large objects)"
        credentials = userinfo(self.url)
        # the whole userinfo, and each part a client may quote apart (a secret's '/' splits it into bucket and key)
        parts = [p for p in re.split(r"[:/@]", credentials) if len(p) >= 4]
        for secret in sorted({*self._secrets, credentials, *parts}, key=len, reverse=True):
            if secret:
                text = text.replace(secret, "***")
        # a server's words: no control character reaches a log or a terminal
        return printable(_secrets.scrub(text)[:2000])


class Paced:
    """A transfer's guard, told of each chunk (an fsspec callback's ``relative_update``): more than ``cap`` bytes, or
    slower than MIN_RATE once ``grace`` seconds have passed (measured on what arrived, never on what a listing or a
    manifest declares), ends it with a MirrorError. A drip of one byte a second is cut off after ``grace``."""

    def __init__(self, cap: int, grace: float, clock: Any = time.monotonic) -> None:
        self.cap, self.grace, self.clock = cap, grace, clock
        self.start, self.total = clock(), 0

    def relative_update(self, inc: int = 1) -> None:
        self.total += inc
        if self.total > self.cap:
            raise MirrorError(f"the server sent more than the {self.cap} bytes asked for")
        elapsed = self.clock() - self.start
        if elapsed > self.grace + self.total / MIN_RATE:
            raise MirrorError(
                f"{self.total} bytes in {elapsed:.1f} s: slower than {MIN_RATE >> 20} MiB/s after {self.grace:g} s"
                f" (mirror_options[{OP_TIMEOUT!r}])"
            )

    def set_size(self, size: Any) -> None:
        """(s3fs tells a download's Content-Length; the cap is ours, not the server's)"""


# ------------------------------------------------------------------------------------------- s3fs's private parts
# s3fs promises nothing about these, and they are read here alone: each is checked when an s3:// store is made
# (a MirrorError naming what is missing, before any transfer), and tests/unit/test_mirror_privates.py checks them
# against the installed s3fs. Checked on s3fs 2026.9.0.
S3FS_PRIVATE = (
    # one botocore call with s3fs's retries: a ranged GET whose body is streamed here and capped (s3fs's own reads
    # take the whole answer, however much a hostile server sends)
    "S3FileSystem._call_s3",
    # the errors of a transfer cut off mid-way, which a download takes up again where it stopped
    "s3fs.core.S3_RETRYABLE_ERRORS",
    # s3fs's retry loop around each call: a class attribute, not an argument
    "S3FileSystem.retries",
)


def s3fs_missing(fs: Any) -> list[str]:
    """The names of :data:`S3FS_PRIVATE` that this s3fs (``fs`` one of its filesystems) lacks, or has in another
    shape."""
    import inspect

    import s3fs.core

    missing = []
    if not inspect.iscoroutinefunction(getattr(fs, "_call_s3", None)):
        missing.append(S3FS_PRIVATE[0])
    retryable = getattr(s3fs.core, "S3_RETRYABLE_ERRORS", None)
    if not isinstance(retryable, tuple) or not all(isinstance(e, type) for e in retryable):
        missing.append(S3FS_PRIVATE[1])
    if not isinstance(getattr(type(fs), "retries", None), int):
        missing.append(S3FS_PRIVATE[2])
    return missing


def _check_s3fs(fs: Any, display: str) -> None:
    missing = s3fs_missing(fs)
    if missing:
        import s3fs

        raise MirrorError(
            f"mirror {display}: s3fs {getattr(s3fs, '__version__', '?')} lacks {', '.join(missing)}, which the mirror"
            " reads (checked on s3fs 2026.9.0); install another s3fs release"
        )


def _cut_off() -> tuple[type[BaseException], ...]:
    """The errors of a transfer cut off mid-way (s3fs's retryable ones, less the timeouts: a transfer out of time
    is not taken up again)."""
    from s3fs.core import S3_RETRYABLE_ERRORS

    return tuple(e for e in S3_RETRYABLE_ERRORS if not issubclass(e, TimeoutError))


def _callback(paced: Paced | None) -> dict[str, Any]:
    return {} if paced is None else {"callback": paced}


def _leaves(value: Any) -> Iterator[Any]:
    """Every scalar inside nested mappings and sequences (the option values to keep out of messages)."""
    if isinstance(value, Mapping):
        for v in value.values():
            yield from _leaves(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _leaves(v)
    else:
        yield value

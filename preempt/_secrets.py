"""What must never be printed or recorded: the credentials in a URL, and secrets on a command line.

* :func:`userinfo` -- the ``user:secret`` of a URL. A secret may hold a ``/`` (about half of AWS secret keys do),
  where ``urllib.parse.urlsplit`` ends the host: the userinfo runs to the last ``@`` before the query when what
  comes before that ``@`` holds a ``:`` (or no ``/``).
* :func:`scrub_argv` -- a command line as a manifest records it (``provenance.argv``), with secrets replaced by
  ``***``. The rule: (1) a URL's userinfo; (2) the value of an option whose name says it holds a secret (``secret``,
  ``password``, ``passwd``, ``token``, ``credential``, a name ending in ``key`` such as ``--api-key``, and the
  mirror's options ``--mirror-option``/``--mirror_options``), given as ``--name VALUE`` or ``--name=VALUE``; (3) the
  value of a ``NAME=VALUE`` argument whose NAME says the same (``aws_secret_access_key=...``, ``secret=...``);
  (4) every secret the process holds (below), by value, wherever it is in an argument (inside a JSON document such
  as ``--options '{"secret": "..."}'``, a URL's query, a longer word).
* The secrets a process holds: what it was handed to reach its mirror (:func:`of_mirror`: the credentials of the
  URL and each part of them, the values of ``mirror_options`` under a secret-like key at any depth; :func:`of_environ`:
  the AWS (and Azure storage) variables whose names say they hold a secret). :func:`hold` keeps them for the life of the
  process; :func:`scrub` replaces each in a text by ``***`` (as written, JSON-escaped and URL-quoted), and so does a
  filter :func:`hold` puts on the ``preempt`` logger: no log line, record, manifest or error message holds one.
  Values shorter than MIN_LENGTH characters are not held (they would blank unrelated words).
"""

from __future__ import annotations

import json
import logging
import re
import threading
import urllib.parse
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

HIDDEN = "***"
MIN_LENGTH = 6
_SECRET_NAME = re.compile(
    r"secret|passw(or)?d|token|credential|(^|[_.-])(api[_.-]?)?key$|(access|private)[_.-]?key|mirror[_-]options?$",
    re.IGNORECASE,
)


def userinfo(url: str) -> str:
    """The credentials in ``url`` (``user:secret``), or "" (see the module docstring)."""
    _, sep, rest = url.partition("://")
    if not sep:
        return ""
    head = rest.split("?", 1)[0].split("#", 1)[0]
    before, at, _ = head.rpartition("@")
    if at and (":" in before or "/" not in before):
        return before
    return ""


def secret_name(name: str) -> bool:
    """Whether an option or variable named ``name`` (dashes and case aside) holds a secret by the module's rule."""
    return bool(_SECRET_NAME.search(name.lstrip("-")))


def scrub_argv(argv: Sequence[str]) -> list[str]:
    """``argv`` with every secret replaced by ``***`` (the module's rule, the secrets held included)."""
    return [scrub(arg) for arg in _by_name(argv)]


def _by_name(argv: Sequence[str]) -> list[str]:
    """``argv`` with the secrets the rule finds by their names and in URLs replaced."""
    out: list[str] = []
    hide_next = False
    for arg in argv:
        if hide_next:
            out.append(HIDDEN)
            hide_next = False
            continue
        name, eq, value = arg.partition("=")
        if arg.startswith("-") and secret_name(name):
            if eq:
                out.append(f"{name}={HIDDEN}")
            else:
                out.append(arg)
                hide_next = True
            continue
        if eq and not arg.startswith("-") and "://" not in name and secret_name(name):
            out.append(f"{name}={HIDDEN}")
            continue
        found = userinfo(arg) if "://" in arg else ""
        out.append(arg.replace(found + "@", f"{HIDDEN}@", 1) if found else arg)
    return out


# ----------------------------------------------------------------------------------------- the secrets held

_held: set[str] = set()
_forms: list[str] = []  # every held secret in each form it may be written, longest first
_lock = threading.Lock()


def of_mirror(url: str | None, options: Mapping[str, Any] | None) -> list[str]:
    """The secrets a mirror is reached with: the URL's userinfo and each part of it (a client quotes a secret's
    ``/`` apart), and the values under secret-like keys of ``options`` (``key``, ``secret``, ``token``; any depth)."""
    out: list[str] = []
    credentials = userinfo(url) if isinstance(url, str) else ""
    if credentials:
        out += [credentials, *re.split(r"[:/@]", credentials)]
    if isinstance(options, Mapping):
        out += list(_under_secret_keys(options, False))
    return out


CLOUD_PREFIXES = ("AWS_", "AZURE_STORAGE_")  # the variables an object store's client reads its credentials from


def of_environ(environ: Mapping[str, str]) -> list[str]:
    """The values of the object stores' variables whose names say they hold a secret (``AWS_SECRET_ACCESS_KEY``,
    ``AWS_SESSION_TOKEN``, ``AWS_ACCESS_KEY_ID``, ``AZURE_STORAGE_SAS_TOKEN``, ...); not every variable named like a
    secret (``TOKENIZERS_PARALLELISM=enabled`` is none)."""
    return [v for k, v in environ.items() if k.upper().startswith(CLOUD_PREFIXES) and secret_name(k)]


def _under_secret_keys(value: Any, secret: bool) -> Iterator[str]:
    if isinstance(value, Mapping):
        for k, v in value.items():
            yield from _under_secret_keys(v, secret or secret_name(str(k)))
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _under_secret_keys(v, secret)
    elif secret and isinstance(value, (str, bytes)):
        yield value.decode("utf-8", "replace") if isinstance(value, bytes) else value


def hold(values: Iterable[str]) -> None:
    """Keeps ``values`` as secrets of this process (see the module docstring); the logger's filter is put on once."""
    new = {v for v in values if isinstance(v, str) and len(v) >= MIN_LENGTH} - _held
    if not new:
        return
    with _lock:
        _held.update(new)
        forms = {f for v in _held for f in _written(v)}
        _forms[:] = sorted(forms, key=len, reverse=True)
        logger = logging.getLogger("preempt")
        if not any(isinstance(f, _Scrubbing) for f in logger.filters):
            logger.addFilter(_Scrubbing())


def _written(secret: str) -> set[str]:
    """The ways ``secret`` may appear in a text: as is, inside a JSON string, URL-quoted."""
    escaped = json.dumps(secret)[1:-1]
    return {
        secret,
        escaped,
        escaped.replace("/", "\\/"),
        urllib.parse.quote(secret, safe=""),
        urllib.parse.quote_plus(secret),
    }


def held() -> frozenset[str]:
    """The secrets this process holds."""
    return frozenset(_held)


def scrub(text: str) -> str:
    """``text`` with every secret held (in each of its forms) replaced by ``***``."""
    for form in _forms:
        if form in text:
            text = text.replace(form, HIDDEN)
    return text


class _Scrubbing(logging.Filter):
    """The ``preempt`` logger's filter: a record's message (and its traceback) without the secrets held."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not _forms:
            return True
        message = record.getMessage()
        clean = scrub(message)
        if clean != message:
            record.msg, record.args = clean, None
        if record.exc_info and not record.exc_text:
            record.exc_text = scrub(logging.Formatter().formatException(record.exc_info))
        elif record.exc_text:
            record.exc_text = scrub(record.exc_text)
        return True

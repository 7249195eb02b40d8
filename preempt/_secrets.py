"""What must never be printed or recorded: the credentials in a URL, and secrets on a command line.

* :func:`userinfo` -- the ``user:secret`` of a URL. A secret may hold a ``/`` (about half of AWS secret keys do),
  where ``urllib.parse.urlsplit`` ends the host: the userinfo runs to the last ``@`` before the query when what
  comes before that ``@`` holds a ``:`` (or no ``/``).
* :func:`scrub_argv` -- a command line as a manifest records it (``provenance.argv``), with secrets replaced by
  ``***``. The rule: (1) a URL's userinfo; (2) the value of an option whose name says it holds a secret (``secret``,
  ``password``, ``passwd``, ``token``, ``credential``, a name ending in ``key`` such as ``--api-key``, and the
  mirror's options ``--mirror-option``/``--mirror_options``), given as ``--name VALUE`` or ``--name=VALUE``; (3) the
  value of a ``NAME=VALUE`` argument whose NAME says the same (``aws_secret_access_key=...``, ``secret=...``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

HIDDEN = "***"
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
    """``argv`` with every secret replaced by ``***`` (the module's rule)."""
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

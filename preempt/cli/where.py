"""What a command's DIR names: a local save_dir (a :class:`~pathlib.Path`) or the URL of a run's mirror in object
storage (:class:`Url`, ``s3://bucket/prefix``, any ``scheme://``); and the ``--mirror-option KEY=VALUE`` pairs.

Imported by the parser (:mod:`preempt.cli.main`): nothing heavy here, and no fsspec (the mirror's client is imported
by :mod:`preempt.mirror.store` when a command opens a mirror).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")  # RFC 3986's scheme, then "//": what fsspec takes for a URL


class Url(str):
    """A mirror's URL given where a save_dir is expected (kept as typed: ``Path`` would fold its ``//``)."""


def place(text: str) -> Path | Url:
    """argparse type of DIR: a URL when it starts with ``scheme://``, else a local path, exactly as before."""
    return Url(text) if _SCHEME.match(text) else Path(text)


def is_url(value: object) -> bool:
    return isinstance(value, Url)


def mirror_options(pairs: list[str] | None) -> dict[str, Any]:
    """The fsspec storage options of ``--mirror-option KEY=VALUE`` (repeatable): a VALUE that parses as JSON
    (``true``, ``3``, ``{"region_name": "eu-west-1"}``) is that value, any other VALUE the string itself.

    Raises:
        argparse.ArgumentTypeError: A pair without ``=`` or with an empty key. The text is never repeated in the
            message: it may hold a credential.
    """
    out: dict[str, Any] = {}
    for i, pair in enumerate(pairs or [], 1):
        key, eq, value = pair.partition("=")
        key = key.strip()
        if not eq or not key:
            raise argparse.ArgumentTypeError(
                f"--mirror-option #{i}: expected KEY=VALUE (the text is not shown: it may hold a credential)"
            )
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    return out


def add_pull_parser(sub: Any, fmt: Any, epilog: str) -> None:
    """The ``pull`` subcommand, on cli.build_parser's subparsers."""
    help = "fetch a checkpoint from a run's mirror into a save_dir (verified as it arrives)"
    p = sub.add_parser(
        "pull",
        help=help,
        description=help,
        formatter_class=fmt,
        epilog="The newest complete checkpoint (or --step N) is downloaded into DIR as a save writes one: into a\n"
        "temporary directory, each object checked against the manifest's size and xxh3-128 before it is kept,\n"
        "the manifest last, then renamed into place; a damaged object or a cut transfer leaves nothing. DIR is\n"
        "created when missing, and locked meanwhile (exit 3 while a run holds it). A run started on DIR\n"
        f"resumes from what was pulled.\n\n{epilog}",
    )
    p.add_argument("dir", type=place, metavar="URL", help="the mirror: s3://bucket/prefix (any fsspec URL)")
    p.add_argument("save_dir", type=Path, metavar="DIR", help="the save_dir to pull into")
    p.add_argument("--step", type=int, default=None, metavar="N", help="this step (default: the newest complete)")
    p.add_argument("--json", action="store_true", help="one machine-readable JSON document on stdout")
    add_mirror_option(p)


def add_mirror_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--mirror-option",
        action="append",
        metavar="KEY=VALUE",
        help="an fsspec storage option for a mirror's URL (repeatable), e.g. endpoint_url=http://host:9000;"
        " a VALUE that parses as JSON is that value (true, 30, {...}). Credentials come from the AWS environment"
        " variables and profiles without it. Values are never printed",
    )

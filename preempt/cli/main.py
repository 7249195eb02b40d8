"""The ``preempt`` command line: ``supervise`` a training command; list, verify, inspect, prune and export
checkpoints; ``report`` a run's timeline and goodput (:mod:`preempt.cli.report`).

``preempt supervise [OPTIONS] -- CMD...`` reruns CMD after preemption, non-finite losses and out-of-memory
errors (:mod:`preempt.supervise.command`, which has its own options and exit codes).

What each checkpoint command reads, writes and refuses (nothing is ever
unpickled) is said in :mod:`preempt.cli.checkpoints`.

This module imports no torch: ``supervise`` and every ``--help`` start in well
under a second. The checkpoint commands are in :mod:`preempt.cli.checkpoints`,
imported when one of them runs.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from .._version import __version__
from ..checkpoint import safe_io  # no torch
from ..supervise import command as supervise
from . import check, report, where
from .output import EXIT_CODES, EXIT_DAMAGED, EXIT_LOCKED, EXIT_OK, EXIT_USAGE, CommandFailed, emit

__all__ = ["EXIT_CODES", "EXIT_DAMAGED", "EXIT_LOCKED", "EXIT_OK", "EXIT_USAGE", "build_parser", "main"]

_DEFAULT_TENSOR_ROWS = 20


def _selector(text: str) -> int | str:
    """argparse type of STEP: a step number, ``latest`` or ``best``."""
    if text in ("latest", "best"):
        return text
    try:
        return _count(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected a step number, 'latest' or 'best', found {text!r}") from None


# --------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
        prog="preempt",
        description="Look inside a preempt save_dir: list, verify, inspect, prune and export checkpoints;\n"
        "or supervise a training command: rerun it after preemption, NaN losses and out-of-memory errors.",
        epilog=EXIT_CODES + '\n\nEvery command takes --json: one JSON document on stdout, {"error", "exit_code"} on'
        ' failure;\nstrict JSON: a non-finite number is the string "nan", "inf" or "-inf". Messages go to stderr.\n'
        "DIR may also name one checkpoint (DIR/step_000000120).\n"
        "ls, verify, inspect and report also take a run's mirror in object storage: URL (s3://bucket/prefix, any\n"
        "fsspec URL) in place of DIR; preempt pull URL DIR fetches a checkpoint from it into a save_dir.\n"
        "preempt supervise has its own options and exit codes: preempt supervise --help",
        formatter_class=fmt,
    )
    parser.add_argument("--version", action="version", version=f"preempt {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    step_help = "a step number, 'latest' (newest valid) or 'best' (best by the metric the manifests record)"

    # Defined once, in preempt.supervise.command, and only listed here: main() hands `supervise ...` to supervise.main
    # before this parser runs, since supervise splits its arguments at "--" itself (CMD's options are not ours).
    supervise.build_parser(commands=sub)
    check.build_parser(commands=sub)  # likewise: main() hands `check ...` to check.main (COMMAND follows "--")

    def add(name: str, help: str, epilog: str, mirror: bool = False) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help, epilog=f"{epilog}\n\n{EXIT_CODES}", formatter_class=fmt)
        dir_help = (
            "the save_dir, or its mirror's URL (s3://bucket/prefix, any fsspec URL)" if mirror else "the save_dir"
        )
        p.add_argument("dir", type=where.place, metavar="DIR", help=dir_help)
        p.add_argument("--json", action="store_true", help="one machine-readable JSON document on stdout")
        if mirror:
            where.add_mirror_option(p)
        return p

    add(
        "ls",
        "one row per checkpoint: step, epoch, batch, time, size, reason, status",
        "status: valid (the manifest parses, passes its checksum and names the directory's step, and every file it\n"
        "lists is there with its size), corrupt, incomplete (no manifest.json), or unreadable. Marks: latest (newest\n"
        "valid), best, complete (named by complete.json). Files are not hashed: a changed byte shows only in verify.\n"
        "ls exits 0 whatever the statuses. On a mirror's URL: complete steps are valid; incomplete names the\n"
        "objects missing (an upload not finished or cut off); corrupt: a manifest that does not parse, an object\n"
        "of another size.",
        mirror=True,
    ).add_argument(
        "--all",
        action="store_true",
        help="on a mirror's URL: every step (default: the newest 20, the only manifests read); a save_dir: always all",
    )
    p = add(
        "verify",
        "re-hash every file of every checkpoint (or of STEP) against its manifest",
        "Each damaged file is named with both full xxh3-128 digests (manifest's and file's),\n"
        "both sizes, or 'missing'. Exit 1 when any checkpoint checked is damaged, corrupt or incomplete.\n"
        "On a mirror's URL each object is downloaded into a temporary directory, checked and deleted.",
        mirror=True,
    )
    p.add_argument("step", type=_selector, nargs="?", metavar="STEP", help=f"only this checkpoint: {step_help}")
    p = add(
        "inspect",
        "show one checkpoint: manifest, tensors, optimizer, RNG, provenance",
        "Reads manifest.json, state.json and the safetensors headers only (no tensor data, no pickle).\n"
        "Exit 1 when the manifest, a header or state.json is corrupt. On a mirror's URL: the same, from a\n"
        "temporary copy of those parts (ranged reads of the objects).",
        mirror=True,
    )
    p.add_argument("step", type=_selector, nargs="?", metavar="STEP", help=f"{step_help}; default latest")
    p.add_argument(
        "--tensors",
        default=str(_DEFAULT_TENSOR_ROWS),
        metavar="N|all",
        type=lambda s: s if s == "all" else str(_count(s)),
        help=f"tensor rows shown per file (default {_DEFAULT_TENSOR_ROWS}; 'all'; --json always lists all)",
    )
    p = add(
        "prune",
        "delete valid checkpoints that retention does not keep (dry run without --yes)",
        "Only valid checkpoints are candidates. Never touched: quarantine/, superseded/, corrupt and incomplete\n"
        "checkpoints, the newest valid checkpoint and the one complete.json names. Also kept by default: what the\n"
        "run itself keeps, as the newest valid manifest records it (its keep_best best checkpoints, its\n"
        "keep_every_steps milestones); --keep-best K and --keep-every-steps N replace the run's values (0: none).\n"
        "A manifest written by an older preempt records nothing: then only the options apply. The dry run says\n"
        "why each checkpoint is kept. With --yes, takes the save_dir's lock (exit 3 while a run holds it),\n"
        "re-hashes the kept checkpoints (exit 1 and nothing deleted if one is damaged), then deletes.",
    )
    p.add_argument(
        "--keep-last",
        type=lambda s: _count(s, 1),
        required=True,
        metavar="N",
        help="keep the newest N valid checkpoints",
    )
    p.add_argument(
        "--keep-best",
        type=_best_count,
        nargs="?",
        const=1,
        default=None,
        metavar="K",
        help="also keep the K best (1 when K is left out) by the metric and mode their manifests record;"
        " 0 keeps none of them. Default: the run's keep_best, as its newest valid manifest records it",
    )
    p.add_argument(
        "--keep-every-steps",
        type=_count,
        default=None,
        metavar="N",
        help="also keep the checkpoints whose step is a multiple of N (milestones); 0 keeps none of them."
        " Default: the run's keep_every_steps, as its newest valid manifest records it",
    )
    p.add_argument("--yes", action="store_true", help="delete (without it, only print what would be deleted)")
    p = add(
        "export",
        "write a checkpoint's model weights as a plain safetensors file",
        "Verifies model.safetensors against the manifest first (exit 1, nothing written, when damaged).\n"
        "The output loads with safetensors.torch.load_file; its metadata has format=pt and the source.\n"
        "Written atomically (temporary file beside --out, fsync, rename).",
    )
    p.add_argument("step", type=_selector, nargs="?", metavar="STEP", help=f"{step_help}; default latest")
    p.add_argument("--out", type=Path, required=True, help="the .safetensors file to write")
    p.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    p = add(
        "prefetch",
        "read the newest valid checkpoint into memory ahead of a restart (no torch)",
        "For a job script: `preempt prefetch DIR &` before `python train.py`: the restore then reads from memory\n"
        "what this read while the training process started (importing torch alone takes seconds). Reads what\n"
        "the manifest lists, nothing else; changes nothing. Exit 0 also when DIR holds no valid checkpoint.",
    )
    p.add_argument(
        "--no-wait",
        action="store_true",
        help="only ask the kernel to read the files (posix_fadvise WILLNEED) and return at once",
    )
    report.add_parser(functools.partial(add, mirror=True))
    where.add_pull_parser(sub, fmt, EXIT_CODES)
    return parser


def _count(text: str, least: int = 0) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= {least}, found {text!r}") from None
    if n < least:
        raise argparse.ArgumentTypeError(f"expected an integer >= {least}, found {n}")
    return n


def _best_count(text: str) -> int:
    try:
        return _count(text)
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"{e} (put DIR before --keep-best, or write --keep-best=K)") from None


def main(argv: Sequence[str] | None = None) -> int:
    """Runs one command; returns its exit code (argparse exits 2 itself on bad usage)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["supervise"]:
        return supervise.main(argv[1:])
    if argv[:1] == ["check"]:
        return check.main(argv[1:])
    args = build_parser().parse_args(argv)
    if where.is_url(args.dir) or args.command == "pull":
        from . import remote  # the mirror's client (fsspec) is imported when the mirror is opened

        command = remote.run
    elif args.command == "report":
        command = report.cmd_report
    else:
        from . import checkpoints  # no torch: headers and JSON are read without it

        command = checkpoints.run

    # What a save_dir holds is printed through escaping streams: a planted name or reason cannot drive the terminal.
    out, err = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = safe_io.TerminalText(out), safe_io.TerminalText(err)
    try:
        return command(args)
    except CommandFailed as e:
        if args.json:
            emit({"error": str(e), "exit_code": e.code})
        print(f"preempt {args.command}: {e}", file=sys.stderr)
        return e.code
    except BrokenPipeError:  # `preempt ls DIR | head`: the reader left; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    finally:
        sys.stdout, sys.stderr = out, err


if __name__ == "__main__":
    sys.exit(main())

"""The checkpoint commands of the ``preempt`` command line: ls, verify, inspect, prune, export.

The parser and ``main`` are in :mod:`preempt.cli.main`, which imports this module
(and with it torch) only when one of these commands runs, so that ``preempt
supervise`` and ``--help`` start fast; the exit codes, the failure and the JSON
output both share are in :mod:`preempt.cli.output`. ``inspect`` is in
:mod:`preempt.cli.inspection`.

``ls``, ``verify`` and ``inspect`` only read; ``prune --yes`` deletes (under the
save_dir's lock, so never beside a running training); ``export`` writes only
its ``--out`` file. Every command takes ``--json``; errors go to stderr and
name the path, what was expected and what was found.

Nothing here unpickles or executes anything from the checkpoint: manifests and
``state.json`` are JSON, and tensor files are read through their safetensors
header, a length-prefixed JSON document validated against the file's size.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from .. import _log
from ..checkpoint import commit, deleter, hashed_io, names, safe_io
from ..checkpoint.files import read_verified
from ..checkpoint.hashed_io import FileDigest
from ..checkpoint.lock import DirLock, LockedError
from ..checkpoint.manager import CheckpointInfo, CheckpointManager, newest_files, rank_best
from ..checkpoint.retention import Kept, RetentionPolicy, select_kept
from ..errors import CheckpointUnreadableError, CorruptCheckpointError
from . import listing
from .output import EXIT_DAMAGED, EXIT_LOCKED, EXIT_OK, EXIT_UNREADABLE, EXIT_USAGE, CommandFailed, emit
from .views import (
    checkpoint_size,
    completion,
    fmt_table,
    moved_aside,
    recycled,
    resolve,
    sizes_checked,
)

LS_CHECKED_TEXT = (
    "status checked: each manifest (parsed, its own checksum, its step) and that every file it lists is there with"
    " its size; the data is not hashed: preempt verify DIR hashes every file"
)

# ----------------------------------------------------------------------- ls


def _place(save_dir: Path) -> listing.Place:
    return listing.Place(str(save_dir), checkpoint_size, LS_CHECKED_TEXT)


def cmd_ls(args: argparse.Namespace) -> int:
    save_dir: Path = args.dir
    manager = CheckpointManager(save_dir, owner=False)
    infos = [sizes_checked(c) for c in manager.list()]
    done = manager.completion()
    aside, pool = moved_aside(save_dir), recycled(save_dir)
    return listing.ls(
        _place(save_dir),
        infos,
        as_json=args.json,
        done=done,
        done_problem=manager.completion_problem,
        aside=aside,
        pool=pool,
    )


# ------------------------------------------------------------------- verify


def cmd_verify(args: argparse.Namespace) -> int:
    save_dir: Path = args.dir
    manager = CheckpointManager(save_dir, owner=False)
    infos = manager.list()
    if args.step is not None:
        infos = [resolve(save_dir, infos, args.step)]
    if not infos:
        raise CommandFailed(EXIT_USAGE, f"{save_dir}: no checkpoints (expected step_* directories)")
    place = _place(save_dir)
    t0 = time.perf_counter()
    results = [listing.verify_one(place, c, manager.check_files, lambda c: not os.path.lexists(c.path)) for c in infos]
    return listing.verify_report(place, results, time.perf_counter() - t0, as_json=args.json)


# -------------------------------------------------------------------- prune


def cmd_prune(args: argparse.Namespace) -> int:
    save_dir: Path = args.dir
    if not args.yes:
        plan = _plan_prune(save_dir, args)
        return _report_prune(save_dir, plan, args, deleted=[], leftovers=[])
    try:
        with DirLock(save_dir, purpose="preempt prune"):
            plan = _plan_prune(save_dir, args)
            manager = CheckpointManager(save_dir, owner=False)
            for c in plan["keep"] if plan["delete"] else []:
                checks = manager.check_files(c)
                unread = [k.message for k in checks if k.status == "unreadable" and k.message]
                problems = [k.message for k in checks if k.status != "unreadable" and k.message]
                if unread and not problems:
                    raise CommandFailed(
                        EXIT_UNREADABLE,
                        f"{c.path}: would be kept but could not be checked ({'; '.join(unread)}); nothing deleted",
                    )
                if problems:
                    raise CommandFailed(
                        EXIT_DAMAGED,
                        f"{c.path}: would be kept but is damaged ({'; '.join(problems)}); nothing deleted."
                        " Move it aside or delete it by hand, then prune again",
                    )
            deleted: list[Any] = []  # the CheckpointInfo of each
            leftovers: list[str] = []
            for p in plan["recycled"]:  # no checkpoint: the next save would have written over them
                try:
                    deleter.remove_tree(commit.trash(save_dir, Path(p["path"])))
                except OSError as e:
                    leftovers.append(f"{p['path']}: {e}")
            for c in plan["delete"]:
                try:
                    trashed = commit.trash(save_dir, c.path)
                except OSError as e:
                    done = ", ".join(d.name for d in deleted) or "none"
                    msg = f"{c.path}: cannot be moved aside to delete it ({e}); deleted: {done}"
                    raise CommandFailed(EXIT_USAGE, msg) from None
                deleted.append(c)
                try:
                    deleter.remove_tree(trashed)
                except OSError as e:  # out of sight already; the next run start deletes it
                    leftovers.append(f"{trashed}: {e}")
            if deleted or plan["recycled"]:
                hashed_io.fsync_dir(save_dir)
    except LockedError as e:
        raise CommandFailed(EXIT_LOCKED, f"{e} Nothing deleted.") from None
    except OSError as e:
        raise CommandFailed(EXIT_USAGE, f"{save_dir}: cannot prune ({e}); expected a writable save_dir") from None
    return _report_prune(save_dir, plan, args, deleted=deleted, leftovers=leftovers)


def _plan_prune(save_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Which valid checkpoints retention keeps and deletes; the others are skipped (never touched).

    Kept: the newest ``--keep-last``, the one complete.json names, and what the run itself keeps as the newest
    valid manifest records it (its ``keep_best`` best, its ``keep_every_steps`` milestones), unless
    ``--keep-best``/``--keep-every-steps`` say otherwise. A manifest that records no retention (an older
    preempt's) adds nothing.
    """
    manager = CheckpointManager(save_dir, owner=False)
    infos = manager.list()
    done = completion(manager)
    valid = [c for c in infos if c.status == "valid"]
    recorded = valid[0].valid.retention if valid else None
    recorded_in = str(valid[0].path / names.MANIFEST) if recorded is not None else None
    run = recorded or {}
    keep_best = run.get("keep_best", 0) if args.keep_best is None else args.keep_best
    every = run.get("keep_every_steps") if args.keep_every_steps is None else args.keep_every_steps
    every = every or None  # 0: none
    best_why = "" if args.keep_best is not None else f", the run's keep_best={keep_best}"
    every_why = (
        f"--keep-every-steps {every}" if args.keep_every_steps is not None else f"the run's keep_every_steps={every}"
    )
    best = rank_best(infos)
    if keep_best and best.problem:
        hint = "" if args.keep_best is not None else f" (the run's keep_best={keep_best}; --keep-best 0 prunes them)"
        raise CommandFailed(EXIT_DAMAGED, f"{best.problem}{hint}")
    rank = {c.step: i for i, c in enumerate(best.ranked)}
    policy = RetentionPolicy(
        keep_last=args.keep_last,
        keep_best=keep_best if best.metric else 0,
        keep_every_steps=every,
        metric=best.metric,
        mode=best.mode or "min",
    )
    kept = select_kept(
        policy,
        [Kept(c.step, c.valid.best_value if c.step in rank else None, c.valid.origins()) for c in valid],
    )
    why: dict[int, list[str]] = {}
    for i, c in enumerate(valid):
        reasons = why.setdefault(c.step, [])
        if i == 0:
            reasons.append("latest")
        elif i < args.keep_last:
            reasons.append(f"last {args.keep_last}")
        if c.step in rank and rank[c.step] < policy.keep_best:
            reasons.append(f"best #{rank[c.step] + 1} by {best.metric} ({best.mode}){best_why}")
        if every and c.step % every == 0:
            reasons.append(f"milestone ({every_why})")
        if done and c.name == done.get("checkpoint"):
            reasons.append("complete.json")
            kept.add(c.step)
        if c.step in kept and not reasons:
            reasons.append("shares no file with the latest (its files are carried)")
    return {
        "keep": [c for c in valid if c.step in kept],
        "delete": [c for c in valid if c.step not in kept],
        "skip": [c for c in infos if c.status != "valid"],
        "recycled": recycled(save_dir),
        "why": why,
        "best_metric": best.metric,
        "retention": {
            "keep_last": args.keep_last,
            "keep_best": keep_best,
            "keep_best_from": "run" if args.keep_best is None else "option",
            "keep_every_steps": every,
            "keep_every_steps_from": "run" if args.keep_every_steps is None else "option",
            "recorded": recorded,
            "recorded_in": recorded_in,
        },
    }


def _report_prune(
    save_dir: Path, plan: dict[str, Any], args: argparse.Namespace, deleted: list[CheckpointInfo], leftovers: list[str]
) -> int:
    def row(c: CheckpointInfo) -> dict[str, Any]:
        return {
            "name": c.name,
            "step": c.step,
            "status": c.status,
            "bytes": checkpoint_size(c),
            "why": plan["why"].get(c.step, []),
        }

    freed = sum(checkpoint_size(c) for c in plan["delete"]) + sum(p["bytes"] for p in plan["recycled"])
    if args.json:
        emit(
            {
                "dir": str(save_dir),
                "dry_run": not args.yes,
                "keep": [row(c) for c in plan["keep"]],
                "delete": [row(c) for c in plan["delete"]],
                "skipped": [row(c) for c in plan["skip"]],
                "deleted": [c.name for c in deleted],
                "recycled": plan["recycled"],
                "bytes": freed,
                "leftovers": leftovers,
                "retention": plan["retention"],
            }
        )
    else:
        verb = "deleted" if args.yes else "delete"
        table = [["keep", c.name, _log.size(checkpoint_size(c)), ", ".join(plan["why"][c.step])] for c in plan["keep"]]
        table += [[verb, c.name, _log.size(checkpoint_size(c)), ""] for c in plan["delete"]]
        reuse = "files kept for the next save to reuse"
        table += [[verb, p["name"], _log.size(p["bytes"]), reuse] for p in plan["recycled"]]
        table += [
            ["skip", c.name, _log.size(checkpoint_size(c)), f"{c.status}, never touched by prune"] for c in plan["skip"]
        ]
        for line in fmt_table(table, right={2}) if table else [f"{save_dir}: no checkpoints"]:
            print(line)
        kept = plan["retention"]
        if kept["recorded_in"] is not None:
            run = kept["recorded"]
            best = f"keep_best={run['keep_best']}" + (f" by {run['metric']} ({run['mode']})" if run["metric"] else "")
            options = [f"--keep-best {kept['keep_best']}"] if kept["keep_best_from"] == "option" else []
            if kept["keep_every_steps_from"] == "option":
                options.append(f"--keep-every-steps {kept['keep_every_steps'] or 0}")
            instead = f"; replaced by {', '.join(options)}" if options else ""
            print(
                f"the run's retention ({kept['recorded_in']}): {best}, keep_every_steps={run['keep_every_steps']}"
                f"{instead}"
            )
        elif plan["keep"] or plan["delete"]:
            print(
                "the run's retention: not recorded in the newest valid manifest (written by an older preempt or"
                " without a run); only the options apply"
            )
        by = "--keep-best" if kept["keep_best_from"] == "option" else f"the run's keep_best={kept['keep_best']}"
        if kept["keep_best"] and not plan["best_metric"]:
            print(f"note: no checkpoint is marked best; {by} keeps nothing extra")
        n = len(plan["delete"])
        kept_files = f" and {len(plan['recycled'])} recycling directory" if plan["recycled"] else ""
        if args.yes:
            print(f"deleted {len(deleted)} checkpoint(s){kept_files}, {_log.size(freed)}")
        else:
            print(f"dry run: would delete {n} checkpoint(s){kept_files}, {_log.size(freed)}; pass --yes to delete")
        for left in leftovers:
            print(f"warning: could not finish deleting {left} (deleted at the next run start)", file=sys.stderr)
    return EXIT_OK


# ------------------------------------------------------------------- export


def cmd_export(args: argparse.Namespace) -> int:
    save_dir: Path = args.dir
    out: Path = args.out
    if safe_io.within(out, save_dir):
        raise CommandFailed(
            EXIT_USAGE,
            f"--out {out}: is inside the save_dir {save_dir}, where every file belongs to the run (a checkpoint's"
            " file or the lock written over would be lost); nothing written. Give a path outside it",
        )
    if out.is_dir():
        raise CommandFailed(EXIT_USAGE, f"{out}: is a directory; expected the path of a .safetensors file to write")
    if not out.parent.is_dir():
        raise CommandFailed(EXIT_USAGE, f"{out.parent}: no such directory (for --out {out})")
    if (out.exists() or out.is_symlink()) and not args.force:
        raise CommandFailed(EXIT_USAGE, f"{out}: exists; pass --force to overwrite it")
    manager = CheckpointManager(save_dir, owner=False)
    info = resolve(save_dir, manager.list(), "latest" if args.step is None else args.step)
    if info.manifest is None or info.status != "valid":
        code = EXIT_UNREADABLE if info.status == "unreadable" else EXIT_DAMAGED
        raise CommandFailed(code, f"{info.problem}; cannot export from it")
    from ..checkpoint import tensorfile
    from ..checkpoint.names import BASE_FILE, MODEL_FILE
    from ..checkpoint.pieces import assembled  # numpy: only for export

    expected = info.manifest.files.get(MODEL_FILE)
    src = info.path / MODEL_FILE
    if expected is None:
        raise CommandFailed(EXIT_DAMAGED, f"{info.path / names.MANIFEST}: lists no {MODEL_FILE}")
    shard_files = sorted(f for f in info.manifest.files if names.is_shard_file(f))
    # The model's weights: model.safetensors, and the frozen base beside it when the run kept it apart
    # (preempt.checkpoint.carry); the file written holds them all (standalone, whatever was carried). Sharded state:
    # the whole tensors put together from every rank's pieces.
    parts = []
    try:
        for name in (MODEL_FILE, BASE_FILE, *shard_files):
            if name in info.manifest.files:
                path = info.path / name
                buf = read_verified(path, info.manifest.files[name])  # regular file, size and xxh3 as listed; mapped
                parts.append((buf, tensorfile.validate(buf, str(path)), str(path)))
        buf, header, _ = parts[0]
        metadata = _export_metadata(header.metadata, info, expected)
        if shard_files:
            _refuse_dcp_weights(info)
            count, chunks = assembled([(where, b, h) for b, h, where in parts[1:]], "model.", metadata)
        else:
            count = sum(len(h.entries) for _, h, _ in parts)
            chunks = (
                tensorfile.restamped(buf, header, metadata)
                if len(parts) == 1
                else tensorfile.merged([(b, h) for b, h, _ in parts], metadata)
            )
        if len(parts) > 1:
            chunks = iter(list(chunks))  # two tensors of one name raise here, before anything is written
    except (CorruptCheckpointError, ValueError) as e:
        raise CommandFailed(EXIT_DAMAGED, f"{e}; nothing written") from None
    if not count:
        raise CommandFailed(EXIT_USAGE, f"{src}: holds no model weights (saved without a model); nothing written")
    # The data is written straight from the verified mappings (one file: its layout and alignment unchanged): no torch.
    digest = _write_new(out, chunks, args.force)
    doc = {
        "source": str(info.path),
        "step": info.step,
        "out": str(out),
        "tensors": count,
        "bytes": digest.size,
        "xxh3_128": digest.xxh3_128,
    }
    if args.json:
        emit(doc)
    else:
        size = _log.size(digest.size)
        print(f"wrote {out} ({count} tensors, {size}, xxh3 {digest.xxh3_128}) from {info.path}")
    return EXIT_OK


def _refuse_dcp_weights(info: CheckpointInfo) -> None:
    """Sharded state of which DCP wrote some model weights (its pieces are pickles): not exported, said so."""
    from ..checkpoint import codec  # numpy: only for this command
    from ..checkpoint.manager import SHARDED_INDEX

    if info.manifest is None or SHARDED_INDEX not in info.manifest.files:
        return
    where = info.path / SHARDED_INDEX
    doc = codec.loads(read_verified(where, info.manifest.files[SHARDED_INDEX]).tobytes(), str(where))
    held = sorted(k for k in (doc.get("tensors") or {}) if isinstance(k, str) and k.startswith("model."))
    if held:
        raise CommandFailed(
            EXIT_USAGE,
            f"{where}: torch.distributed.checkpoint wrote {held[0]!r} and {len(held) - 1} more model tensor(s),"
            " which this command does not read; nothing written. Load the checkpoint in a run to export them",
        )


def _export_metadata(metadata: dict[str, str], info: CheckpointInfo, expected: FileDigest) -> dict[str, str]:
    return {
        **metadata,
        "format": "pt",
        "preempt.source": str(info.path.resolve()),
        "preempt.step": str(info.step),
        "preempt.source_xxh3_128": expected.xxh3_128,
    }


def _write_new(out: Path, chunks: Iterable[Any], force: bool) -> FileDigest:
    """Writes ``out`` atomically; without ``force`` an existing file (even one created meanwhile) is kept."""
    try:
        return commit.write_atomic(out, chunks, replace=force)
    except FileExistsError:
        raise CommandFailed(EXIT_USAGE, f"{out}: exists; pass --force to overwrite it") from None
    except OSError as e:
        raise CommandFailed(EXIT_USAGE, f"{out}: cannot be written ({e})") from None


def _checkpoint_as_dir(args: argparse.Namespace) -> None:
    """Lets DIR name one checkpoint directory (``runs/x/step_000000120``): its parent and its step.

    Raises:
        CommandFailed: For ``ls`` and ``prune``, which work on a whole save_dir, or when
            STEP names another checkpoint than DIR.
    """
    step = names.parse_checkpoint_name(args.dir.name)
    if step is None or any(names.parse_checkpoint_name(p) is not None for p in os.listdir(args.dir)):
        return
    if not hasattr(args, "step"):
        raise CommandFailed(EXIT_USAGE, f"{args.dir}: is one checkpoint; expected its save_dir ({args.dir.parent})")
    if args.step is not None and args.step != step:
        raise CommandFailed(EXIT_USAGE, f"{args.dir}: is the checkpoint of step {step}, but STEP says {args.step}")
    args.dir, args.step = args.dir.parent, step


def cmd_prefetch(args: argparse.Namespace) -> int:
    from ..checkpoint import readahead

    t0 = time.monotonic()
    found = newest_files(args.dir)
    if found is None:
        doc: dict[str, Any] = {"checkpoint": None, "files": 0, "bytes": 0, "seconds": 0.0}
        message = f"{args.dir}: no valid checkpoint to read ahead"
    else:
        path, files = found
        done = readahead.warm(files, read=not args.no_wait)
        seconds = time.monotonic() - t0
        doc = {"checkpoint": str(path), "files": done.files, "bytes": done.nbytes, "seconds": round(seconds, 3)}
        doc["failed"] = list(done.failed)
        how = "asked for" if args.no_wait else f"read in {_log.duration(seconds)}"
        message = f"{path}: {done.files} file(s), {_log.size(done.nbytes)} {how}"
        message += "".join(f"; not read: {f}" for f in done.failed)
    if args.json:
        emit(doc)
    else:
        print(message)
    return EXIT_OK


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "ls": cmd_ls,
    "prefetch": cmd_prefetch,
    "verify": cmd_verify,
    "inspect": lambda args: _inspect(args),
    "prune": cmd_prune,
    "export": cmd_export,
}


def _inspect(args: argparse.Namespace) -> int:
    from .inspection import cmd_inspect  # the largest of the commands: loaded when asked for

    return cmd_inspect(args)


def run(args: argparse.Namespace) -> int:
    """Runs the parsed command on its save_dir.

    Raises:
        CommandFailed: With the exit code and the message for stderr.
    """
    if not args.dir.exists():
        raise CommandFailed(EXIT_USAGE, f"{args.dir}: no such directory; expected a preempt save_dir")
    if not args.dir.is_dir():
        raise CommandFailed(EXIT_USAGE, f"{args.dir}: is a file; expected a preempt save_dir (a directory)")
    try:
        _checkpoint_as_dir(args)
        return COMMANDS[args.command](args)
    except CheckpointUnreadableError as e:
        raise CommandFailed(EXIT_UNREADABLE, str(e)) from None
    except OSError as e:  # the save_dir itself, or a file no check above expected to fail: said, never a traceback
        code = EXIT_UNREADABLE if safe_io.resource_error(e) else EXIT_USAGE
        raise CommandFailed(code, safe_io.describe_error(getattr(e, "filename", None) or args.dir, e)) from None
    except MemoryError:
        raise CommandFailed(EXIT_UNREADABLE, f"{args.dir}: out of memory") from None

"""What ``ls`` and ``verify`` show of a set of checkpoints, wherever they are kept: a save_dir
(:mod:`preempt.cli.checkpoints`) or a mirror in object storage (:mod:`preempt.cli.remote`).

One code path for both: the commands gather :class:`~preempt.checkpoint.manager.CheckpointInfo` objects (and,
for verify, one :class:`~preempt.checkpoint.files.FileCheck` per file) their own way, and this module turns them
into the same rows, tables, verdicts and exit codes. A :class:`Place` says how the texts name what was found: a
save_dir's paths as they are; a mirror's checkpoints are checked in a temporary directory, whose path ``shown``
turns back into the object's URL. No torch here.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from typing import Any

from .. import _log
from ..checkpoint.files import FileCheck
from ..checkpoint.manager import CheckpointInfo, rank_best
from .output import EXIT_DAMAGED, EXIT_OK, EXIT_UNREADABLE, emit
from .views import carried_bytes, fmt_table, fmt_utc, fmt_when

# What ls checks of each checkpoint, said under its table and in its JSON: a flipped bit passes it, verify finds it.
LS_CHECKED = {"manifest": True, "sizes": True, "digests": False}


def _same(text: str) -> str:
    return text


@dataclasses.dataclass(frozen=True)
class Place:
    """Where the checkpoints listed are, as the output names it.

    Args:
        where: The save_dir or the mirror's URL (without credentials), as shown.
        size_of: A checkpoint's bytes: those its manifest lists, or without one what is there.
        checked: The line under ls's table saying what its status checked.
        shown: Turns a path or a message into what is shown (a mirror: its temporary directory into the URL).
    """

    where: str
    size_of: Callable[[CheckpointInfo], int]
    checked: str
    shown: Callable[[str], str] = _same


# ----------------------------------------------------------------------- ls


def ls(
    place: Place,
    infos: list[CheckpointInfo],
    *,
    as_json: bool,
    done: dict[str, Any] | None = None,
    done_problem: str | None = None,
    aside: dict[str, int] | None = None,
    pool: list[dict[str, Any]] | None = None,
    hidden: int = 0,
) -> int:
    """Prints ls's table (or its JSON document) of ``infos``, newest first; returns its exit code (always 0).

    ``done``: complete.json's content when believed; ``aside``: checkpoints moved to quarantine/ and superseded/;
    ``pool``: the recycling directories (a save_dir's; a mirror has none of them); ``hidden``: older checkpoints
    not shown (a mirror's ls shows the newest, ``--all`` every one).
    """
    aside = {} if aside is None else aside
    pool = [] if pool is None else pool
    shown = place.shown
    # a node's part of a checkpoint (nodes without a shared save_dir) is never loaded by itself: never "latest"
    latest = next((c.step for c in infos if c.status == "valid" and c.valid.part is None), None)
    best = rank_best(infos)
    best_step = best.ranked[0].step if best.ranked else None
    done_name = done.get("checkpoint") if done else None
    rows: list[dict[str, Any]] = []
    for c in infos:
        m = c.manifest
        carried, origins = carried_bytes(c)
        size = place.size_of(c)
        rows.append(
            {
                "name": c.name,
                "path": shown(str(c.path)),
                "step": c.step,
                "epoch": m.cursor.epoch if m else None,
                "batch": m.cursor.batch if m else None,
                "created": m.created if m else None,
                "created_utc": fmt_utc(m.created) if m else None,
                "reason": m.reason if m else None,
                "bytes": size,
                "written_bytes": size - carried,
                "carried_bytes": carried,
                "carried_from": origins,
                "status": c.status,
                "latest": c.step == latest,
                "best": c.step == best_step,
                "complete": c.name == done_name,
                "part": None if m is None or m.part is None else {"node": m.part.node, "nodes": m.part.nodes},
                "problem": None if c.problem is None else shown(c.problem),
            }
        )
    if as_json:
        emit(
            {
                "dir": place.where,
                "complete": done is not None,
                "complete_checkpoint": done_name,
                "complete_problem": done_problem,
                "best_metric": best.metric,
                "best_mode": best.mode,
                "moved_aside": aside,
                "recycled": pool,
                "checked": LS_CHECKED,
                "checkpoints": rows,
                "not_shown": hidden,
            }
        )
        return EXIT_OK
    if not rows:
        print(f"{place.where}: no checkpoints")
    else:
        head = ["checkpoint", "step", "epoch", "batch", "saved (local time)", "size", "written", "carried", "reason"]
        table = [[*head, "status"]]
        for r in rows:
            marks = [m for m in ("latest", "best") if r[m]]  # the complete one is named below the table
            if r["part"] is not None:
                marks.append(f"node {r['part']['node']}'s part of {r['part']['nodes']}")
            table.append(
                [
                    r["name"],
                    str(r["step"]),
                    "-" if r["epoch"] is None else str(r["epoch"]),
                    "-" if r["batch"] is None else str(r["batch"]),
                    fmt_when(r["created"]),
                    _log.size(r["bytes"]),
                    _log.size(r["written_bytes"]),
                    _carried_cell(r["carried_bytes"], r["carried_from"]),
                    r["reason"] or "-",
                    r["status"] + (f" ({', '.join(marks)})" if marks else ""),
                ]
            )
        lines = fmt_table(table, right={1, 2, 3, 5, 6})
        print(lines[0])
        for line, r in zip(lines[1:], rows, strict=True):
            print(line)
            if r["problem"]:
                print(f"    {r['problem']}")
        print(place.checked)
    if hidden:
        print(f"{hidden} older step(s) not shown (nor their manifests read): --all shows every one")
    if best.metric:
        print(f"best: {best.metric} ({best.mode})" if best.mode else f"best: {best.problem}")
    for where, n in aside.items():
        if n:
            print(f"{where}/: {n} checkpoint(s) moved aside")
    for p in pool:
        print(f"{p['name']}/: {_log.size(p['bytes'])} of a pruned checkpoint's files, for the next save to write over")
    if done is not None:
        print(f"run complete: {done_name or '?'}")
    if done_problem:
        print(f"warning: {done_problem}", file=sys.stderr)
    return EXIT_OK


def _carried_cell(nbytes: int, origins: list[int]) -> str:
    """``-``, or the bytes carried and the steps whose saves wrote them: ``4.0 MiB from 12``."""
    if not nbytes and not origins:
        return "-"
    return f"{_log.size(nbytes)} from {','.join(map(str, origins))}"


# ------------------------------------------------------------------- verify


def verify_one(
    place: Place,
    info: CheckpointInfo,
    check_files: Callable[[CheckpointInfo], list[FileCheck]],
    gone: Callable[[CheckpointInfo], bool],
) -> dict[str, Any]:
    """One checkpoint's verify result: its files' checks (``check_files``) judged, the same way wherever it is.

    ``gone``: whether the checkpoint was deleted meanwhile (pruned by a running training: not damage).
    """
    shown = place.shown
    doc: dict[str, Any] = {"name": info.name, "path": shown(str(info.path)), "step": info.step, "status": info.status}
    if info.status == "unreadable":  # its manifest could not be read (permission, memory, I/O): not damage
        problem = shown(info.problem or f"{info.path}: unreadable")
        return {**doc, "ok": None, "bytes": 0, "files": [], "problems": [problem]}
    if info.manifest is None:
        problem = shown(info.problem or f"{info.path}: no manifest")
        return {**doc, "ok": False, "bytes": 0, "files": [], "problems": [problem]}
    checks = check_files(info)
    # A checkpoint that list() found broken (its manifest names another step) is never ok, whatever its files.
    broken = [shown(info.problem or f"{info.path}: {info.status}")] if info.status != "valid" else []
    files = [
        {
            "name": c.name,
            "path": shown(str(c.path)),
            "expected": c.expected.to_json(),
            "status": c.status,
            "found": None if c.found is None else {"size": c.found.size, "xxh3_128": c.found.xxh3_128 or None},
            "message": None if c.message is None else shown(c.message),
        }
        for c in checks
    ]
    damage = broken + [shown(c.message) for c in checks if c.message is not None and c.status != "unreadable"]
    unread = [shown(c.message) for c in checks if c.message is not None and c.status == "unreadable"]
    problems = damage + unread
    nbytes = sum(c.found.size for c in checks if c.found is not None and c.found.xxh3_128)
    if problems and gone(info):
        # Pruned or moved aside by a running training while this was reading it: not damage.
        what = shown(str(info.path))
        gone_text = f"{what}: deleted or moved aside while being verified (by a running training?)"
        return {**doc, "status": "gone", "ok": None, "bytes": nbytes, "files": files, "problems": [gone_text]}
    if unread and not damage:  # what could be read is fine; the rest could not be checked
        return {**doc, "status": "unreadable", "ok": None, "bytes": nbytes, "files": files, "problems": unread}
    return {**doc, "ok": not problems, "bytes": nbytes, "files": files, "problems": problems}


def verify_report(place: Place, results: list[dict[str, Any]], seconds: float, *, as_json: bool) -> int:
    """Prints verify's results (or its JSON document); returns its exit code: 1 damaged, 4 unreadable, else 0."""
    nbytes = sum(r["bytes"] for r in results)
    damaged = [r for r in results if r["ok"] is False]
    unreadable = [r for r in results if r["status"] == "unreadable"]
    if as_json:
        emit(
            {
                "dir": place.where,
                "ok": not damaged and not unreadable,
                "bytes": nbytes,
                "seconds": seconds,
                "checkpoints": results,
            }
        )
    else:
        for r in results:
            if r["ok"]:
                print(f"{r['name']}: ok ({len(r['files'])} files, {_log.size(r['bytes'])})")
            elif r["status"] == "unreadable":
                print(f"{r['name']}: UNREADABLE (not damage: a file could not be read)")
            elif r["ok"] is None:
                print(f"{r['name']}: gone")
            else:
                print(f"{r['name']}: {'DAMAGED' if r['status'] == 'valid' else r['status'].upper()}")
            for p in r["problems"]:
                print(f"    {p}")
        rate = f" ({nbytes / seconds / 1e9:.2f} GB/s)" if seconds > 0 and nbytes else ""
        verdicts = [f"{len(damaged)} of {len(results)} damaged"] if damaged else []
        verdicts += [f"{len(unreadable)} of {len(results)} unreadable"] if unreadable else []
        verdict = ", ".join(verdicts) or "all ok"
        print(f"{len(results)} checkpoint(s), {_log.size(nbytes)} hashed in {seconds:.2f} s{rate}: {verdict}")
    return EXIT_DAMAGED if damaged else EXIT_UNREADABLE if unreadable else EXIT_OK

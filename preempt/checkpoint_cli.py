"""The checkpoint commands of the ``preempt`` command line: ls, verify, inspect, prune, export.

The parser, the exit codes and ``main`` are in :mod:`preempt.cli`, which imports
this module (and with it torch) only when one of these commands runs, so that
``preempt supervise`` and ``--help`` start fast.

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
import datetime
import json
import math
import os
import sys
import time
from collections.abc import Callable, Collection, Iterable
from pathlib import Path
from typing import Any

import xxhash

from . import _log, commit, tensorfile
from .checkpoint import CheckpointInfo, CheckpointManager, rank_best, read_verified, regular_file
from .cli_output import EXIT_DAMAGED, EXIT_LOCKED, EXIT_OK, EXIT_USAGE, CommandFailed, emit
from .commit import QUARANTINE, SUPERSEDED, FileDigest
from .errors import CorruptCheckpointError
from .lock import DirLock, LockedError
from .manifest import Manifest
from .policy import Kept, RetentionPolicy, select_kept
from .state import MODEL_FILE, STATE_FILE, STATE_JSON
from .tensorfile import Entry, Header

_MAX_STATE_JSON = 1 << 30  # state.json larger than this is not summarised by inspect
_MAX_RNG_TENSOR = 1 << 20  # an RNG state is a few KiB; anything larger is not one


# ------------------------------------------------------------------ helpers


def _when(ts: float | None) -> str:
    if ts is None:
        return "-"
    return datetime.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")


def _utc(ts: float | None) -> str | None:
    if ts is None:
        return None
    return datetime.datetime.fromtimestamp(ts, datetime.timezone.utc).isoformat(timespec="seconds")


def _table(rows: list[list[str]], right: Collection[int] = ()) -> list[str]:
    """Rows of cells as aligned lines; the columns in ``right`` are right-aligned."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for r in rows:
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))]
        out.append("  ".join(cells).rstrip())
    return out


def _size(info: CheckpointInfo) -> int:
    if info.manifest is None:
        if not info.path.is_dir() or info.path.is_symlink():
            return 0
        return sum(p.stat().st_size for p in info.path.iterdir() if p.is_file() and not p.is_symlink())
    return sum(d.size for d in info.manifest.files.values())


def _resolve(save_dir: Path, infos: list[CheckpointInfo], selector: int | str) -> CheckpointInfo:
    """The checkpoint STEP names: a step (whatever its status), the newest valid one, or the best one.

    Raises:
        CommandFailed: EXIT_USAGE when there is none, saying what there is.
    """
    if isinstance(selector, int):
        for c in infos:
            if c.step == selector:
                return c
        have = ", ".join(str(c.step) for c in infos[:20]) + (", ..." if len(infos) > 20 else "")
        raise CommandFailed(EXIT_USAGE, f"{save_dir}: no checkpoint at step {selector} (steps here: {have or 'none'})")
    if selector == "latest":
        valid = [c for c in infos if c.status == "valid"]
        if valid:
            return valid[0]
        broken = f" ({len(infos)} checkpoint(s), none with a valid manifest)" if infos else ""
        raise CommandFailed(EXIT_USAGE, f"{save_dir}: no valid checkpoint{broken}")
    best = rank_best(infos)
    if best.problem:
        raise CommandFailed(EXIT_DAMAGED, best.problem)
    if not best.ranked:
        raise CommandFailed(
            EXIT_USAGE,
            f"{save_dir}: no valid checkpoint is marked best (a run marks one when its best_metric improves)",
        )
    return best.ranked[0]


def _completion(manager: CheckpointManager) -> dict[str, Any] | None:
    try:
        return manager.completion()
    except CorruptCheckpointError as e:
        raise CommandFailed(EXIT_DAMAGED, f"{e}; expected the JSON written when the run completed") from None


def _moved_aside(save_dir: Path) -> dict[str, int]:
    out = {}
    for where in (QUARANTINE, SUPERSEDED):
        d = save_dir / where
        out[where] = sum(1 for _ in d.iterdir()) if d.is_dir() and not d.is_symlink() else 0
    return out


# ----------------------------------------------------------------------- ls


def cmd_ls(args: argparse.Namespace) -> int:
    save_dir: Path = args.dir
    manager = CheckpointManager(save_dir, owner=False)
    infos = manager.list()
    latest = next((c.step for c in infos if c.status == "valid"), None)
    best = rank_best(infos)
    best_step = best.ranked[0].step if best.ranked else None
    try:
        done = manager.completion()
        done_problem = None
    except CorruptCheckpointError as e:
        done, done_problem = None, str(e)
    done_name = done.get("checkpoint") if done else None
    rows = []
    for c in infos:
        m = c.manifest
        rows.append(
            {
                "name": c.name,
                "path": str(c.path),
                "step": c.step,
                "epoch": m.cursor.epoch if m else None,
                "batch": m.cursor.batch if m else None,
                "created": m.created if m else None,
                "created_utc": _utc(m.created) if m else None,
                "reason": m.reason if m else None,
                "bytes": _size(c),
                "status": c.status,
                "latest": c.step == latest,
                "best": c.step == best_step,
                "complete": c.name == done_name,
                "problem": c.problem,
            }
        )
    aside = _moved_aside(save_dir)
    if args.json:
        emit(
            {
                "dir": str(save_dir),
                "complete": done is not None,
                "complete_checkpoint": done_name,
                "complete_problem": done_problem,
                "best_metric": best.metric,
                "best_mode": best.mode,
                "moved_aside": aside,
                "checkpoints": rows,
            }
        )
        return EXIT_OK
    if not rows:
        print(f"{save_dir}: no checkpoints")
    else:
        table = [["checkpoint", "step", "epoch", "batch", "saved (local time)", "size", "reason", "status"]]
        for r in rows:
            marks = [m for m in ("latest", "best") if r[m]]  # the complete one is named below the table
            table.append(
                [
                    r["name"],
                    str(r["step"]),
                    "-" if r["epoch"] is None else str(r["epoch"]),
                    "-" if r["batch"] is None else str(r["batch"]),
                    _when(r["created"]),
                    _log.size(r["bytes"]),
                    r["reason"] or "-",
                    r["status"] + (f" ({', '.join(marks)})" if marks else ""),
                ]
            )
        lines = _table(table, right={1, 2, 3, 5})
        print(lines[0])
        for line, r in zip(lines[1:], rows, strict=True):
            print(line)
            if r["problem"]:
                print(f"    {r['problem']}")
    if best.metric:
        print(f"best: {best.metric} ({best.mode})" if best.mode else f"best: {best.problem}")
    for where, n in aside.items():
        if n:
            print(f"{where}/: {n} checkpoint(s) moved aside")
    if done is not None:
        print(f"run complete: {done_name or '?'}")
    if done_problem:
        print(f"warning: {done_problem}", file=sys.stderr)
    return EXIT_OK


# ------------------------------------------------------------------- verify


def _verify_one(manager: CheckpointManager, info: CheckpointInfo) -> dict[str, Any]:
    doc: dict[str, Any] = {"name": info.name, "path": str(info.path), "step": info.step, "status": info.status}
    if info.manifest is None:
        return {**doc, "ok": False, "bytes": 0, "files": [], "problems": [info.problem or f"{info.path}: no manifest"]}
    checks = manager.check_files(info)
    files = [
        {
            "name": c.name,
            "path": str(c.path),
            "expected": c.expected.to_json(),
            "status": c.status,
            "found": None if c.found is None else {"size": c.found.size, "xxh3_128": c.found.xxh3_128 or None},
            "message": c.message,
        }
        for c in checks
    ]
    problems = [c.message for c in checks if c.message is not None]
    nbytes = sum(c.found.size for c in checks if c.found is not None and c.found.xxh3_128)
    if problems and not os.path.lexists(info.path):
        # Pruned or moved aside by a running training while this was reading it: not damage.
        gone = f"{info.path}: deleted or moved aside while being verified (by a running training?)"
        return {**doc, "status": "gone", "ok": None, "bytes": nbytes, "files": files, "problems": [gone]}
    return {**doc, "ok": not problems, "bytes": nbytes, "files": files, "problems": problems}


def cmd_verify(args: argparse.Namespace) -> int:
    save_dir: Path = args.dir
    manager = CheckpointManager(save_dir, owner=False)
    infos = manager.list()
    if args.step is not None:
        infos = [_resolve(save_dir, infos, args.step)]
    if not infos:
        raise CommandFailed(EXIT_USAGE, f"{save_dir}: no checkpoints (expected step_* directories)")
    t0 = time.perf_counter()
    results = [_verify_one(manager, c) for c in infos]
    seconds = time.perf_counter() - t0
    nbytes = sum(r["bytes"] for r in results)
    damaged = [r for r in results if r["ok"] is False]
    if args.json:
        emit(
            {
                "dir": str(save_dir),
                "ok": not damaged,
                "bytes": nbytes,
                "seconds": seconds,
                "checkpoints": results,
            }
        )
    else:
        for r in results:
            if r["ok"]:
                print(f"{r['name']}: ok ({len(r['files'])} files, {_log.size(r['bytes'])})")
            elif r["ok"] is None:
                print(f"{r['name']}: gone")
            else:
                print(f"{r['name']}: {'DAMAGED' if r['status'] == 'valid' else r['status'].upper()}")
            for p in r["problems"]:
                print(f"    {p}")
        rate = f" ({nbytes / seconds / 1e9:.2f} GB/s)" if seconds > 0 and nbytes else ""
        verdict = f"{len(damaged)} of {len(results)} damaged" if damaged else "all ok"
        print(f"{len(results)} checkpoint(s), {_log.size(nbytes)} hashed in {seconds:.2f} s{rate}: {verdict}")
    return EXIT_DAMAGED if damaged else EXIT_OK


# ------------------------------------------------------------------ inspect


def _read_span(path: Path, header: Header, entry: Entry) -> bytes:
    with open(path, "rb") as f:
        data = os.pread(f.fileno(), entry.end - entry.begin, header.data_start + entry.begin)
    if len(data) != entry.end - entry.begin:
        raise CorruptCheckpointError(f"{path}: tensor {entry.name!r} ends past the end of the file")
    return data


def _tensors_summary(path: Path, header: Header, limit: int | None) -> dict[str, Any]:
    entries = header.entries
    by_dtype: dict[str, int] = {}
    for e in entries:
        by_dtype[e.dtype] = by_dtype.get(e.dtype, 0) + 1
    return {
        "path": str(path),
        "count": len(entries),
        "elements": sum(math.prod(e.shape) for e in entries),
        "bytes": sum(e.end - e.begin for e in entries),
        "dtypes": by_dtype,
        "metadata": header.metadata,
        "tensors": [
            {"name": e.name, "dtype": e.dtype, "shape": list(e.shape), "bytes": e.end - e.begin}
            for e in (entries if limit is None else entries[:limit])
        ],
    }


def _untuple(v: Any) -> Any:
    """JSON of state.json with codec's tuple tags undone (for display)."""
    if isinstance(v, dict) and set(v) == {"__tuple__"} and isinstance(v["__tuple__"], list):
        return [_untuple(x) for x in v["__tuple__"]]
    if isinstance(v, list):
        return [_untuple(x) for x in v]
    return v


def _ref(v: Any) -> str | None:
    if isinstance(v, dict) and len(v) == 1:
        ((tag, key),) = v.items()
        if tag in ("__tensor__", "__ndarray__") and isinstance(key, str):
            return key
    return None


def _rng_summary(tree: Any, header: Header, path: Path) -> dict[str, Any] | None:
    """Which generators a state.json ``rng`` entry holds, with a short digest of each state (not the state)."""
    if not isinstance(tree, dict):
        return None
    tensors = {e.name: e for e in header.entries}

    def digest(ref_value: Any) -> dict[str, Any]:
        key = _ref(ref_value)
        entry = tensors.get(key) if key else None
        if entry is None:
            return {"present": False, "problem": f"reference {key!r} not in {path.name}"}
        if entry.end - entry.begin > _MAX_RNG_TENSOR:
            return {"present": True, "bytes": entry.end - entry.begin, "xxh3_64": None}
        span = _read_span(path, header, entry)
        return {"present": True, "bytes": len(span), "xxh3_64": xxhash.xxh3_64_hexdigest(span)}

    out: dict[str, Any] = {}
    for snap in ("now", "epoch_start"):
        s = tree.get(snap)
        if not isinstance(s, dict):
            out[snap] = None
            continue
        py, npy = s.get("python"), s.get("numpy")
        cuda = s.get("cuda") if isinstance(s.get("cuda"), list) else []
        out[snap] = {
            "python": {**digest(py.get("state")), "version": py.get("version")} if isinstance(py, dict) else None,
            "numpy": {**digest(npy.get("key")), "kind": npy.get("kind"), "pos": npy.get("pos")}
            if isinstance(npy, dict)
            else None,
            "torch_cpu": digest(s.get("torch")) if "torch" in s else None,
            "cuda": [{"device": i, **digest(t)} for i, t in enumerate(cuda)],
        }
    return out


def _optimizer_summary(opt: Any, cls: Any) -> dict[str, Any] | None:
    """Param groups (hyperparameters, parameter counts) and per-parameter state keys of a saved optimizer.

    ``cls`` is state.json's ``optimizer_class`` when the writer recorded one.
    """
    if not isinstance(opt, dict):
        return None
    groups = []
    param_groups = opt.get("param_groups")
    for g in param_groups if isinstance(param_groups, list) else []:
        if isinstance(g, dict):
            params = g.get("params")
            hyper = {k: _untuple(v) for k, v in g.items() if k != "params"}
            groups.append({"params": len(params) if isinstance(params, list) else None, **hyper})
    st = opt.get("state")
    items = st.get("__items__") if isinstance(st, dict) and "__items__" in st else None
    pairs = [p for p in items if isinstance(p, list) and len(p) == 2] if isinstance(items, list) else []
    per_param = [v for _, v in pairs if isinstance(v, dict)]
    if isinstance(st, dict) and items is None:
        per_param = [v for v in st.values() if isinstance(v, dict)]
    keys = sorted({k for v in per_param for k in v})
    return {
        "class": cls if isinstance(cls, str) else None,
        "param_groups": groups,
        "state_params": len(per_param),
        "state_keys": keys,
    }


def _state_summary(info: CheckpointInfo, state_header: Header | None) -> tuple[dict[str, Any], list[str]]:
    """Optimizer, RNG and other state from state.json (and state.safetensors' header); and problems found.

    ``state_header`` is None when that header could not be read (already
    reported): the RNG states, which live in that file, are then not summarised.
    """
    m = info.manifest
    assert m is not None
    out: dict[str, Any] = dict.fromkeys(("optimizer", "rng", "scheduler", "scaler", "user_keys", "tracked"))
    out["rng_recorded"] = False
    problems: list[str] = []
    expected = m.files.get(STATE_JSON)
    jpath = info.path / STATE_JSON
    if expected is None:
        return out, [f"{info.path / commit.MANIFEST}: lists no {STATE_JSON}"]
    if expected.size > _MAX_STATE_JSON:
        return out, [f"{jpath}: {expected.size} bytes; not summarised (limit {_MAX_STATE_JSON})"]
    try:
        tree = json.loads(read_verified(jpath, expected).tobytes())  # refuses what is not a regular file
    except CorruptCheckpointError as e:
        return out, [str(e)]
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        return out, [f"{jpath}: matches its digest but is not valid JSON ({e})"]
    if not isinstance(tree, dict):
        return out, [f"{jpath}: expected a JSON object, found {type(tree).__name__}"]
    spath = info.path / STATE_FILE
    out["optimizer"] = _optimizer_summary(tree.get("optimizer"), tree.get("optimizer_class"))
    out["rng_recorded"] = isinstance(tree.get("rng"), dict)
    if state_header is not None:
        try:
            out["rng"] = _rng_summary(tree.get("rng"), state_header, spath)
        except CorruptCheckpointError as e:
            problems.append(str(e))
        except OSError as e:
            problems.append(f"{spath}: cannot be read ({e})")
    sched = tree.get("scheduler")
    if isinstance(sched, dict):
        out["scheduler"] = {k: _untuple(v) for k, v in sched.items() if _ref(v) is None and not isinstance(v, dict)}
    scaler = tree.get("scaler")
    if isinstance(scaler, dict):
        out["scaler"] = {k: v for k, v in scaler.items() if isinstance(v, (int, float, str, bool)) or v is None}
    if isinstance(tree.get("user"), dict):
        out["user_keys"] = sorted(tree["user"])
    if isinstance(tree.get("tracked"), dict):
        out["tracked"] = sorted(tree["tracked"])
    return out, problems


def _manifest_doc(m: Manifest) -> dict[str, Any]:
    c = m.cursor
    return {
        "step": m.step,
        "epoch": c.epoch,
        "batch": c.batch,
        "sample": c.sample,
        "point": c.point,
        "batches_per_epoch": c.batches_per_epoch,
        "reason": m.reason,
        "created": m.created,
        "created_utc": _utc(m.created),
        "format_version": m.format_version,
        "files": {name: d.to_json() for name, d in sorted(m.files.items())},
        "metrics": m.metrics,
        "best": m.best,
        "is_best": m.is_best,
        "sampler": m.sampler,
        "lineage": m.lineage,
        "provenance": m.provenance,
    }


def cmd_inspect(args: argparse.Namespace) -> int:
    save_dir: Path = args.dir
    manager = CheckpointManager(save_dir, owner=False)
    info = _resolve(save_dir, manager.list(), "latest" if args.step is None else args.step)
    if info.manifest is None:
        raise CommandFailed(EXIT_DAMAGED, f"{info.problem}; expected a manifest.json written by a completed save")
    if info.status != "valid":
        raise CommandFailed(EXIT_DAMAGED, info.problem or f"{info.path}: {info.status}")
    m = info.manifest
    limit = None if args.json or args.tensors == "all" else int(args.tensors)
    problems: list[str] = []
    tensors: dict[str, Any] = {}
    headers: dict[str, Header] = {}
    for name in (MODEL_FILE, STATE_FILE):
        path = info.path / name
        if name not in m.files:
            continue
        try:
            size = path.stat().st_size
            if size != m.files[name].size:
                problems.append(f"{path}: size {size} bytes, manifest says {m.files[name].size}")
            regular_file(path)
            headers[name] = tensorfile.read_header(path)
            tensors[name] = _tensors_summary(path, headers[name], limit)
        except (CorruptCheckpointError, ValueError) as e:
            problems.append(str(e))
        except FileNotFoundError:
            problems.append(f"{path}: missing")
        except OSError as e:
            problems.append(f"{path}: cannot be read ({e})")
    st, more = _state_summary(info, headers.get(STATE_FILE, Header([], {}, 0) if STATE_FILE not in m.files else None))
    problems += more
    if args.json:
        doc = {"dir": str(save_dir), "checkpoint": info.name, "path": str(info.path), "manifest": _manifest_doc(m)}
        emit({**doc, "tensor_files": tensors, **st, "problems": problems})
    else:
        _print_inspect(info, m, tensors, st, limit)
        for p in problems:
            print(f"problem: {p}", file=sys.stderr)
    return EXIT_DAMAGED if problems else EXIT_OK


def _kv(d: dict[str, Any], skip: Callable[[Any], bool] = lambda v: False) -> str:
    return ", ".join(f"{k}={v}" for k, v in d.items() if not skip(v))


def _print_inspect(
    info: CheckpointInfo, m: Manifest, tensors: dict[str, Any], st: dict[str, Any], limit: int | None
) -> None:
    c = m.cursor
    bpe = f" of {c.batches_per_epoch}" if c.batches_per_epoch >= 0 else ""
    print(f"{info.path}")
    print(f"  step {m.step}, epoch {c.epoch}, batch {c.batch}{bpe}, sample {c.sample}, taken at the {c.point} boundary")
    print(f"  reason {m.reason}; created {_when(m.created)} (local), {_utc(m.created)}")
    if m.metrics:
        print(f"  metrics: {_kv(m.metrics)}")
    if m.best:
        mark = "this checkpoint holds it" if m.is_best else "not this checkpoint"
        b = m.best
        print(f"  best: {b.get('metric')} {b.get('mode', 'min')} = {b.get('value')} at step {b.get('step')} ({mark})")
    if m.lineage:
        started = m.lineage.get("started")
        when = _when(started) if isinstance(started, (int, float)) else started
        print(f"  lineage: request {m.lineage.get('request')}, source {m.lineage.get('source', '-')}, started {when}")
    if m.sampler:
        print(f"  sampler: {_kv(m.sampler)}")
    print("files (not re-hashed here; `preempt verify` does)")
    for line in _table(
        [[n, str(d.size), _log.size(d.size), d.xxh3_128] for n, d in sorted(m.files.items())], right={1, 2}
    ):
        print(f"  {line}")
    for name, t in tensors.items():
        dtypes = ", ".join(f"{k} x{v}" for k, v in sorted(t["dtypes"].items()))
        print(f"{name}: {t['count']} tensors, {t['elements']:,} elements, {_log.size(t['bytes'])} ({dtypes or 'none'})")
        if t["metadata"]:
            print(f"  metadata: {_kv(t['metadata'])}")
        rows = [
            [r["name"], r["dtype"], "x".join(map(str, r["shape"])) or "scalar", _log.size(r["bytes"])]
            for r in t["tensors"]
        ]
        for line in _table(rows, right={3}) if rows else []:
            print(f"  {line}")
        if len(t["tensors"]) < t["count"]:
            print(f"  ... {t['count'] - len(t['tensors'])} more (--tensors all, or --json, lists every one)")
    opt = st["optimizer"]
    if opt is None:
        print("optimizer: none saved")
    else:
        cls = opt["class"] or "not recorded"
        keys = ", ".join(opt["state_keys"]) or "-"
        print(f"optimizer: class {cls}; state for {opt['state_params']} parameter(s): {keys}")
        for i, g in enumerate(opt["param_groups"]):
            rest = {k: v for k, v in g.items() if k not in ("params", "lr")}
            print(
                f"  group {i}: {g['params']} params, lr={g.get('lr')}, {_kv(rest, lambda v: v is None or v is False)}"
            )
    if st["scheduler"] is not None:
        print(f"scheduler: {_kv(st['scheduler'])}")
    if st["scaler"] is not None:
        print(f"scaler: {_kv(st['scaler'])}")
    rng = st["rng"]
    if rng is None and st["rng_recorded"]:
        print(f"rng: not summarised ({STATE_FILE} unreadable, see the problems below)")
    elif rng is None:
        print("rng: not recorded (saved without a PreemptibleRun)")
    else:
        print("rng (xxh3-64 of each generator's state; equal digests mean equal states)")
        for snap, s in rng.items():
            if s is None:
                print(f"  {snap}: none")
                continue
            parts = []
            for gen in ("python", "numpy", "torch_cpu"):
                g = s[gen]
                parts.append(f"{gen} {g['xxh3_64'] if g and g.get('present') else 'absent'}")
            cuda = ", ".join(f"cuda:{d['device']} {d.get('xxh3_64')}" for d in s["cuda"]) or "cuda none"
            print(f"  {snap}: {'; '.join(parts)}; {cuda}")
    if st["user_keys"]:
        print(f"user_state keys: {', '.join(st['user_keys'])}")
    if st["tracked"]:
        print(f"tracked: {', '.join(st['tracked'])}")
    p = m.provenance
    if p:
        names = ("preempt", "torch", "numpy", "safetensors", "python", "cuda")
        versions = ", ".join(f"{k} {p[k]}" for k in names if p.get(k))
        print(f"provenance: {versions}")
        git = p.get("git")
        git_s = f"{git.get('commit')}{' (dirty)' if git.get('dirty') else ''}" if isinstance(git, dict) else "unknown"
        slurm = p.get("slurm")
        slurm_s = _kv(slurm) if isinstance(slurm, dict) else "none"
        print(f"  host {p.get('host')}, pid {p.get('pid')}, git {git_s}, slurm {slurm_s}")
        if p.get("argv"):
            print(f"  argv: {' '.join(map(str, p['argv']))}")


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
                problems = manager.verify(c)
                if problems:
                    raise CommandFailed(
                        EXIT_DAMAGED,
                        f"{c.path}: would be kept but is damaged ({'; '.join(problems)}); nothing deleted."
                        " Move it aside or delete it by hand, then prune again",
                    )
            deleted, leftovers = [], []
            for c in plan["delete"]:
                try:
                    trashed = commit.trash(save_dir, c.path)
                except OSError as e:
                    done = ", ".join(d.name for d in deleted) or "none"
                    msg = f"{c.path}: cannot be moved aside to delete it ({e}); deleted: {done}"
                    raise CommandFailed(EXIT_USAGE, msg) from None
                deleted.append(c)
                try:
                    commit.remove_tree(trashed)
                except OSError as e:  # out of sight already; the next run start deletes it
                    leftovers.append(f"{trashed}: {e}")
            if deleted:
                commit.fsync_dir(save_dir)
    except LockedError as e:
        raise CommandFailed(EXIT_LOCKED, f"{e} Nothing deleted.") from None
    except OSError as e:
        raise CommandFailed(EXIT_USAGE, f"{save_dir}: cannot prune ({e}); expected a writable save_dir") from None
    return _report_prune(save_dir, plan, args, deleted=deleted, leftovers=leftovers)


def _plan_prune(save_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Which valid checkpoints retention keeps and deletes; the others are skipped (never touched)."""
    manager = CheckpointManager(save_dir, owner=False)
    infos = manager.list()
    done = _completion(manager)
    valid = [c for c in infos if c.status == "valid"]
    best = rank_best(infos)
    if args.keep_best and best.problem:
        raise CommandFailed(EXIT_DAMAGED, best.problem)
    rank = {c.step: i for i, c in enumerate(best.ranked)}
    policy = RetentionPolicy(
        keep_last=args.keep_last,
        keep_best=args.keep_best if best.metric else 0,
        metric=best.metric,
        mode=best.mode or "min",
    )
    kept = select_kept(
        policy,
        [Kept(c.step, c.manifest.best_value if c.step in rank else None) for c in valid],  # type: ignore[union-attr]
    )
    why: dict[int, list[str]] = {}
    for i, c in enumerate(valid):
        reasons = why.setdefault(c.step, [])
        if i == 0:
            reasons.append("latest")
        elif i < args.keep_last:
            reasons.append(f"last {args.keep_last}")
        if c.step in rank and rank[c.step] < args.keep_best:
            reasons.append(f"best #{rank[c.step] + 1} by {best.metric} ({best.mode})")
        if done and c.name == done.get("checkpoint"):
            reasons.append("complete.json")
            kept.add(c.step)
    return {
        "keep": [c for c in valid if c.step in kept],
        "delete": [c for c in valid if c.step not in kept],
        "skip": [c for c in infos if c.status != "valid"],
        "why": why,
        "best_metric": best.metric,
    }


def _report_prune(
    save_dir: Path, plan: dict[str, Any], args: argparse.Namespace, deleted: list[CheckpointInfo], leftovers: list[str]
) -> int:
    def row(c: CheckpointInfo) -> dict[str, Any]:
        return {
            "name": c.name,
            "step": c.step,
            "status": c.status,
            "bytes": _size(c),
            "why": plan["why"].get(c.step, []),
        }

    freed = sum(_size(c) for c in plan["delete"])
    if args.json:
        emit(
            {
                "dir": str(save_dir),
                "dry_run": not args.yes,
                "keep": [row(c) for c in plan["keep"]],
                "delete": [row(c) for c in plan["delete"]],
                "skipped": [row(c) for c in plan["skip"]],
                "deleted": [c.name for c in deleted],
                "bytes": freed,
                "leftovers": leftovers,
            }
        )
    else:
        verb = "deleted" if args.yes else "delete"
        table = [["keep", c.name, _log.size(_size(c)), ", ".join(plan["why"][c.step])] for c in plan["keep"]]
        table += [[verb, c.name, _log.size(_size(c)), ""] for c in plan["delete"]]
        table += [["skip", c.name, _log.size(_size(c)), f"{c.status}, never touched by prune"] for c in plan["skip"]]
        for line in _table(table, right={2}) if table else [f"{save_dir}: no checkpoints"]:
            print(line)
        if args.keep_best and not plan["best_metric"]:
            print("note: no checkpoint is marked best; --keep-best keeps nothing extra")
        n = len(plan["delete"])
        if args.yes:
            print(f"deleted {len(deleted)} checkpoint(s), {_log.size(freed)}")
        else:
            print(f"dry run: would delete {n} checkpoint(s), {_log.size(freed)}; pass --yes to delete")
        for left in leftovers:
            print(f"warning: could not finish deleting {left} (deleted at the next run start)", file=sys.stderr)
    return EXIT_OK


# ------------------------------------------------------------------- export


def cmd_export(args: argparse.Namespace) -> int:
    save_dir: Path = args.dir
    out: Path = args.out
    if out.is_dir():
        raise CommandFailed(EXIT_USAGE, f"{out}: is a directory; expected the path of a .safetensors file to write")
    if not out.parent.is_dir():
        raise CommandFailed(EXIT_USAGE, f"{out.parent}: no such directory (for --out {out})")
    if (out.exists() or out.is_symlink()) and not args.force:
        raise CommandFailed(EXIT_USAGE, f"{out}: exists; pass --force to overwrite it")
    manager = CheckpointManager(save_dir, owner=False)
    info = _resolve(save_dir, manager.list(), "latest" if args.step is None else args.step)
    if info.manifest is None or info.status != "valid":
        raise CommandFailed(EXIT_DAMAGED, f"{info.problem}; cannot export from it")
    expected = info.manifest.files.get(MODEL_FILE)
    src = info.path / MODEL_FILE
    if expected is None:
        raise CommandFailed(EXIT_DAMAGED, f"{info.path / commit.MANIFEST}: lists no {MODEL_FILE}")
    try:
        buf = read_verified(src, expected)  # a regular file, size and xxh3 as the manifest says; a private mapping
        tensors, metadata = tensorfile.parse(buf, str(src))
    except (CorruptCheckpointError, ValueError) as e:
        raise CommandFailed(EXIT_DAMAGED, f"{e}; nothing written") from None
    if not tensors:
        raise CommandFailed(EXIT_USAGE, f"{src}: holds no model weights (saved without a model); nothing written")
    metadata = {
        **metadata,
        "format": "pt",
        "preempt.source": str(info.path.resolve()),
        "preempt.step": str(info.step),
        "preempt.source_xxh3_128": expected.xxh3_128,
    }
    # The tensors are views into the verified mapping: written straight from it, in the writer's aligned layout.
    digest = _write_new(out, tensorfile.pieces(tensors, metadata), args.force)
    doc = {
        "source": str(info.path),
        "step": info.step,
        "out": str(out),
        "tensors": len(tensors),
        "bytes": digest.size,
        "xxh3_128": digest.xxh3_128,
    }
    if args.json:
        emit(doc)
    else:
        size = _log.size(digest.size)
        print(f"wrote {out} ({len(tensors)} tensors, {size}, xxh3 {digest.xxh3_128}) from {info.path}")
    return EXIT_OK


def _write_new(out: Path, pieces: Iterable[Any], force: bool) -> FileDigest:
    """Writes ``out`` atomically; without ``force`` an existing file (even one created meanwhile) is kept."""
    try:
        return commit.write_atomic(out, pieces, replace=force)
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
    step = commit.parse_checkpoint_name(args.dir.name)
    if step is None or any(commit.parse_checkpoint_name(p) is not None for p in os.listdir(args.dir)):
        return
    if not hasattr(args, "step"):
        raise CommandFailed(EXIT_USAGE, f"{args.dir}: is one checkpoint; expected its save_dir ({args.dir.parent})")
    if args.step is not None and args.step != step:
        raise CommandFailed(EXIT_USAGE, f"{args.dir}: is the checkpoint of step {step}, but STEP says {args.step}")
    args.dir, args.step = args.dir.parent, step


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "ls": cmd_ls,
    "verify": cmd_verify,
    "inspect": cmd_inspect,
    "prune": cmd_prune,
    "export": cmd_export,
}


def run(args: argparse.Namespace) -> int:
    """Runs the parsed command on its save_dir.

    Raises:
        CommandFailed: With the exit code and the message for stderr.
    """
    if not args.dir.exists():
        raise CommandFailed(EXIT_USAGE, f"{args.dir}: no such directory; expected a preempt save_dir")
    if not args.dir.is_dir():
        raise CommandFailed(EXIT_USAGE, f"{args.dir}: is a file; expected a preempt save_dir (a directory)")
    _checkpoint_as_dir(args)
    return COMMANDS[args.command](args)

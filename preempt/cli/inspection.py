"""``preempt inspect``: a checkpoint's manifest, tensor headers, optimizer, scheduler, RNG and provenance.

Reads only: tensor names, shapes and dtypes come from the safetensors headers, ``state.json`` is parsed as
JSON (never unpickled), and an RNG state is summarised by its size and digest.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import xxhash

from .. import _log
from ..checkpoint import names, safe_io, tensorfile
from ..checkpoint.files import read_verified, regular_file, unreadable
from ..checkpoint.manager import CheckpointInfo, CheckpointManager
from ..checkpoint.manifest import Manifest
from ..checkpoint.names import BASE_FILE, MODEL_FILE, STATE_FILE, STATE_JSON
from ..checkpoint.retention import best_note
from ..checkpoint.tensorfile import Entry, Header
from ..errors import CheckpointUnreadableError, CorruptCheckpointError
from .output import EXIT_DAMAGED, EXIT_OK, EXIT_UNREADABLE, CommandFailed, emit
from .views import fmt_table, fmt_utc, fmt_when, resolve

_MAX_STATE_JSON = 1 << 30  # state.json larger than this is not summarised by inspect
MAX_STATE_VALUES = 1 << 21  # nor one of more values: parsing a compact [{}, {}, ...] costs many times its text
_MAX_RNG_TENSOR = 1 << 20  # an RNG state is a few KiB; anything larger is not one


def _read_span(path: Path, header: Header, entry: Entry) -> bytes:
    fd = safe_io.open_fd(path)
    try:
        data = os.pread(fd, entry.end - entry.begin, header.data_start + entry.begin)
    finally:
        os.close(fd)
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
        cuda = s.get("cuda")
        cuda = cuda if isinstance(cuda, list) else []
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
        return out, [f"{info.path / names.MANIFEST}: lists no {STATE_JSON}"]
    if expected.size > _MAX_STATE_JSON:
        return out, [f"{jpath}: {expected.size} bytes; not summarised (limit {_MAX_STATE_JSON})"]
    try:
        data = read_verified(jpath, expected).tobytes()  # refuses what is not a regular file
        # depth and size of what parsing would make checked before parsing
        tree = safe_io.load_json(data, str(jpath), expect=None, max_values=MAX_STATE_VALUES)
    except CorruptCheckpointError as e:
        return out, [str(e)]
    except safe_io.TooManyValues as e:
        return out, [f"{e}: not summarised"]
    except ValueError as e:
        return out, [f"matches its digest but is not valid JSON: {e}"]
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
        "created_utc": fmt_utc(m.created),
        "format_version": m.format_version,
        "files": {name: d.to_json() for name, d in sorted(m.files.items())},
        "written_bytes": sum(d.size for d in m.files.values() if d.carried_from is None),
        "carried_bytes": sum(d.size for d in m.carried.values()),
        "metrics": m.metrics,
        "best": m.best,
        "is_best": m.is_best,
        "sampler": m.sampler,
        "lineage": m.lineage,
        "provenance": m.provenance,
    }


def inspectable(info: CheckpointInfo) -> Manifest:
    """The manifest of the checkpoint STEP chose, when it can be inspected.

    Raises:
        CommandFailed: Exit 4 when its manifest could not be read, 1 when it has no valid one.
    """
    if info.status == "unreadable":
        raise CommandFailed(EXIT_UNREADABLE, info.problem or f"{info.path}: unreadable")
    if info.manifest is None:
        raise CommandFailed(EXIT_DAMAGED, f"{info.problem}; expected a manifest.json written by a completed save")
    if info.status != "valid":
        raise CommandFailed(EXIT_DAMAGED, info.problem or f"{info.path}: {info.status}")
    return info.manifest


def rng_tensors(state_json: Any) -> set[str]:
    """The tensors of state.safetensors whose bytes inspect reads (the generators' states), named in the decoded
    ``state_json``; of the other files it reads the headers only."""
    rng = state_json.get("rng") if isinstance(state_json, dict) else None
    found: set[str] = set()

    def walk(v: Any) -> None:
        key = _ref(v)
        if key is not None:
            found.add(key)
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)
        elif isinstance(v, list):
            for x in v:
                walk(x)

    walk(rng)
    return found


def cmd_inspect(args: argparse.Namespace) -> int:
    save_dir: Path = args.dir
    manager = CheckpointManager(save_dir, owner=False)
    info = resolve(save_dir, manager.list(), "latest" if args.step is None else args.step)
    m = inspectable(info)
    limit = None if args.json or args.tensors == "all" else int(args.tensors)
    problems: list[str] = []
    tensors: dict[str, Any] = {}
    headers: dict[str, Header] = {}
    for name in (MODEL_FILE, BASE_FILE, STATE_FILE):
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
            if safe_io.resource_error(e):  # not damage: said as such (exit 4), by checkpoints.run
                raise CheckpointUnreadableError(unreadable(path, e)) from None
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


def _digest_text(g: dict[str, Any] | None) -> str:
    """A generator's state digest, or what stands in its place in words."""
    if not g or not g.get("present"):
        return "absent"
    return g.get("xxh3_64") or f"not hashed ({_log.size(g.get('bytes') or 0)}, larger than a generator's state)"


def _lineage_text(lineage: dict[str, Any]) -> str:
    """Where the checkpoint's timeline began, in words: a fresh start, or a resume request and what it loaded."""
    started = lineage.get("started")
    when = f" on {fmt_when(started)}" if isinstance(started, (int, float)) and not isinstance(started, bool) else ""
    request, source = lineage.get("request"), lineage.get("source")
    if request is None:
        return f"started fresh{when}" if source is None else f"started{when} from {source}"
    resume = request.get("resume") if isinstance(request, dict) else request
    weights = " (its weights only)" if isinstance(request, dict) and request.get("weights_only") else ""
    frm = f" from {source}" if source is not None else ""
    return f"started{when}{frm}{weights}, on the request resume={resume!r}"


def _print_inspect(
    info: CheckpointInfo, m: Manifest, tensors: dict[str, Any], st: dict[str, Any], limit: int | None
) -> None:
    c = m.cursor
    bpe = f" of {c.batches_per_epoch}" if c.batches_per_epoch >= 0 else ""  # -1: the loader's length is unknown
    sample = f", sample {c.sample}" if c.sample >= 0 else ""  # -1: its batch size is unknown
    print(f"{info.path}")
    print(f"  step {m.step}, epoch {c.epoch}, batch {c.batch}{bpe}{sample}, taken at the {c.point} boundary")
    print(f"  reason {m.reason}; created {fmt_when(m.created)} (local), {fmt_utc(m.created)}")
    if m.metrics:
        print(f"  metrics: {_kv(m.metrics)}")
    if m.best:
        print(f"  best: {best_note(m.best, m.is_best, m.step)}")
    if m.lineage:
        print(f"  lineage: {_lineage_text(m.lineage)}")
    if m.sampler:
        print(f"  sampler: {_kv(m.sampler)}")
    carried = sum(d.size for d in m.carried.values())
    written = sum(d.size for d in m.files.values()) - carried
    sizes = f"{_log.size(written)} written, {_log.size(carried)} carried"
    print(f"files (not re-hashed here; `preempt verify` does): {sizes}")
    how = {n: "written" if d.carried_from is None else f"carried from {d.carried_from}" for n, d in m.files.items()}
    rows = [[n, str(d.size), _log.size(d.size), d.xxh3_128, how[n]] for n, d in sorted(m.files.items())]
    for line in fmt_table(rows, right={1, 2}):
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
        for line in fmt_table(rows, right={3}) if rows else []:
            print(f"  {line}")
        if len(t["tensors"]) < t["count"]:
            print(f"  ... {t['count'] - len(t['tensors'])} more (--tensors all, or --json, lists every one)")
    opt = st["optimizer"]
    if opt is None:
        print("optimizer: none saved")
    else:
        cls = opt["class"] or "not recorded"
        keys = ", ".join(opt["state_keys"])
        held = f"state for {opt['state_params']} parameter(s): {keys}" if keys else "no per-parameter state yet"
        print(f"optimizer: class {cls}; {held}")
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
                parts.append(f"{gen} {_digest_text(s[gen])}")
            cuda = ", ".join(f"cuda:{d['device']} {_digest_text(d)}" for d in s["cuda"]) or "cuda none"
            print(f"  {snap}: {'; '.join(parts)}; {cuda}")
    if st["user_keys"]:
        print(f"user_state keys: {', '.join(st['user_keys'])}")
    if st["tracked"]:
        print(f"tracked: {', '.join(st['tracked'])}")
    p = m.provenance
    if p:
        packages = ("preempt", "torch", "numpy", "safetensors", "python", "cuda")
        versions = ", ".join(f"{k} {p[k]}" for k in packages if p.get(k))
        print(f"provenance: {versions}")
        git = p.get("git")  # what a manifest holds here is not checked: any JSON type may come
        git_s = f"{git.get('commit')}{' (dirty)' if git.get('dirty') else ''}" if isinstance(git, dict) else "unknown"
        slurm = p.get("slurm")
        slurm_s = _kv(slurm) if isinstance(slurm, dict) else "none"
        where = [f"{k} {p[k]}" for k in ("host", "pid") if p.get(k) is not None]
        print(f"  {', '.join([*where, f'git {git_s}', f'slurm {slurm_s}'])}")
        argv = p.get("argv")
        if argv:
            print(f"  argv: {' '.join(map(str, argv)) if isinstance(argv, list) else argv}")

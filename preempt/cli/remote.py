"""The checkpoint commands on a run's mirror in object storage: ``ls``, ``verify``, ``inspect`` and ``report`` given
its URL (``s3://bucket/prefix``, any fsspec URL) instead of a save_dir, and ``preempt pull URL DIR``.

The mirror (:mod:`preempt.mirror`) keeps a save_dir's layout as object names: ``<prefix>/step_N/<file>``, the
manifest uploaded last, the run's records (train.log, history.jsonl) at the prefix's root. Each command reads what
its local twin reads and hands it to the same code:

- ``ls``: one listing of the prefix and the manifest of each of the newest SHOWN steps (``--all``: every step's;
  read side by side, parsed by the strict parser, capped): a step is
  complete (``valid``) when its manifest is there and every object it lists is there with its size
  (:func:`preempt.mirror.plan.is_complete`, the rule the run pulls by); ``incomplete`` names what is missing (an
  upload not finished, or cut off); ``corrupt``: a manifest that does not parse, or an object of another size.
  Shown by :mod:`preempt.cli.listing`, as a save_dir's.
- ``verify``: each object downloaded into a temporary directory, one at a time, checked by
  :func:`preempt.checkpoint.files.check_file` (size, xxh3-128, format) and deleted.
- ``inspect``: a temporary copy of what the local inspect reads (the manifest, state.json, each safetensors file's
  header and the generators' states; a sparse file of the object's size around them), inspected by
  :func:`preempt.cli.inspection.cmd_inspect`.
- ``report``: history.jsonl copied into a temporary directory, reported by :func:`preempt.cli.report.cmd_report`.
- ``pull``: :func:`preempt.mirror.pull.pull` into DIR under the save_dir's lock (exit 3 while a run holds it).

Whatever names the temporary directory in the output is shown as the mirror's URL (without credentials, which
are never printed: neither the URL's userinfo nor a ``--mirror-option`` value). Credentials and endpoints come the
ecosystem's way (the AWS environment variables and profiles, or ``--mirror-option``). No torch here; fsspec is
imported by :mod:`preempt.mirror.store` when the mirror is opened.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import _log, _secrets
from ..checkpoint import names, safe_io, tensorfile
from ..checkpoint.files import check_file, read_manifest
from ..checkpoint.lock import DirLock, LockedError
from ..checkpoint.manager import CheckpointInfo
from ..checkpoint.manifest import MAX_MANIFEST_BYTES, Manifest
from ..checkpoint.names import BASE_FILE, MANIFEST, MODEL_FILE, STATE_FILE, STATE_JSON
from ..errors import CheckpointError, CorruptCheckpointError, MirrorError
from . import inspection, listing, report
from .output import EXIT_DAMAGED, EXIT_LOCKED, EXIT_OK, EXIT_UNREADABLE, EXIT_USAGE, CommandFailed, emit
from .views import resolve
from .where import is_url, mirror_options

if TYPE_CHECKING:
    from ..mirror.store import MirrorStore

LS_CHECKED_TEXT = (
    "status checked: each manifest (parsed, its own checksum, its step) and that every object it lists is in the"
    " mirror's listing with its size; the data is not hashed: preempt verify URL downloads and hashes every object"
)
SHOWN = 20  # the newest steps ls URL shows (and reads the manifests of) without --all
READERS = 8  # manifests read at once
_MAX_STATE_JSON = 1 << 30  # inspect's own limit (preempt.cli.inspection): a larger state.json is not copied either
_MAX_RNG_TENSOR = 1 << 20


class Mirror:
    """One mirror opened for one command: its store, its listing, and a temporary directory standing for it.

    A checkpoint's ``CheckpointInfo.path`` is ``tmp/step_N`` (where its objects are copied when a command reads
    them); :meth:`shown` turns that directory back into the URL in every text.
    """

    def __init__(self, store: MirrorStore, tmp: Path) -> None:
        self.store = store
        self.tmp = tmp
        self.url = store.display.rstrip("/")
        self.listing: dict[int, dict[str, int]] = {}
        self.manifest_bytes: dict[int, bytes] = {}
        self.hidden = 0  # the older steps ls did not show (nor read the manifests of)

    def shown(self, text: str) -> str:
        return text.replace(str(self.tmp), self.url)

    def place(self) -> listing.Place:
        return listing.Place(self.url, self.size_of, LS_CHECKED_TEXT, self.shown)

    def size_of(self, info: CheckpointInfo) -> int:
        if info.manifest is not None:
            return sum(d.size for d in info.manifest.files.values())
        return sum(self.listing.get(info.step, {}).values())

    # -- what the mirror holds ---------------------------------------------------------------------------------

    def infos(self, most: int | None = None) -> list[CheckpointInfo]:
        """The newest ``most`` steps under the prefix (None: every one), newest first, as ls judges them: one
        listing, and the manifest of each step judged, read side by side (READERS at once); older steps' manifests
        are not read (their count is :attr:`hidden`)."""
        self.listing = self.store.steps()
        steps = sorted(self.listing, reverse=True)
        self.hidden = 0 if most is None else max(0, len(steps) - most)
        return self.judge(steps if most is None else steps[:most])

    def judge(self, steps: list[int]) -> list[CheckpointInfo]:
        """The listed ``steps`` judged (their manifests read side by side), in the order given."""
        if len(steps) <= 1:
            return [self._info(s, self.listing[s]) for s in steps]
        with ThreadPoolExecutor(min(READERS, len(steps)), thread_name_prefix="preempt-ls") as readers:
            return list(readers.map(lambda s: self._info(s, self.listing[s]), steps))

    def chosen(self, selector: int | str) -> CheckpointInfo:
        """The checkpoint STEP names, its manifest and as few others as the choice needs read: a step, that one;
        ``latest``, the newest ones a round at a time until one is valid; ``best``, every one."""
        if selector == "best":
            return resolve(self.url, self.infos(), selector)
        self.listing = self.store.steps()
        steps = sorted(self.listing, reverse=True)
        if isinstance(selector, int):
            shown = [selector] if selector in self.listing else steps[:SHOWN]
            return resolve(self.url, self.judge(shown), selector)
        infos: list[CheckpointInfo] = []
        size = READERS
        while len(infos) < len(steps) and not any(c.status == "valid" for c in infos):
            infos += self.judge(steps[len(infos) : len(infos) + size])
            size = min(size * 4, 1000)
        return resolve(self.url, infos, selector)

    def _info(self, step: int, objects: dict[str, int]) -> CheckpointInfo:
        from ..mirror.plan import is_complete

        path = self.tmp / names.checkpoint_name(step)
        mpath = path / MANIFEST
        if MANIFEST not in objects:
            held = f"{len(objects)} object(s), {_log.size(sum(objects.values()))}"
            why = "an upload not finished or cut off, or a deletion not finished"
            return CheckpointInfo(path, step, "incomplete", problem=f"{mpath}: missing ({held} here: {why})")
        if objects[MANIFEST] > MAX_MANIFEST_BYTES:
            return CheckpointInfo(
                path, step, "corrupt", problem=f"{mpath}: {objects[MANIFEST]} bytes, more than {MAX_MANIFEST_BYTES}"
            )
        try:
            data = self.store.read(step, MANIFEST, MAX_MANIFEST_BYTES)
        except MirrorError as e:
            if e.errno == errno.ENOENT:  # deleted since the listing: a run's retention, or a replaced step
                return CheckpointInfo(path, step, "incomplete", problem=f"{mpath}: deleted since the listing")
            return CheckpointInfo(path, step, "unreadable", problem=str(e))
        try:
            manifest = Manifest.from_json(data, str(mpath))
        except ValueError as e:
            return CheckpointInfo(path, step, "corrupt", problem=str(e))
        if manifest.step != step:
            problem = f"{mpath}: records step {manifest.step}, directory says {step}"
            return CheckpointInfo(path, step, "corrupt", manifest, problem)
        self.manifest_bytes[step] = data
        missing = sorted(name for name in manifest.files if name not in objects)
        sizes = [
            f"{path / name}: size {objects[name]} bytes, manifest says {d.size}"
            for name, d in sorted(manifest.files.items())
            if name in objects and objects[name] != d.size
        ]
        lacks = [f"{path}: {len(missing)} of {len(manifest.files)} objects missing: {', '.join(missing)}"]
        if sizes:
            return CheckpointInfo(path, step, "corrupt", manifest, "; ".join(sizes + (lacks if missing else [])))
        if missing:
            return CheckpointInfo(path, step, "incomplete", manifest, lacks[0])
        assert is_complete(objects, manifest)  # the run's rule (what it pulls) and ls's say the same
        return CheckpointInfo(path, step, "valid", manifest)

    def gone(self, info: CheckpointInfo) -> bool:
        """Whether the step's manifest left the mirror meanwhile (its run's retention deleted it): not damage."""
        try:
            return MANIFEST not in self.store.steps().get(info.step, {})
        except MirrorError:
            return False

    # -- copies ------------------------------------------------------------------------------------------------

    def fetch(self, step: int, name: str) -> Path:
        """The object downloaded to ``tmp/step_N/name`` (nothing there when it is missing from the mirror)."""
        local = self.tmp / names.checkpoint_name(step) / name
        local.parent.mkdir(exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            local.unlink()
        if name in self.listing.get(step, {}):
            try:  # (the listed size: a large object's download gets its time, op_timeout + size / MIN_RATE)
                self.store.get(step, name, local, self.listing[step][name])
            except MirrorError as e:
                with contextlib.suppress(FileNotFoundError):
                    local.unlink()
                if e.errno != errno.ENOENT:  # gone meanwhile: checked as missing
                    raise
        return local

    def check_files(self, info: CheckpointInfo) -> list[Any]:
        """verify's checks of one mirrored checkpoint: each object downloaded, checked like a local file, deleted."""
        assert info.manifest is not None
        out = []
        for name, expected in info.manifest.files.items():
            try:
                local = self.fetch(info.step, name)
            except MirrorError as e:  # not damage: the mirror could not be read (unreachable, refused)
                from ..checkpoint.files import FileCheck

                out.append(FileCheck(name, info.path / name, expected, "unreadable", None, str(e)))
                continue
            out.append(check_file(local, expected))
            with contextlib.suppress(FileNotFoundError):
                local.unlink()
        return out

    def copy_for_inspect(self, info: CheckpointInfo) -> None:
        """What inspect reads of one checkpoint, copied to ``tmp/step_N``: the manifest and state.json whole; of
        each safetensors file its header and the generators' states, in a sparse file of the object's size."""
        m = info.manifest
        assert m is not None
        d = self.tmp / info.name
        d.mkdir(exist_ok=True)
        (d / MANIFEST).write_bytes(self.manifest_bytes[info.step])
        state_json: Any = None
        if STATE_JSON in m.files and m.files[STATE_JSON].size <= _MAX_STATE_JSON:
            path = self.fetch(info.step, STATE_JSON)
            with contextlib.suppress(OSError, ValueError):
                state_json = safe_io.load_json(
                    path.read_bytes(), str(path), expect=None, max_values=inspection.MAX_STATE_VALUES
                )
        for name in (MODEL_FILE, BASE_FILE, STATE_FILE):
            if name not in m.files:
                continue
            size = self.listing[info.step][name]
            local = d / name
            with open(local, "wb") as f:
                f.truncate(size)
                first = self.read_range(info.step, name, 0, min(8, size))
                hlen = int.from_bytes(first, "little") if len(first) == 8 else 0
                head = first + self.read_range(info.step, name, 8, 8 + min(hlen, tensorfile.MAX_HEADER_BYTES, size - 8))
                f.write(head)
            if name != STATE_FILE:
                continue
            try:
                header = tensorfile.read_header(local)
            except (OSError, ValueError):
                continue  # inspect says what is wrong with it
            wanted = inspection.rng_tensors(state_json)
            with open(local, "r+b") as f:
                for e in header.entries:
                    if e.name in wanted and e.end - e.begin <= _MAX_RNG_TENSOR:
                        start = header.data_start + e.begin
                        f.seek(start)
                        f.write(self.read_range(info.step, name, start, header.data_start + e.end))

    def read_range(self, step: int, name: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of one object."""
        return self.store.read_range(step, name, start, end) if end > start else b""


# ------------------------------------------------------------------ commands


def run(args: argparse.Namespace) -> int:
    """Runs the parsed command on a mirror (``args.dir`` is a :class:`~preempt.cli.where.Url`).

    Raises:
        CommandFailed: With the exit code and the message for stderr (2: no such bucket, no checkpoint, no client
            installed; 4: the mirror could not be reached or refused).
    """
    if not is_url(args.dir):
        raise CommandFailed(
            EXIT_USAGE,
            f"{args.dir}: expected a mirror's URL (s3://bucket/prefix, any scheme://); a save_dir needs no pull",
        )
    if args.command in ("prune", "export"):
        raise CommandFailed(
            EXIT_USAGE,
            f"{args.command} works on a local save_dir, not on a mirror's URL; a mirror's retention is its run's"
            f" (PreemptibleRun(mirror=...)). preempt pull URL DIR fetches a checkpoint to disk first",
        )
    try:
        options = mirror_options(getattr(args, "mirror_option", None))
    except argparse.ArgumentTypeError as e:
        raise CommandFailed(EXIT_USAGE, str(e)) from None
    url = _checkpoint_as_url(args)
    mirror = Mirror(_open(url, options), Path(tempfile.mkdtemp(prefix="preempt-mirror-")))
    try:
        with _shown(mirror, args.json):
            return COMMANDS[args.command](args, mirror)
    except CommandFailed as e:
        raise CommandFailed(e.code, mirror.shown(str(e))) from None
    except MirrorError as e:
        code = EXIT_USAGE if e.errno == errno.ENOENT else EXIT_UNREADABLE
        hint = "; expected the URL a run mirrors to (PreemptibleRun(mirror=...))" if code == EXIT_USAGE else ""
        raise CommandFailed(code, f"{mirror.shown(str(e))}{hint}") from None
    finally:
        shutil.rmtree(mirror.tmp, ignore_errors=True)


def _open(url: str, options: dict[str, Any]) -> MirrorStore:
    try:
        from ..mirror.store import MirrorStore
    except ImportError as e:  # pragma: no cover - the package is part of preempt
        raise CommandFailed(EXIT_USAGE, f"{e}") from None
    try:
        return MirrorStore(url, options)
    except (MirrorError, ValueError) as e:  # no client for the scheme, an unknown scheme, a bad option
        raise CommandFailed(EXIT_USAGE, str(e)) from None


def _checkpoint_as_url(args: argparse.Namespace) -> str:
    """The mirror's URL; the URL may name one checkpoint (``s3://b/run/step_000000120``), as DIR may locally.

    Raises:
        CommandFailed: For ``ls``, which lists a whole mirror, or when STEP names another checkpoint.
    """
    from ..mirror.store import redact

    url: str = args.dir
    parent, _, last = url.rstrip("/").rpartition("/")
    step = names.parse_checkpoint_name(last)
    if step is None or args.command in ("report", "pull") or "://" not in parent:
        return url
    if not hasattr(args, "step"):
        raise CommandFailed(
            EXIT_USAGE, f"{redact(url)}: is one checkpoint; expected its mirror's URL ({redact(parent)})"
        )
    if args.step is not None and args.step != step:
        raise CommandFailed(EXIT_USAGE, f"{redact(url)}: is the checkpoint of step {step}, but STEP says {args.step}")
    args.step = step
    return parent


@contextlib.contextmanager
def _shown(mirror: Mirror, as_json: bool) -> Iterator[None]:
    """stdout and stderr with the temporary directory shown as the mirror's URL (JSON-escaped under --json)."""
    url = json.dumps(mirror.url)[1:-1] if as_json else mirror.url
    out, err = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _Relabel(out, str(mirror.tmp), url), _Relabel(err, str(mirror.tmp), mirror.url)
    try:
        yield
    finally:
        sys.stdout, sys.stderr = out, err


class _Relabel:
    def __init__(self, stream: Any, old: str, new: str) -> None:
        self._stream, self._old, self._new = stream, old, new

    def write(self, text: str) -> int:
        # (a secret the command holds is never printed: an older run may have recorded it in a manifest's argv)
        return self._stream.write(_secrets.scrub(text.replace(self._old, self._new)))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def cmd_ls(args: argparse.Namespace, mirror: Mirror) -> int:
    infos = mirror.infos(None if getattr(args, "all", False) else SHOWN)
    return listing.ls(mirror.place(), infos, as_json=args.json, hidden=mirror.hidden)


def cmd_verify(args: argparse.Namespace, mirror: Mirror) -> int:
    infos = mirror.infos() if args.step is None else []
    if args.step is not None:
        infos = [mirror.chosen(args.step)]
    if not infos:
        raise CommandFailed(EXIT_USAGE, f"{mirror.url}: no checkpoints (expected step_* objects under the prefix)")
    place = mirror.place()
    t0 = time.perf_counter()
    results = [listing.verify_one(place, c, mirror.check_files, mirror.gone) for c in infos]
    return listing.verify_report(place, results, time.perf_counter() - t0, as_json=args.json)


def cmd_inspect(args: argparse.Namespace, mirror: Mirror) -> int:
    info = mirror.chosen("latest" if args.step is None else args.step)
    inspection.inspectable(info)
    mirror.copy_for_inspect(info)
    return inspection.cmd_inspect(argparse.Namespace(**{**vars(args), "dir": mirror.tmp, "step": info.step}))


def cmd_report(args: argparse.Namespace, mirror: Mirror) -> int:
    from ..health.history import HISTORY_FILE

    data = mirror.store.read_text(HISTORY_FILE)
    if data is None:
        raise CommandFailed(
            EXIT_USAGE,
            f"{mirror.url}/{HISTORY_FILE}: no such object; expected the history a run with mirror=... uploads"
            " after each checkpoint (log_file=True)",
        )
    (mirror.tmp / HISTORY_FILE).write_bytes(data)
    return report.cmd_report(argparse.Namespace(**{**vars(args), "dir": mirror.tmp}), where=mirror.url)


def cmd_pull(args: argparse.Namespace, mirror: Mirror) -> int:
    from ..mirror import pull

    save_dir: Path = args.save_dir
    if save_dir.exists() and not save_dir.is_dir():
        raise CommandFailed(EXIT_USAGE, f"{save_dir}: is a file; expected a save_dir (a directory) to pull into")
    try:
        save_dir.mkdir(parents=True, exist_ok=True)
        with DirLock(save_dir, purpose="preempt pull"):
            t0 = time.perf_counter()
            path = pull.pull(mirror.store, save_dir, step=args.step)
            seconds = time.perf_counter() - t0
    except LockedError as e:
        raise CommandFailed(EXIT_LOCKED, f"{e} Nothing pulled.") from None
    except CorruptCheckpointError as e:  # an object failed its digest: nothing committed
        raise CommandFailed(EXIT_DAMAGED, f"{e}; nothing pulled") from None
    except MirrorError:
        raise
    except CheckpointError as e:  # no complete checkpoint (at --step)
        raise CommandFailed(EXIT_USAGE, str(e)) from None
    except FileExistsError as e:  # that step is in DIR already
        raise CommandFailed(EXIT_USAGE, str(e)) from None
    except OSError as e:
        code = EXIT_UNREADABLE if safe_io.resource_error(e) else EXIT_USAGE
        raise CommandFailed(code, safe_io.describe_error(getattr(e, "filename", None) or save_dir, e)) from None
    manifest = read_manifest(path / MANIFEST)
    nbytes = sum(d.size for d in manifest.files.values())
    doc = {
        "url": mirror.url,
        "source": mirror.store.where(manifest.step),
        "step": manifest.step,
        "path": str(path),
        "files": len(manifest.files),
        "bytes": nbytes,
        "seconds": seconds,
    }
    if args.json:
        emit(doc)
    else:
        rate = f", {nbytes / seconds / 1e6:.1f} MB/s" if seconds > 0 and nbytes else ""
        print(
            f"pulled {doc['source']} into {path}: {len(manifest.files)} files, {_log.size(nbytes)}, each checked"
            f" against its manifest (size, xxh3-128), in {seconds:.2f} s{rate}"
        )
    return EXIT_OK


COMMANDS = {"ls": cmd_ls, "verify": cmd_verify, "inspect": cmd_inspect, "report": cmd_report, "pull": cmd_pull}

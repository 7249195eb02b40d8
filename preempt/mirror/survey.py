"""What the mirror holds: one listing, and the manifest of each step that has one (parsed strictly, capped).

The facts the pure decisions (:mod:`preempt.mirror.plan`) take. A manifest already read is not read again while the
listing shows the same size for it (the uploader surveys after every upload).
"""

from __future__ import annotations

import dataclasses
import errno
from concurrent.futures import ThreadPoolExecutor

from ..checkpoint.manifest import MAX_MANIFEST_BYTES, Manifest
from ..checkpoint.names import MANIFEST
from ..errors import MirrorError
from . import plan
from .store import MirrorStore


@dataclasses.dataclass(frozen=True)
class Survey:
    """One look at the mirror.

    Attributes:
        listing: Every step: {object name: size}.
        manifests: The manifest of each complete step (and only those).
        problems: Per step with a manifest that is not valid: why (a message naming the object).
    """

    listing: dict[int, dict[str, int]]
    manifests: dict[int, Manifest]
    problems: dict[int, str]

    @property
    def complete(self) -> list[int]:
        """The complete steps, oldest first."""
        return sorted(self.manifests)

    @property
    def newest(self) -> int | None:
        return max(self.manifests) if self.manifests else None


READERS = 8  # manifests read at once by a survey
SMALL_MANIFEST = 1 << 20  # bytes: a manifest read beside others (a checkpoint of a few hundred files)


class Surveyor:
    """Lists the mirror and reads the manifests, remembering those it read (by step and size)."""

    def __init__(self, store: MirrorStore) -> None:
        self.store = store
        self._seen: dict[tuple[int, int], Manifest | str] = {}

    def remember(self, manifest: Manifest, size: int) -> None:
        """A manifest this process wrote: not read back."""
        self._seen[(manifest.step, size)] = manifest

    def survey(self) -> Survey:
        """Raises MirrorError when the mirror cannot be listed; a manifest that cannot be read makes its step
        incomplete (with the reason in ``problems``), a manifest that vanished meanwhile too."""
        listing = self.store.steps()
        manifests: dict[int, Manifest] = {}
        problems: dict[int, str] = {}
        unread = [(s, o[MANIFEST]) for s, o in listing.items() if MANIFEST in o and (s, o[MANIFEST]) not in self._seen]
        # Many small manifests are read side by side (a prefix of thousands of steps costs what its slowest reads do);
        # a large one alone, so that parsing several never holds more than one large document at once.
        small = [k for k in unread if k[1] <= SMALL_MANIFEST]
        read = [(k, self._read(*k)) for k in unread if k[1] > SMALL_MANIFEST or len(small) == 1]
        if len(small) > 1:  # (a pass that finds one new manifest, the usual case, starts no thread)
            with ThreadPoolExecutor(min(READERS, len(small)), thread_name_prefix="preempt-survey") as pool:
                read += list(zip(small, pool.map(lambda k: self._read(*k), small), strict=True))
        for key, got in read:
            if got is not None:
                self._seen[key] = got
        for step, objects in listing.items():
            if MANIFEST not in objects:
                continue
            got = self._seen.get((step, objects[MANIFEST]))
            if isinstance(got, str):
                problems[step] = got
            elif got is not None and plan.is_complete(objects, got):
                manifests[step] = got
        live = {(s, o[MANIFEST]) for s, o in listing.items() if MANIFEST in o}
        self._seen = {k: v for k, v in self._seen.items() if k in live}
        return Survey(listing, manifests, problems)

    def _read(self, step: int, size: int) -> Manifest | str | None:
        where = self.store.where(step, MANIFEST)
        if size > MAX_MANIFEST_BYTES:
            return f"{where}: {size} bytes; a manifest is at most {MAX_MANIFEST_BYTES}"
        try:
            data = self.store.read(step, MANIFEST, MAX_MANIFEST_BYTES)
        except MirrorError as e:
            if e.errno == errno.ENOENT:  # deleted since the listing (a replaced or pruned step)
                return None
            raise
        try:
            manifest = Manifest.from_json(data, where)
        except ValueError as e:
            return str(e)
        if manifest.step != step:
            return f"{where}: the manifest is of step {manifest.step}, not {step}"
        return manifest

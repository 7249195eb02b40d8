"""What the mirror holds: one listing, and the manifests of the steps a decision needs (parsed strictly, capped).

The facts the pure decisions (:mod:`preempt.mirror.plan`) take. A listing costs its pages; a manifest costs a GET,
so none is read that a decision does not need: a run's start reads the newest ones until one is complete
(:meth:`Surveyor.newest_complete`), its uploader those of its own steps and retention's (:func:`plan.undecided`),
``preempt ls URL`` those it shows. A bucket of thousands of junk or old steps costs their listing, not their reads.
A manifest already read is not read again while the listing shows the same size for it (the uploader surveys after
every upload).
"""

from __future__ import annotations

import dataclasses
import errno
from collections.abc import Iterable, Iterator
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
        manifests: The manifest of each complete step among those read (and only those).
        problems: Per step with a manifest read that is not valid: why (a message naming the object).
        read: The steps whose manifest was read (or remembered), valid or not.
    """

    listing: dict[int, dict[str, int]]
    manifests: dict[int, Manifest]
    problems: dict[int, str]
    read: set[int] = dataclasses.field(default_factory=set)

    @property
    def complete(self) -> list[int]:
        """The complete steps among those read, oldest first."""
        return sorted(self.manifests)

    @property
    def newest(self) -> int | None:
        return max(self.manifests) if self.manifests else None

    @property
    def unread(self) -> set[int]:
        """The steps whose listing shows a manifest that was not read."""
        return {s for s, o in self.listing.items() if MANIFEST in o} - self.read


READERS = 8  # manifests read at once
SMALL_MANIFEST = 1 << 20  # bytes: a manifest read beside others (a checkpoint of a few hundred files)
BATCHES = (8, 32, 128)  # manifests read per round while looking for the newest complete step (then the last, again)


class Surveyor:
    """Lists the mirror and reads the manifests asked for, remembering those it read (by step and size)."""

    def __init__(self, store: MirrorStore) -> None:
        self.store = store
        self._seen: dict[tuple[int, int], Manifest | str] = {}
        self.reads = 0  # manifests read from the mirror (GETs), for the tests and the debug log

    def remember(self, manifest: Manifest, size: int) -> None:
        """A manifest this process wrote: not read back."""
        self._seen[(manifest.step, size)] = manifest

    def survey(self, wanted: Iterable[int] | None = None) -> Survey:
        """One listing, and the manifests of the ``wanted`` steps (None: every step's) read; those read before (with
        the size listed now) are in it too.

        Raises MirrorError when the mirror cannot be listed; a manifest that cannot be read makes its step
        incomplete (with the reason in ``problems``), a manifest that vanished meanwhile too."""
        listing = self.store.steps()
        live = {(s, o[MANIFEST]) for s, o in listing.items() if MANIFEST in o}
        self._seen = {k: v for k, v in self._seen.items() if k in live}
        surveyed = Survey(listing, {}, {})
        for step, objects in listing.items():
            if MANIFEST in objects and (step, objects[MANIFEST]) in self._seen:
                self._note(surveyed, step)
        self.read(surveyed, listing if wanted is None else wanted)
        return surveyed

    def read(self, surveyed: Survey, steps: Iterable[int]) -> None:
        """The manifests of ``steps`` (those the listing shows one for and not read yet) read into ``surveyed``:
        small ones side by side, a large one alone (parsing several never holds more than one large document)."""
        asked = [(s, surveyed.listing[s][MANIFEST]) for s in sorted(set(steps) & surveyed.unread, reverse=True)]
        keys = [k for k in asked if k not in self._seen]  # (one remembered since the listing is not read back)
        small = [k for k in keys if k[1] <= SMALL_MANIFEST]
        got = [(k, self._read(*k)) for k in keys if k[1] > SMALL_MANIFEST or len(small) == 1]
        if len(small) > 1:  # (a pass that finds one new manifest, the usual case, starts no thread)
            with ThreadPoolExecutor(min(READERS, len(small)), thread_name_prefix="preempt-survey") as readers:
                got += list(zip(small, readers.map(lambda k: self._read(*k), small), strict=True))
        self.reads += len(keys)
        for key, manifest in got:
            if manifest is not None:
                self._seen[key] = manifest
        for step, _ in asked:
            self._note(surveyed, step)

    def newest_complete(self, surveyed: Survey, newer_than: int | None = None) -> Iterator[int]:
        """The complete steps newer than ``newer_than``, newest first, their manifests read a round at a time
        (BATCHES, side by side) as the caller asks for more: a caller that takes the first reads about one round."""
        candidates = plan.pull_candidates((s for s, o in surveyed.listing.items() if MANIFEST in o), newer_than)
        done, rounds = 0, 0
        while done < len(candidates):
            size = BATCHES[min(rounds, len(BATCHES) - 1)]
            batch = candidates[done : done + size]
            self.read(surveyed, batch)
            done, rounds = done + len(batch), rounds + 1
            yield from (s for s in batch if s in surveyed.manifests)

    def _note(self, surveyed: Survey, step: int) -> None:
        """What was read of ``step``'s manifest, put in ``surveyed``."""
        objects = surveyed.listing[step]
        got = self._seen.get((step, objects[MANIFEST]))
        surveyed.read.add(step)
        if isinstance(got, str):
            surveyed.problems[step] = got
        elif got is not None and plan.is_complete(objects, got):
            surveyed.manifests[step] = got

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

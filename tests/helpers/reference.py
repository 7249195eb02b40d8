"""The uninterrupted runs the resumed ones are compared with: each made once per test session, whatever its launcher,
and shared by the xdist workers (the first to ask makes it under a lock on its file, the others wait and read it;
an uninterrupted run ends bit for bit the same wherever it runs)."""

from __future__ import annotations

import fcntl
import hashlib
import shutil
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from .distributed import torchrun
from .processes import TESTS, TRAIN, TRAIN_DDP, Spawned, train_cmd

TIMEOUT_S = 300.0
TRAIN_RECORDED = TESTS / "scripts" / "train_recorded.py"  # train.py, the live state of every step recorded


def run_to_end(p: Spawned, timeout: float = TIMEOUT_S) -> Spawned:
    """Waits for ``p`` and asserts that it completed (exit 0)."""
    rc = p.finish(timeout)
    assert rc == 0, f"exit {rc}:\n{p.output}"
    return p


class References:
    """The ``reference`` fixture: ``reference(args)`` for ``tests/scripts/train.py``, ``reference(args, script=...)``
    for another training script of the suite (``--save_dir``, ``--final_out``), ``reference.torchrun(args)`` for
    ranks under torchrun, and :meth:`made` for any other launcher."""

    def __init__(self, shared: Path) -> None:
        """``shared``: a directory every worker of this session sees (and no other session)."""
        self.shared = shared
        self._made: dict[tuple[str, ...], Path] = {}

    def made(self, key: Sequence[str], make: Callable[[Path], object]) -> Path:
        """The directory into which ``make`` wrote an uninterrupted run's files. ``key`` names everything that
        decides what ``make`` produces (its launcher, script and arguments): ``make`` runs once per key in the
        session, in a fresh directory (a failed attempt's files are removed before the next)."""
        key = tuple(str(k) for k in key)
        if key not in self._made:
            d = self.shared / hashlib.sha256("\0".join(key).encode()).hexdigest()[:20]
            d.mkdir(parents=True, exist_ok=True)
            out = d / "out"
            with open(d / "lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or when this worker dies
                if not (d / "done").exists():
                    shutil.rmtree(out, ignore_errors=True)
                    out.mkdir()
                    make(out)
                    (d / "done").write_text("\n".join(key))
            self._made[key] = out
        return self._made[key]

    def __call__(self, args: Sequence[str], script: Path = TRAIN) -> Path:
        """The final state (``--final_out``) of an uninterrupted run of ``script`` with ``args``."""

        def make(d: Path) -> None:
            run_to_end(Spawned(train_cmd(d / "run", d / "final.safetensors", args, script)))

        return self.made(("python", str(script), *args), make) / "final.safetensors"

    def torchrun(self, args: Sequence[str], script: Path = TRAIN_DDP, nproc: int = 2) -> Path:
        """The ``--final_out`` of an uninterrupted run of ``script`` on ``nproc`` ranks under torchrun (the ranks'
        files beside it: :func:`helpers.ddp_finals`)."""

        def make(d: Path) -> None:
            run_to_end(torchrun(d / "run", d / "final.safetensors", args, nproc, script))

        return self.made(("torchrun", str(nproc), str(script), *args), make) / "final.safetensors"

    def recorded(self, args: Sequence[str]) -> Path:
        """The live state of every step of an uninterrupted run of ``tests/scripts/train.py`` with ``args``
        (``tests/scripts/train_recorded.py``): the directory of its records, which every kept checkpoint of a run
        with the same training arguments must equal at its step (:func:`helpers.kept.assert_kept_equal_live`)."""

        def make(d: Path) -> None:
            cmd = [sys.executable, str(TRAIN_RECORDED), "--live_dir", str(d / "live"), "--save_dir", str(d / "run")]
            run_to_end(Spawned([*cmd, *args]))

        return self.made(("python", str(TRAIN_RECORDED), *args), make) / "live"

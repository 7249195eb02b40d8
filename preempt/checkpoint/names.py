"""The names in a ``save_dir``: a checkpoint's directory (one name per step), its files, and the hidden names of
the commit protocol (:mod:`preempt.checkpoint.commit`). Every module spells a name through this one; no I/O.
"""

from __future__ import annotations

import os
import re
import secrets
import socket

MANIFEST = "manifest.json"
MODEL_FILE = "model.safetensors"  # the model's state_dict (without BASE_FILE's tensors)
BASE_FILE = "base.safetensors"  # the model's frozen parameters that no optimizer holds (likely unchanged: carried)
SHARD_BASE = "base_{rank:05d}.safetensors"  # sharded state: rank r's pieces of that base (preempt.cluster.sharded)
SHARD_PIECES = "pieces_{rank:05d}.safetensors"  # sharded state: rank r's pieces of the model's and optimizer's rest
STATE_FILE = "state.safetensors"  # every other tensor
STATE_JSON = "state.json"  # everything else (no pickle)
COMPLETE = "complete.json"
QUARANTINE = "quarantine"
QUARANTINED = "quarantined-"  # a broken checkpoint set aside in place, where quarantine/ cannot be used
SUPERSEDED = "superseded"
TMP_PREFIX = ".tmp-"  # step 1's hidden directories
REPLACED = ".replaced-"
TRASH = ".trash-"
_STEP_RE = re.compile(r"step_([0-9]+)", re.ASCII)  # used with fullmatch

MAX_STEP = 10**15 - 1  # the largest step a checkpoint holds: 15 digits; the writer, the names and manifests agree


def checkpoint_name(step: int) -> str:
    """``120`` -> ``"step_000000120"`` (sorts by step up to 10**9 steps).

    Raises:
        ValueError: ``step`` is negative or beyond :data:`MAX_STEP` (no reader would accept that checkpoint).
    """
    if not 0 <= step <= MAX_STEP:
        raise ValueError(f"step {step}: a checkpoint's step is in [0, {MAX_STEP}]")
    return f"step_{step:09d}"


def parse_checkpoint_name(name: str) -> int | None:
    """The step of a checkpoint directory name, or None for other names: only the one name each step has
    (``step_4``, ``step_0000000004`` or a step beyond :data:`MAX_STEP` are not checkpoints, so that no two
    directories stand for one step)."""
    m = _STEP_RE.fullmatch(name)
    if m is None or len(m.group(1)) > 15:
        return None
    step = int(m.group(1))
    return step if checkpoint_name(step) == name else None


def is_shard_file(name: str) -> bool:
    """``name`` is one of some rank's files of pieces (:data:`SHARD_BASE`, :data:`SHARD_PIECES`)."""
    return re.fullmatch(r"(base|pieces)_\d{5,}\.safetensors", name) is not None


def tag() -> str:
    """A suffix unique to this host, process and call, for the hidden names (``.tmp-step_N-<tag>``)."""
    host = re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname())[:40]
    return f"{host}-{os.getpid()}-{secrets.token_hex(4)}"

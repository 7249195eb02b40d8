"""Checkpoint and state tensors compared bit for bit, files damaged on purpose, what a checkpoint wrote."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file

MiB = 1 << 20


def assert_same_final(expected: Path, actual: Path) -> None:
    """Every tensor of the final state equal under torch.equal (bit for bit)."""
    a, b = load_file(str(expected)), load_file(str(actual))
    assert a.keys() == b.keys(), f"different state keys: {sorted(a.keys() ^ b.keys())}"
    differing = [k for k in sorted(a) if not torch.equal(a[k], b[k])]
    assert not differing, f"{len(differing)} of {len(a)} tensors differ from the uninterrupted run: {differing[:8]}"


def flip_bit(path: Path) -> None:
    """One bit flipped in the middle of a file, in place: every name of its inode (every checkpoint that carries
    it, :mod:`preempt.checkpoint.carry`) sees it."""
    at = os.stat(path).st_size // 2
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x40]))


def checkpoint_tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every tensor file of a checkpoint (every rank's too), keyed ``file:key``; sharded state's
    tensors that DCP wrote, whole, keyed ``dcp:key``."""
    out: dict[str, torch.Tensor] = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        out.update({f"{f.name}:{k}": v for k, v in load_file(str(f)).items()})
    if (ckpt / "dcp_metadata.json").is_file():
        out.update({f"dcp:{k}": v for k, v in dcp_tensors(ckpt).items()})
    return out


def dcp_tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    """The tensors DCP wrote into a checkpoint of sharded state, whole (read in this process, by DCP's reader)."""
    import torch.distributed.checkpoint as dcp

    from preempt._torch_compat import dcp_no_dist
    from preempt.cluster import sharded

    doc = json.loads((ckpt / "dcp_metadata.json").read_text())
    tensors = {k: torch.zeros(e["size"], dtype=getattr(torch, e["dtype"])) for k, e in doc["tensors"].items()}
    with sharded._single_process_quiet():
        dcp.load(tensors, storage_reader=sharded._reader(ckpt), **dcp_no_dist(dcp.load, True))
    return tensors


def model_and_optimizer_tensors(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Copies of a model's and its optimizer's tensors, named ``model.KEY`` and ``opt.PARAM.KEY``."""
    out = {f"model.{k}": v.clone() for k, v in model.state_dict().items()}
    for pid, s in opt.state_dict()["state"].items():
        out.update({f"opt.{pid}.{k}": v.clone() for k, v in s.items() if isinstance(v, torch.Tensor)})
    return out


def read_into(path: Path, model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The checkpoint at ``path`` applied to a fresh ``model`` and ``opt``: their tensors, as
    :func:`model_and_optimizer_tensors` names them."""
    from preempt import CheckpointManager
    from preempt.checkpoint import state

    manager = CheckpointManager(path.parent, owner=False)
    info = next(c for c in manager.list() if c.path == path)
    state.apply(state.Components(model, opt), manager.read(info))
    return model_and_optimizer_tensors(model, opt)


def changed_bytes(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> int:
    """The bytes of the tensors that differ between two checkpoints (or are new)."""
    return sum(
        v.numel() * v.element_size() for k, v in after.items() if k not in before or not torch.equal(before[k], v)
    )


def assert_writes_what_changed(
    ckpts: Sequence[Path], carried: str | Sequence[str] = "base.safetensors"
) -> list[tuple[str, int, int]]:
    """Each checkpoint after the first (in order) lists ``carried`` (a file or several) as carried (``carried_from``
    in its manifest) and wrote at most twice the bytes of the tensors that changed since the one before, plus 1 MiB
    (JSON, headers).

    Written: the bytes of the files whose inode no checkpoint before it in ``ckpts`` holds (a hard link writes
    nothing). Returns ``(name, written, changed)`` of each, for the test's report.
    """
    seen: set[int] = set()
    previous: dict[str, torch.Tensor] | None = None
    report: list[tuple[str, int, int]] = []
    for ckpt in ckpts:
        written = 0
        for f in ckpt.iterdir():
            st = os.stat(f)
            if st.st_ino not in seen:
                written += st.st_size
                seen.add(st.st_ino)
        now = checkpoint_tensors(ckpt)
        if previous is not None:
            files = json.loads((ckpt / "manifest.json").read_text())["files"]
            changed = changed_bytes(previous, now)
            report.append((ckpt.name, written, changed))
            for name in [carried] if isinstance(carried, str) else carried:
                assert files[name].get("carried_from") is not None, (ckpt.name, name, files[name], report)
            assert written <= 2 * changed + MiB, (ckpt.name, written, changed, report)
        previous = now
    return report


def direct_io_supported(directory: Path) -> bool:
    """Files in ``directory`` can be opened O_DIRECT (ext4, xfs; not every tmpfs): checkpoints there bypass the page
    cache; elsewhere they are written through it (preempt.checkpoint.direct_io), and a test says which it expects."""
    probe = directory / ".o_direct_probe"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT)
    except (AttributeError, OSError):  # no O_DIRECT on this OS, or refused here
        return False
    os.close(fd)
    probe.unlink()
    return True

"""Sharded state (FSDP2, DTensor): each rank's pieces in files of its own, inside our commit, loadable on any number
of ranks.

A model whose state dict holds DTensors (``fully_shard``, tensor parallelism) cannot be written by one rank: each
rank holds a piece. Each rank writes its local pieces of the model's and optimizer's tensors into safetensors files
of its own, whose metadata says where each piece lies in the whole tensor (:func:`pieces_apart`):
``base_0000R.safetensors`` for the frozen base of a fine-tuning (parameters with ``requires_grad=False`` that no
optimizer holds), which the next checkpoint links while it is unchanged (:mod:`preempt.checkpoint.carry`), and
``pieces_0000R.safetensors`` for the rest. A plain tensor (replicated, as the optimizer's step counts) is written by
rank 0 alone. Loading copies into whatever sharding the model has now, one process included (:func:`load_pieces`).
Writing them costs no collective beyond the commit's own: each rank writes its files, as under DDP.

What no file of pieces can describe (a replicated or partial DTensor, a ShardedTensor) goes through
torch.distributed.checkpoint (DCP), whose planner writes each rank's pieces (``__<rank>_0.distcp``) and reads, on
loading, whatever the current sharding needs; checkpoints written before the files of pieces existed hold every
tensor there. DCP's own index of the pieces is a pickle (``.metadata``), and this project opens no pickle:
:class:`_Writer` and :class:`_Reader` keep DCP's data files and write the index as JSON instead
(``dcp_metadata.json``), parsed strictly (only tensor entries, known dtypes, plain layout, no transforms). Every
file is listed with its digest in the manifest and verified before anything reads it.

Everything else (scheduler, scaler, tracked objects, the optimizer's param groups, RNG, cursor) goes the usual way
(JSON and safetensors, :mod:`preempt.checkpoint.state`). The optimizer's state is keyed by parameter name, so the
same checkpoint loads into an unsharded model and optimizer on one process.

In the background (``async_save``, under torch.distributed): each rank copies its files into host buffers, and the
ranks' writers run the commit's collectives on a group of their own; what DCP writes, if any, is handed DTensors rebuilt
around copies of their local pieces (:func:`staged`).
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from .._torch_compat import (
    dcp_metadata,
    dcp_metadata_version,
    dcp_no_dist,
    dcp_storage_info,
    dtensor_local,
    local_piece,
    sharded_tensor_types,
)
from ..checkpoint import codec
from ..checkpoint.manager import SHARDED_INDEX
from ..checkpoint.pieces import LAYOUT, Box, check_apart, layout_of, overlap
from ..checkpoint.state import Payload

METADATA = SHARDED_INDEX
_FORMAT = "preempt-dcp-1"
_DTYPES = {
    str(t).removeprefix("torch."): t
    for t in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}
_MODEL, _OPTIM = "model.", "optim."


def is_sharded(model: torch.nn.Module | None) -> bool:
    """The model's state dict holds DTensors (or ShardedTensors): one rank cannot write it alone."""
    if model is None:
        return False
    kinds = sharded_tensor_types()
    return any(isinstance(v, kinds) for v in model.state_dict().values())


def split_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[dict[str, Any], Any]:
    """(the tensors DCP writes; the rest of the optimizer's state, as JSON).

    Tensors are keyed ``model.<fqn>`` and ``optim.<fqn>.<key>`` by parameter
    name, so that any sharding (or none) of the same model finds them. They
    are the live tensors, not copies: loading writes into them in place.
    Nothing here steps or otherwise changes the optimizer.
    """
    tensors: dict[str, Any] = {f"{_MODEL}{k}": v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    rest: dict[str, Any] = {"param_groups": [], "state": {}}
    if optimizer is None:
        return tensors, rest
    names = {id(p): n for n, p in model.named_parameters()}
    for param, per_param in optimizer.state.items():
        fqn = names.get(id(param))
        if fqn is None:
            raise ValueError("sharded state: the optimizer holds a parameter that is not the model's")
        for key, value in per_param.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{_OPTIM}{fqn}.{key}"] = value
            else:
                rest["state"].setdefault(fqn, {})[key] = value
    for group in optimizer.param_groups:
        hyper = {k: v for k, v in group.items() if k != "params"}
        rest["param_groups"].append({**hyper, "params": [names.get(id(p), "?") for p in group["params"]]})
    return tensors, rest


def local_payload(tensors: dict[str, Any]) -> Payload:
    """This rank's own pieces of ``tensors`` (a DTensor's local shard) as a payload, to stage in host buffers."""
    return Payload(tensor_files={"shards": ({k: _local(v) for k, v in tensors.items()}, {})}, json_files={})


def staged(tensors: dict[str, Any], copy: Payload, cache: dict[str, Any] | None = None) -> dict[str, Any]:
    """``tensors`` rebuilt over their staged local pieces (``copy``, from :func:`local_payload`): DCP writes these.

    A DTensor keeps its mesh, placements, global shape and stride around its
    copied local shard, so that DCP plans the same pieces as from the live state.
    ``cache`` keeps the rebuilt DTensors from one snapshot to the next while
    their buffers and layout stay the same (building hundreds costs tens of ms).
    """
    from torch.distributed.tensor import DTensor

    pieces = copy.tensor_files["shards"][0]
    out: dict[str, Any] = {}
    for key, v in tensors.items():
        buf = pieces[key]
        if not isinstance(v, DTensor):
            out[key] = buf
            continue
        layout = (v.device_mesh, v.placements, v.shape, v.stride())
        hit = None if cache is None else cache.get(key)
        if hit is not None and hit[0] is buf and hit[1] == layout:
            out[key] = hit[2]
            continue
        out[key] = DTensor.from_local(buf, *layout[:2], run_check=False, shape=v.shape, stride=v.stride())
        if cache is not None:
            cache[key] = (buf, layout, out[key])
    return out


def _local(v: Any) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return dtensor_local(v) if isinstance(v, DTensor) else v


def save(directory: Path, tensors: dict[str, Any], rank: int, group: Any = None) -> list[str]:
    """Writes this rank's pieces (a collective under torch.distributed, on ``group``); returns its files' names."""
    import torch.distributed.checkpoint as dcp

    with _single_process_quiet():
        alone = dcp_no_dist(dcp.save, not _distributed())
        dcp.save(tensors, storage_writer=_writer(directory), process_group=group, **alone)
    mine = [f"__{rank}_0.distcp"]
    if rank == 0:
        mine.append(METADATA)
    return [n for n in mine if (directory / n).exists()]


def load_into(
    directory: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    rest: Any,
    where: str,
    files: Sequence[tuple[str, dict[str, torch.Tensor], dict[str, str]]] = (),
) -> None:
    """Loads a sharded checkpoint into ``model`` and ``optimizer`` as they are sharded now (any world size).

    ``files``: the ranks' files of pieces (path, tensors, metadata), verified: their pieces are copied into the
    live tensors (:func:`load_pieces`); DCP reads the rest, from a checkpoint that has DCP's files.

    Raises:
        ValueError: The optimizer's saved groups do not match this one's, or the base's pieces do not fit the model.
    """
    import torch.distributed.checkpoint as dcp

    if optimizer is not None:
        if not isinstance(rest, dict) or not isinstance(rest.get("param_groups"), list):
            raise ValueError(f"{where}: sharded optimizer state: expected param_groups")
        _materialize(optimizer)
    tensors, now = split_state(model, optimizer)
    pieces = read_pieces(files)
    for key in pieces:
        if key not in tensors:
            raise ValueError(f"{directory}: holds {key!r}, which the model and optimizer have not")
    rest_of = {k: v for k, v in tensors.items() if k not in pieces}
    if rest_of and (directory / METADATA).is_file():
        with _single_process_quiet():  # in place
            dcp.load(rest_of, storage_reader=_reader(directory), **dcp_no_dist(dcp.load, not _distributed()))
    elif rest_of:
        raise ValueError(f"{directory}: holds no {sorted(rest_of)[0]!r}")
    load_pieces(tensors, pieces, f"{directory} (the ranks' files of pieces)")
    if optimizer is None:
        return
    saved = rest["param_groups"]
    if [g.get("params") for g in saved] != [g["params"] for g in now["param_groups"]]:
        raise ValueError(f"{where}: the optimizer's parameter groups differ from the checkpoint's")
    for group, hyper in zip(optimizer.param_groups, saved, strict=True):
        group.update({k: v for k, v in hyper.items() if k != "params"})
    names = {id(p): n for n, p in model.named_parameters()}
    for param, per_param in optimizer.state.items():
        per_param.update((rest.get("state") or {}).get(names[id(param)], {}))


# ------------------------------------------------------------------ each rank's pieces, in files of its own

# the saved pieces of each tensor, by key: (its whole shape, [(where a piece begins, the piece)])
Pieces = dict[str, tuple[tuple[int, ...], list[tuple[tuple[int, ...], torch.Tensor]]]]
TensorFile = tuple[dict[str, torch.Tensor], dict[str, str]]  # tensors and metadata, as a payload holds a file


def pieces_apart(
    tensors: dict[str, Any], rank: int, frozen: set[str]
) -> tuple[dict[str, Any], TensorFile | None, TensorFile | None]:
    """(what is left for DCP; this rank's pieces of the frozen base; its pieces of the rest), as tensor files.

    A DTensor sharded on every mesh dimension (FSDP2's parameters and their optimizer state) contributes its local
    piece; a plain tensor (replicated: every rank holds the same, as the optimizer's step counts) is written by
    rank 0 alone, whole. Each file's metadata records every tensor's whole shape and where its piece begins
    (:data:`LAYOUT`), so that any number of ranks can load them (:func:`load_pieces`). The frozen base
    (``model.<key>`` for ``key`` in ``frozen``: :func:`state.frozen_keys`) goes into a file of its own, which the
    next checkpoint carries while it is unchanged. Anything else (a replicated or partial DTensor, a ShardedTensor)
    is left for DCP.
    """
    from torch.distributed.tensor import DTensor, Shard

    kept: dict[str, Any] = {}
    files: tuple[dict[str, Any], dict[str, Any]] = ({}, {})  # (base, rest): key -> (piece, layout)
    for key, v in tensors.items():
        if isinstance(v, DTensor):
            if not all(isinstance(p, Shard) for p in v.placements):
                kept[key] = v
                continue
            try:
                piece, offset = local_piece(v)
            except ValueError:  # a layout this cannot describe
                kept[key] = v
                continue
        elif type(v) is torch.Tensor:
            if rank != 0:
                continue
            piece, offset = v, (0,) * v.dim()
        else:
            kept[key] = v
            continue
        base = key.startswith(_MODEL) and key[len(_MODEL) :] in frozen
        files[0 if base else 1][key] = (piece, {"size": list(v.shape), "offset": list(offset)})
    base_file, rest_file = (_tensor_file(f) for f in files)
    return kept, base_file, rest_file


def _tensor_file(entries: dict[str, tuple[torch.Tensor, dict[str, Any]]]) -> TensorFile | None:
    if not entries:
        return None
    layout = {key: where for key, (_, where) in sorted(entries.items())}
    meta = {"format": "pt", LAYOUT: json.dumps(layout, sort_keys=True, separators=(",", ":"))}
    return {key: piece for key, (piece, _) in sorted(entries.items())}, meta


def read_pieces(files: Sequence[tuple[str, dict[str, torch.Tensor], dict[str, str]]]) -> Pieces:
    """Every tensor's whole shape and its saved pieces (offset, tensor), from the ranks' files of pieces (path,
    tensors, metadata).

    Raises:
        ValueError: A file's layout is missing or does not describe its tensors (naming the file and the tensor),
            two files disagree on a tensor's shape or dtype, or two pieces of a tensor overlap.
    """
    out: Pieces = {}
    dtypes: dict[str, torch.dtype] = {}
    boxes: dict[str, list[Box]] = {}
    for where, tensors, meta in files:
        layout = layout_of(meta, {k: tuple(t.shape) for k, t in tensors.items()}, where)
        for key, t in tensors.items():
            size, offset = layout[key]
            whole, saved = out.setdefault(key, (size, []))
            if whole != size or dtypes.setdefault(key, t.dtype) != t.dtype:
                raise ValueError(f"{where}: {key!r}: {list(size)} {t.dtype}, where another rank's file says {whole}")
            if t.numel():
                box = tuple(zip(offset, t.shape, strict=True))
                check_apart(key, box, boxes.setdefault(key, []), where)
                boxes[key].append(box)
            saved.append((offset, t))
    return out


def load_pieces(live: dict[str, Any], pieces: Pieces, where: str) -> None:
    """Copies the saved pieces into the live tensors (keyed as :func:`split_state` keys them) as they are sharded
    now: each rank its own piece of each, one process the whole tensors.

    Raises:
        ValueError: A tensor the run lacks, of another shape or dtype, or pieces that do not cover this rank's.
    """
    with torch.no_grad():
        for key, (size, saved) in pieces.items():
            target = live.get(key)
            if not isinstance(target, torch.Tensor):
                raise ValueError(f"{where}: holds {key!r}, which the model and optimizer have not")
            if tuple(target.shape) != size:
                raise ValueError(f"{where}: {key!r} is {list(size)} there and {list(target.shape)} here")
            local, offset = local_piece(target)
            covered = 0
            for at, t in saved:
                if t.dtype != local.dtype:
                    raise ValueError(f"{where}: {key!r} is {t.dtype} there and {local.dtype} here")
                box = overlap(offset, local.shape, at, t.shape)
                if box is None:
                    continue
                dst, src = local, t
                for d, (lo, n) in enumerate(box):
                    dst, src = dst.narrow(d, lo - offset[d], n), src.narrow(d, lo - at[d], n)
                dst.copy_(src)
                covered += src.numel()
            if covered != local.numel():
                have = local.numel()
                raise ValueError(f"{where}: the pieces of {key!r} cover {covered} of this rank's {have} values")


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """DCP warns that it assumes a single process, which is what no_dist asks for."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is (disabled, )?unavailable or uninitialized")
        yield


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _materialize(optimizer: torch.optim.Optimizer) -> None:
    """Makes a fresh optimizer create its state tensors (DCP loads into existing ones) without changing anything.

    One step with zero gradients and a learning rate of 0: the moments come
    into being (zeros, overwritten by the load) and the parameters stay as they are.
    """
    if optimizer.state:
        return
    params = [p for g in optimizer.param_groups for p in g["params"]]
    grads = [p.grad for p in params]
    lrs = [g["lr"] for g in optimizer.param_groups]
    try:
        for p in params:
            p.grad = torch.zeros_like(p)
        for g in optimizer.param_groups:
            g["lr"] = 0.0 if not isinstance(g["lr"], torch.Tensor) else torch.zeros_like(g["lr"])
        optimizer.step()
    finally:
        for p, grad in zip(params, grads, strict=True):
            p.grad = grad
        for g, lr in zip(optimizer.param_groups, lrs, strict=True):
            g["lr"] = lr


# -------------------------------------------------------- DCP, without pickle


def _writer(directory: Path) -> Any:
    from torch.distributed.checkpoint import FileSystemWriter

    class _Writer(FileSystemWriter):
        def finish(self, metadata: Any, results: list[list[Any]]) -> None:
            storage = {}
            for wr_list in results:
                storage.update({wr.index: wr.storage_data for wr in wr_list})
            metadata.storage_data = storage
            data = codec.dumps(_metadata_to_json(metadata))
            path = Path(self.path) / METADATA
            with open(path, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())

    return _Writer(str(directory), single_file_per_rank=True, sync_files=True, thread_count=1)


def _reader(directory: Path) -> Any:
    from torch.distributed.checkpoint import FileSystemReader

    class _Reader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            path = Path(self.path) / METADATA
            return _metadata_from_json(codec.loads(path.read_bytes(), str(path)), str(path))

    return _Reader(str(directory))


def _metadata_to_json(md: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    entries = {}
    for fqn, meta in md.state_dict_metadata.items():
        if not isinstance(meta, TensorStorageMetadata):
            raise TypeError(f"sharded state {fqn!r}: only tensors are written through DCP, found {type(meta).__name__}")
        p = meta.properties
        entries[fqn] = {
            "dtype": str(p.dtype).removeprefix("torch."),
            "size": list(meta.size),
            "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in meta.chunks],
        }
    storage = []
    for index, info in md.storage_data.items():
        if getattr(info, "transform_descriptors", None):
            raise TypeError(f"sharded state {index.fqn!r}: DCP transforms are not supported")
        storage.append(
            {
                "fqn": index.fqn,
                "offset": None if index.offset is None else list(index.offset),
                "index": index.index,
                "file": info.relative_path,
                "begin": info.offset,
                "length": info.length,
            }
        )
    return {"format": _FORMAT, "version": dcp_metadata_version(md), "tensors": entries, "storage": storage}


def _metadata_from_json(doc: Any, where: str) -> Any:
    """DCP's Metadata from our JSON index; anything unexpected is a ValueError naming ``where``."""
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    def ints(x: Any, what: str) -> list[int]:
        if not isinstance(x, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in x):
            raise ValueError(f"{where}: {what}: expected a list of integers >= 0, found {json.dumps(x)[:80]}")
        return x

    if not isinstance(doc, dict) or doc.get("format") != _FORMAT:
        raise ValueError(f"{where}: not a sharded-state index (format {_FORMAT!r} expected)")
    entries: dict[str, Any] = {}
    for fqn, e in (doc.get("tensors") or {}).items():
        if not isinstance(e, dict) or e.get("dtype") not in _DTYPES:
            raise ValueError(
                f"{where}: tensors[{fqn!r}]: unknown dtype {e.get('dtype') if isinstance(e, dict) else e!r}"
            )
        chunks = []
        for c in e.get("chunks") or []:
            if not isinstance(c, dict):
                raise ValueError(f"{where}: tensors[{fqn!r}]: a chunk is not an object")
            offsets, sizes = ints(c.get("offsets"), f"{fqn} offsets"), ints(c.get("sizes"), f"{fqn} sizes")
            chunks.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)))
        entries[fqn] = TensorStorageMetadata(
            TensorProperties(dtype=_DTYPES[e["dtype"]]), torch.Size(ints(e.get("size"), f"{fqn} size")), chunks
        )
    storage = {}
    for s in doc.get("storage") or []:
        if not isinstance(s, dict) or not isinstance(s.get("fqn"), str) or s["fqn"] not in entries:
            raise ValueError(f"{where}: storage entry for an unknown tensor: {json.dumps(s)[:80]}")
        name = s.get("file")
        if not isinstance(name, str) or "/" in name or name.startswith(".") or not name.endswith(".distcp"):
            raise ValueError(f"{where}: storage file {name!r} is not a .distcp file of this checkpoint")
        offset = None if s.get("offset") is None else torch.Size(ints(s["offset"], "offset"))
        begin, length = ints([s.get("begin"), s.get("length")], "begin/length")
        index = MetadataIndex(s["fqn"], offset, s.get("index") if isinstance(s.get("index"), int) else None)
        storage[index] = dcp_storage_info(name, begin, length)
    version = doc.get("version")
    return dcp_metadata(entries, storage, version if isinstance(version, str) else None)

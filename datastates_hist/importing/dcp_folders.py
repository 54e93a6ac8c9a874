"""Reading a PyTorch DCP folder (``torch.distributed.checkpoint``) in one process,
without a process group, and without running code: DCP pickles its ``.metadata``
(read here by an unpickler that knows only DCP's metadata classes) and its
non-tensor items (loaded here with ``weights_only=True``). What the metadata
says is checked before any byte is read: ``.metadata`` and each storage entry a
regular file inside the folder, each entry within its file; each item's path,
size and chunks sane."""

from __future__ import annotations

import bisect
import math
import os
import pickle
import struct
import warnings
from typing import Any

import torch

from .reading import check_expansion, check_regular, first_line, is_inside, refusal_line

# the files DCP's FileSystemWriter writes in one process (.metadata.tmp until the save completes)
DCP_METADATA, DCP_METADATA_TMP, DCP_DATA_SUFFIX = ".metadata", ".metadata.tmp", ".distcp"

# the globals a DCP .metadata pickle refers to (torch 2.x): DCP's metadata classes and what they hold
DCP_METADATA_GLOBALS = frozenset({
    *(("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("collections", "OrderedDict"),
    *(("pathlib", name) for name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")),
})


class RefusedGlobal(pickle.UnpicklingError):
    """A pickle asked for a global that DCP's metadata is not made of."""


# the classes whose instances a DCP .metadata pickle fills in (BUILD): DCP's metadata dataclasses
DCP_BUILT_CLASSES = frozenset({
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta")} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo")})


class DCPMetadataUnpickler(pickle._Unpickler):
    """Unpickles a DCP ``.metadata`` file (a plain pickle) refusing every global but
    those DCP's metadata is made of, so that a crafted file runs no code; and
    refusing to fill in (BUILD) anything but a fresh instance of DCP's metadata
    classes, so that it cannot set attributes on a class it was given (a BUILD on
    ``pathlib.PosixPath`` would change every path of the process) or on a shared
    object (a dtype, an enum member). The Python unpickler: the C one has no BUILD
    to override."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def find_class(self, module: str, name: str):
        if (module, name) in DCP_METADATA_GLOBALS or (
                module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise RefusedGlobal(f"Unsupported global: {module}.{name}")

    def load_build(self):
        target = self.stack[-2]  # BUILD: the object below its state
        kind = type(target)
        if isinstance(target, type) or (kind.__module__, kind.__qualname__) not in DCP_BUILT_CLASSES:
            shown = target if isinstance(target, type) else f"a {kind.__module__}.{kind.__qualname__}"
            raise RefusedGlobal(f"Unsupported BUILD: setting the attributes of {shown}")
        super().load_build()

    dispatch[pickle.BUILD[0]] = load_build


def checkpoint_failure(exc: BaseException) -> BaseException:
    """The error behind a ``CheckpointException`` (DCP wraps each rank's failure in
    one, a BaseException): the first rank's; ``exc`` itself when it is no such wrapper."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        failure = next(iter(failures.values()))
        if isinstance(failure, tuple) and failure and isinstance(failure[0], BaseException):
            return failure[0]
    return exc


def read_dcp(folder: str) -> dict:
    """The state dict of a DCP folder, nested as it was saved, read in this process alone."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    metadata = read_metadata(folder)
    check_storage(folder, metadata)
    flat = _empty_state_dict(folder, metadata)
    paths = _planner_paths(folder, metadata, flat)
    check_entries_apart(folder, metadata)
    reader, planner = _safe_dcp_reader(folder, metadata)
    try:
        with warnings.catch_warnings():  # DCP warns that it runs without a process group: so it should
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(flat, storage_reader=reader, planner=planner, no_dist=True)
    except (CheckpointException, pickle.UnpicklingError, OSError, RuntimeError, ValueError, KeyError,
            EOFError) as exc:
        cause = checkpoint_failure(exc)
        refused = refusal_line(cause) if isinstance(cause, pickle.UnpicklingError) else None
        if refused is not None:
            raise ValueError(f"refused {folder}: a non-tensor item holds more than plain values, and loading it "
                             f"could run code ({refused})") from None
        if isinstance(cause, pickle.UnpicklingError):
            raise OSError(f"cannot read {folder}: an item's data is damaged or not a torch file") from None
        raise OSError(f"cannot read {folder}: {type(cause).__name__}: {first_line(cause)}") from None
    nested = _nest(folder, [(paths.get(fqn, (fqn,)), value) for fqn, value in flat.items()])
    # its non-tensor items are pickles too; its tensors are new ones, their sizes checked before the read
    check_expansion(nested, folder, _stored_bytes(folder, metadata), tensors=False)
    return nested


def _stored_bytes(folder: str, metadata) -> int:
    """The bytes of the files the storage entries name."""
    return sum(os.path.getsize(os.path.join(folder, p))
               for p in {info.relative_path for info in metadata.storage_data.values()})


def read_metadata(folder: str):
    """The ``.metadata`` of a DCP folder, unpickled so that it runs no code."""
    from torch.distributed.checkpoint.metadata import Metadata

    metadata_path = check_regular(os.path.join(folder, DCP_METADATA), folder)
    try:
        with open(metadata_path, "rb") as f:
            metadata = DCPMetadataUnpickler(f).load()
    except RefusedGlobal as exc:
        raise ValueError(f"refused {metadata_path}: it holds more than DCP's metadata, and loading it "
                         f"could run code ({first_line(exc)})") from None
    except (OSError, EOFError, AttributeError, ValueError, TypeError, IndexError, KeyError, struct.error,
            OverflowError, MemoryError, pickle.UnpicklingError) as exc:
        raise OSError(f"cannot read {metadata_path}: damaged or not DCP metadata ({first_line(exc)})") from None
    if not (isinstance(metadata, Metadata) and isinstance(getattr(metadata, "state_dict_metadata", None), dict)
            and isinstance(getattr(metadata, "storage_data", None), dict)):
        raise ValueError(f"cannot import {folder}: {metadata_path} is not DCP metadata")
    return metadata


def check_storage(folder: str, metadata) -> None:
    """Refuse storage entries that point outside ``folder`` (an absolute path, ``../x``,
    a link out) or past the end of their file: DCP reads whatever they name."""
    root = os.path.realpath(folder)
    sizes: dict[str, int] = {}
    for index, info in metadata.storage_data.items():
        path = getattr(info, "relative_path", None)
        where = f"cannot import {folder}: the storage entry of {getattr(index, 'fqn', index)!r}"
        if not isinstance(path, str) or not path or "\0" in path or os.path.isabs(path):
            raise ValueError(f"{where} names {path!r}, not a file of the folder")
        if path not in sizes:
            real = os.path.realpath(os.path.join(root, path))
            if not is_inside(root, real) or real == root:
                raise ValueError(f"{where} names {path!r}, outside the folder")
            if not os.path.isfile(real):
                raise ValueError(f"{where} names {path!r}, which is not a file of the folder")
            sizes[path] = os.path.getsize(real)
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in (offset, length)) \
                or offset + length > sizes[path]:
            raise ValueError(f"{where} reads bytes {offset!r}+{length!r} of {path!r}, which holds {sizes[path]}")


def check_entries_apart(folder: str, metadata) -> None:
    """Refuse storage entries that read bytes another entry reads (DCP's writer gives every
    item bytes of its own): one item would be loaded from another's bytes. (After the
    checks of sizes, which a crafted entry reading another's bytes must pass too.)"""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    spans: dict[str, list[tuple[int, int, str]]] = {}  # path -> (offset, end, fqn) of the entries read
    for fqn, meta in metadata.state_dict_metadata.items():
        keys = [MetadataIndex(fqn)] if isinstance(meta, BytesStorageMetadata) else [
            MetadataIndex(fqn, chunk.offsets) for chunk in meta.chunks]
        for info in filter(None, map(metadata.storage_data.get, keys)):  # an entry no item reads is never read
            if info.length:
                spans.setdefault(info.relative_path, []).append((info.offset, info.offset + info.length, fqn))
    for path, entries in spans.items():
        entries.sort(key=lambda e: e[:2])
        for (_, end, first), (start, _, second) in zip(entries, entries[1:]):
            if start < end:
                raise ValueError(f"cannot import {folder}: the storage entries of {first!r} and {second!r} read the "
                                 f"same bytes of {path!r}: one's bytes would be loaded as the other's")


def _empty_state_dict(folder: str, metadata) -> dict:
    """The flat state dict DCP loads into: an empty tensor of each stored tensor's
    dtype and size, None for each non-tensor item.

    A tensor's chunks must tile it exactly (else DCP leaves the rest of the empty
    tensor as it was: uninitialised memory), each read from a storage entry. Where
    no transform (compression) applies to the entries read, each chunk must fit in
    its entry, and all such tensors together in the folder's files: a crafted
    folder of a few KB makes no TiB allocation."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    stored = _stored_bytes(folder, metadata)
    plain_total = 0  # the bytes of the tensors read without a transform
    flat: dict[str, Any] = {}
    for fqn, meta in metadata.state_dict_metadata.items():
        if not isinstance(fqn, str):
            raise ValueError(f"cannot import {folder}: its metadata names an item {fqn!r}, not a string")
        if isinstance(meta, BytesStorageMetadata):
            flat[fqn] = None
            continue
        if not isinstance(meta, TensorStorageMetadata):
            raise ValueError(f"cannot import {folder}: its metadata describes {fqn!r} as {type(meta).__name__}")
        dtype, size = getattr(getattr(meta, "properties", None), "dtype", None), getattr(meta, "size", None)
        if not (isinstance(dtype, torch.dtype) and _is_shape(size)):
            raise ValueError(f"cannot import {folder}: its metadata gives {fqn!r} the dtype {dtype!r} and size "
                             f"{size!r}")
        nbytes = math.prod(size) * dtype.itemsize
        entries = _chunk_entries(folder, metadata, fqn, meta)
        if not any(getattr(entry, "transform_descriptors", None) for _, entry in entries):
            plain_total += nbytes
            if nbytes > stored:
                raise ValueError(f"cannot import {folder}: its metadata gives {fqn!r} {nbytes} bytes, more than "
                                 f"the {stored} its files hold")
            if plain_total > stored:
                raise ValueError(f"cannot import {folder}: its metadata gives its tensors {plain_total} bytes or "
                                 f"more, more than the {stored} its files hold")
            for chunk, entry in entries:
                chunk_bytes = math.prod(chunk.sizes) * dtype.itemsize
                if chunk_bytes > entry.length:
                    raise ValueError(f"cannot import {folder}: its metadata gives a chunk of {fqn!r} {chunk_bytes} "
                                     f"bytes, more than the {entry.length} of its storage entry")
        try:
            _check_tiling(folder, fqn, size, [chunk for chunk, _ in entries])
            flat[fqn] = torch.empty(size, dtype=dtype)
        except RuntimeError:  # a size only a transform could fill, beyond this machine's memory
            raise ValueError(f"cannot import {folder}: its metadata gives {fqn!r} {nbytes} bytes, more than this "
                             "process can allocate") from None
    return flat


def _is_shape(value: Any) -> bool:
    return isinstance(value, tuple) and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0
                                            for n in value)


def _chunk_entries(folder: str, metadata, fqn: str, meta) -> list[tuple[Any, Any]]:
    """Each chunk of tensor ``fqn``, inside it, with the storage entry DCP reads it from."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    size, chunks = meta.size, getattr(meta, "chunks", None)
    where = f"cannot import {folder}: its metadata gives {fqn!r}"
    if not isinstance(chunks, list):
        raise ValueError(f"{where} the chunks {chunks!r}, not a list")
    entries = []
    for chunk in chunks:
        offsets, sizes = (_plain(getattr(chunk, field, None)) for field in ("offsets", "sizes"))
        if not (_is_shape(offsets) and _is_shape(sizes) and len(offsets) == len(sizes) == len(size)
                and all(o + n <= d for o, n, d in zip(offsets, sizes, size))):
            raise ValueError(f"{where} (size {tuple(size)}) a chunk at {offsets!r} of size {sizes!r}, not inside it")
        entry = metadata.storage_data.get(MetadataIndex(fqn, offsets))
        if entry is None:
            raise ValueError(f"{where} a chunk at {offsets} that no storage entry holds")
        entries.append((chunk, entry))
    return entries


def _plain(value: Any) -> Any:
    """A ``torch.Size`` as a plain tuple, for messages."""
    return tuple(value) if isinstance(value, tuple) else value


def _check_tiling(folder: str, fqn: str, size: tuple, chunks: list) -> None:
    """Refuse chunks (each inside the tensor) that do not tile it exactly: DCP leaves
    what no chunk covers as the empty tensor had it, uninitialised memory. Their
    volumes must add up to the tensor's and no two may overlap. Checked on the grid of
    the chunks' own boundaries (a cell per distinct box, not per element: a tensor cut
    in n row blocks is n cells), so that the check takes no memory of the tensor's size."""
    volume, numel = sum(math.prod(c.sizes) for c in chunks), math.prod(size)
    if volume != numel:
        raise ValueError(f"cannot import {folder}: its metadata gives {fqn!r} chunks that do not tile it ({volume} "
                         f"of its {numel} elements covered, or some twice): the rest would be uninitialised memory")
    if len(chunks) < 2:  # one chunk inside the tensor, of its volume, is all of it
        return
    cuts = [sorted({0, n, *(c.offsets[d] for c in chunks), *(c.offsets[d] + c.sizes[d] for c in chunks)})
            for d, n in enumerate(size)]
    covered = torch.zeros([len(cut) - 1 for cut in cuts], dtype=torch.bool)
    for chunk in chunks:
        cells = covered[tuple(slice(bisect.bisect_left(cut, o), bisect.bisect_left(cut, o + n))
                              for cut, o, n in zip(cuts, chunk.offsets, chunk.sizes))]
        if cells.any():  # volumes that add up, and an overlap: some elements are covered by none
            raise ValueError(f"cannot import {folder}: its metadata gives {fqn!r} chunks that do not tile it (some "
                             "of its elements covered twice, others by none): the rest would be uninitialised "
                             "memory")
        cells.fill_(True)


# the deepest path of an item in the nested state dict (values.MAX_DEPTH: a value nests no deeper)
MAX_PATH = 100


def _planner_paths(folder: str, metadata, flat: dict) -> dict[str, tuple]:
    """Each item's path in the nested state dict (DCP's ``planner_data``): a non-empty
    tuple of at most :data:`MAX_PATH` keys, an int key a list index below the count of
    items. Only the items' paths are read: entries of no item are left alone."""
    paths = getattr(metadata, "planner_data", None)
    paths = paths if isinstance(paths, dict) else {}
    items, found = len(flat), {}
    for fqn in flat:
        path = paths.get(fqn)
        if path is None:
            continue
        if isinstance(path, tuple) and len(path) > MAX_PATH:
            raise ValueError(f"cannot import {folder}: its metadata gives {fqn!r} a path {len(path)} keys deep "
                             f"(at most {MAX_PATH})")
        if not (isinstance(path, tuple) and path and all(
                isinstance(k, str) or (isinstance(k, int) and not isinstance(k, bool) and 0 <= k < items)
                for k in path)):
            raise ValueError(f"cannot import {folder}: its metadata gives {fqn!r} the path {path!r} (a path is "
                             f"keys, or list positions below {items})")
        found[fqn] = path
    return found


def _safe_dcp_reader(folder: str, metadata):
    """DCP's file-system reader and load planner, made safe: the reader takes the
    metadata read above; the planner loads non-tensor items with ``weights_only=True``
    (DCP's own runs any pickle)."""
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader

    class Reader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            return metadata

    class Planner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value):
            self.state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=True)

    return Reader(folder), Planner(flatten_state_dict=False, flatten_sharded_tensors=False)


def _nest(folder: str, flat: list[tuple[tuple, Any]]) -> dict:
    """The nested state dict of DCP's flattened one (path of keys -> value; an int key
    indexes a list, as DCP flattens ``param_groups``)."""
    out: dict = {}
    for path, value in flat:
        node = out
        for depth, (key, below) in enumerate(zip(path, path[1:])):
            node = _child(folder, path[:depth + 1], node, key, [] if isinstance(below, int) else {})
        _child(folder, path, node, path[-1], value, leaf=True)
    return out


def _child(folder: str, path: tuple, node: Any, key: Any, value: Any, leaf: bool = False) -> Any:
    """``node[key]``, set to ``value`` when missing; a clear error where two items'
    paths clash (the same path twice, a value where another's keys go on)."""
    if isinstance(node, list) and isinstance(key, int):
        node.extend([None] * (key + 1 - len(node)))
        present = node[key] is not None
    elif isinstance(node, dict) and isinstance(key, str):
        present = key in node
    else:
        raise ValueError(f"cannot import {folder}: the items' paths clash at {path!r}")
    if not present:
        node[key] = value
    elif leaf or not isinstance(node[key], type(value)):
        raise ValueError(f"cannot import {folder}: the items' paths clash at {path!r}")
    return node[key]

"""Reading checkpoint files so that no code runs: ``torch.load`` with
``weights_only=True`` (numpy arrays allowed, as transformers allows them for its
RNG states), safetensors, JSON; every failure as one line naming the file."""

from __future__ import annotations

import json
import os
import pickle
import stat
import warnings
import zipfile
from typing import Any

import numpy as np
import torch


# the numpy dtypes of the plain arrays a torch file may hold (never objects, strings, records)
NUMPY_PLAIN_DTYPES = (np.bool_, np.float16, np.float32, np.float64, np.int8, np.int16, np.int32, np.int64,
                      np.uint8, np.uint16, np.uint32, np.uint64)


def numpy_globals() -> list:
    """What a plain numpy array needs to load: the allowlist transformers uses for its
    RNG states (a uint32 array), with the other numeric dtypes beside uint32."""
    core = getattr(np, "_core", None) or np.core
    return [core.multiarray._reconstruct, np.ndarray, np.dtype, *(type(np.dtype(t)) for t in NUMPY_PLAIN_DTYPES)]


def is_inside(folder: str, path: str) -> bool:
    """Whether ``path`` lies in ``folder`` (or is it), by real path: links resolved."""
    root = os.path.realpath(folder)
    return os.path.commonpath([root, os.path.realpath(path)]) == root


def check_regular(path: str, folder: str | None = None) -> str:
    """``path``, checked before anything opens it: a regular file (a FIFO or a device
    would block the import, or never end), and inside ``folder`` by real path when
    given (a link out of a source folder is not the folder's)."""
    if folder is not None and not is_inside(folder, path):
        raise ValueError(f"cannot import {folder}: {os.path.basename(path)} links outside the folder")
    try:
        regular = stat.S_ISREG(os.stat(path).st_mode)
    except OSError as exc:  # a link to nothing
        raise ValueError(f"cannot import {path}: not a regular file ({exc.strerror})") from None
    if not regular:
        raise ValueError(f"cannot import {path}: not a regular file")
    return path


def load_torch(path: str) -> Any:
    """``torch.load`` of ``path`` that runs no code: plain tensors and values only
    (memory-mapped where the file's format allows)."""
    mapped: list[torch.UntypedStorage] = []

    def on_cpu(storage, _location):  # torch's map_location, keeping each storage mapped to check it
        mapped.append(storage)
        return storage

    stored, unpacked = zip_records(path)
    limit = EXPANSION * max(os.path.getsize(path), 1024)
    if unpacked > limit:  # torch unpacks compressed records whole, before any check of what they hold
        raise ValueError(f"cannot import {path}: its compressed records would expand to {unpacked} bytes from "
                         f"{os.path.getsize(path)} bytes of file (more than {limit}): refused")
    with torch.serialization.safe_globals(numpy_globals()):
        try:
            obj = _load(path, on_cpu, mapped, stored)
        except pickle.UnpicklingError as exc:
            refused = refusal_line(exc)
            if refused is None:
                raise OSError(f"cannot read {path}: damaged or not a torch file") from exc
            raise ValueError(f"refused {path}: it holds more than tensors and plain values, and loading it "
                             f"could run code ({refused})") from None
        except (OSError, EOFError, RuntimeError, ValueError) as exc:
            raise OSError(f"cannot read {path}: {first_line(exc)}") from exc
        except MemoryError:
            raise
        except Exception as exc:  # a damaged pickle fails anywhere in torch's unpickler (KeyError, struct.error...)
            raise OSError(f"cannot read {path}: damaged or not a torch file ({error_name(exc)})") from exc
    check_records(path, mapped)
    check_expansion(obj, path, os.path.getsize(path))
    return obj


def _load(path: str, on_cpu, mapped: list, stored: bool) -> Any:
    """``torch.load`` of ``path``, memory-mapped where the file allows."""
    if stored:
        try:
            return torch.load(path, map_location=on_cpu, weights_only=True, mmap=True)
        except RuntimeError as exc:
            if "mmap" not in str(exc):
                raise
    mapped.clear()  # the legacy format, or compressed records: read, not mapped
    with warnings.catch_warnings():  # torch's word on a pickle protocol: the error that follows says it
        warnings.filterwarnings("ignore", message="Detected pickle protocol", category=UserWarning)
        return torch.load(path, map_location="cpu", weights_only=True)


def error_name(exc: BaseException) -> str:
    """``KeyError``, ``struct.error``: an exception's class as its module spells it."""
    kind = type(exc)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def zip_records(path: str) -> tuple[bool, int]:
    """Whether every record of the zip torch file ``path`` is stored, not compressed
    (as ``torch.save`` writes them): a memory-mapped load takes a record's bytes from
    the file as they lie there; and the bytes its compressed records unpack to, as
    the zip declares them (torch's reader unpacks no more). ``(True, 0)`` for a file
    that is not a zip (torch tells)."""
    try:
        with zipfile.ZipFile(path) as archive:
            infos = archive.infolist()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError):
        return True, 0
    packed = [i for i in infos if i.compress_type != zipfile.ZIP_STORED]
    return not packed, sum(i.file_size for i in packed)


def check_records(path: str, storages: list[torch.UntypedStorage]) -> None:
    """Refuse a zip torch file whose storages are not each exactly one ``data/`` record:
    a memory-mapped ``torch.load`` takes a storage's bytes from its record's offset on
    without the size check of a plain load, so a short record would lend the storage
    bytes of the zip headers that follow it.

    The mapped storages are slices of one mapping of the file, at unknown address
    ``base``: the file is sound when one ``base`` puts every storage on the start of a
    record of its size."""
    sized = [(s.data_ptr(), s.nbytes()) for s in storages if s.nbytes()]
    if not sized:
        return
    try:
        reader = torch._C.PyTorchFileReader(path)  # torch's own zip reader: the offsets its load used
        records = {reader.get_record_offset(name): reader.get_record_size(name)
                   for name in reader.get_all_records() if name.startswith("data/")}
    except RuntimeError as exc:  # changed since it was loaded (truncated by a writer)
        raise OSError(f"cannot read {path}: {first_line(exc)}") from None
    first = min(ptr for ptr, _ in sized)
    for offset in sorted(records):  # the first storage on each record in turn
        base = first - offset
        if all(records.get(ptr - base) == nbytes for ptr, nbytes in sized):
            return
    raise OSError(f"cannot read {path}: its tensors' storages do not match the records holding their bytes "
                  "(a record shorter or longer than its storage): damaged")


# What a loaded object may expand to, walked as the tree the import walks and stores,
# per byte of its file: in entries (lists, dicts, values), each of which takes at least
# one byte of pickle unless pickle's memo shares it, which real checkpoints do little (a
# "billion laughs", x = [x, x] d deep, is 2**d entries from d); and in tensor bytes,
# which real checkpoints take from the file but for a tied weight or two (a view that
# expands one element, or many views of one storage, would take any size from none).
EXPANSION = 16


def check_expansion(obj: Any, path: str, nbytes: int, *, tensors: bool = True) -> None:
    """Refuse an object read from ``nbytes`` of file that, walked as a tree, would
    have far more entries or (where ``tensors``) tensor bytes than the file could hold."""
    entries, tensor_bytes = tree_size(obj)
    limit = EXPANSION * max(nbytes, 1024)
    if entries > limit:
        raise ValueError(f"cannot import {path}: its lists and dicts, shared many times over, would expand to "
                         f"{entries} entries from {nbytes} bytes (more than {limit}): refused")
    if tensors and tensor_bytes > limit:
        raise ValueError(f"cannot import {path}: its tensors would take {tensor_bytes} bytes from {nbytes} bytes "
                         f"of file (more than {limit}: views that expand or repeat one storage): refused; save "
                         "copies of them (.clone()) to import them")


def tree_size(obj: Any) -> tuple[int, int]:
    """The entries and the tensor bytes of ``obj`` walked as a tree (a list, tuple or
    dict counted each place it is held), computed once per container: a shared one
    costs one visit."""
    sizes: dict[int, tuple[int, int]] = {}  # id -> (entries, tensor bytes) with it; (1, 0) while counted (a cycle)
    todo: list[tuple[Any, bool]] = [(obj, False)]
    while todo:
        node, counted = todo.pop()
        if counted:
            below = [sizes[id(c)] if _is_container(c) else _leaf_size(c) for c in _children(node)]
            sizes[id(node)] = (1 + sum(n for n, _ in below), sum(b for _, b in below))
        elif _is_container(node) and id(node) not in sizes:
            sizes[id(node)] = (1, 0)
            todo.append((node, True))
            todo.extend((c, False) for c in _children(node) if _is_container(c) and id(c) not in sizes)
    return sizes[id(obj)] if _is_container(obj) else _leaf_size(obj)


def _is_container(x: Any) -> bool:
    return isinstance(x, (dict, list, tuple, set, frozenset))


def _children(container: Any):
    return container.values() if isinstance(container, dict) else container


def _leaf_size(x: Any) -> tuple[int, int]:
    if isinstance(x, torch.Tensor) and x.layout == torch.strided:  # a sparse tensor is refused when written
        return 1, x.numel() * x.element_size()
    return 1, 0


# what torch's weights_only unpickler says when it refuses a global or a type to build
REFUSALS = ("GLOBAL", "Can only build")


def refusal_line(exc: BaseException) -> str | None:
    """The line of a ``weights_only`` refusal that names the global or type the file
    asks for; None when torch failed for another reason (random bytes, a truncated pickle)."""
    lines = [line.strip() for line in str(exc).splitlines()]
    named = [line for line in lines if any(word in line for word in REFUSALS)]
    return named[0].split(". ")[0].rstrip(".") if named else None  # torch's advice follows


def first_line(exc: BaseException) -> str:
    """The first sentence of an error's text (torch's go on with advice for another case)."""
    text = str(exc).strip().splitlines()
    return text[0].split(". ")[0].rstrip(".") if text else type(exc).__name__


def load_safetensors(path: str) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(path, device="cpu")
    except (SafetensorError, OSError) as exc:
        raise OSError(f"cannot read {path}: {first_line(exc)}") from exc


def read_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as exc:
        raise OSError(f"cannot read {path}: {first_line(exc)}") from exc
    except RecursionError:  # arrays or objects nested thousands deep
        raise OSError(f"cannot read {path}: nested too deeply") from None

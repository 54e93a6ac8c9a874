"""The files of a BP5 unit, checked before ADIOS2 opens it.

ADIOS2 does not check what it reads: a damaged or truncated BP5 file can crash or
hang the reading process, and a link inside a unit would read data from outside
the run. So a unit is listed without following links (anything but regular files
is refused), its files' sizes and its metadata's xxh3 are checked against
``checksums.json``, and its framing against the files' sizes
(docs/guarantees.md, sections 15 and 16).
"""

from __future__ import annotations

import json
import os
import stat
import struct

from ..digest import checksum_bytes
from ..errors import CorruptionError
from ..layout import entry_path
from . import _adios2_capi as capi

# What a BP5 writer leaves in its folder on close although asked not to (ADIOS2 2.12;
# a link to /dev/null for a writer of its own file): removed, so a unit holds only what
# readers use. Older units may hold it.
PROFILE = capi.PROFILE

# ADIOS2 does not check its metadata, and reading damaged or truncated BP5
# files can crash or hang the process. So each unit records the size of its
# files and the xxh3 of its metadata files (data is covered by the tensors'
# checksums), and readers check them before ADIOS2 opens the folder.
CHECKSUMS = "checksums.json"
_UNCHECKED = (CHECKSUMS, PROFILE)


def _files_json(files: dict) -> bytes:
    return json.dumps(files, sort_keys=True, separators=(",", ":")).encode()


def write_checksums(folder: str) -> None:
    """Record sizes and metadata checksums of a closed BP5 folder (before it is fsynced)."""
    files = {}
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if name in _UNCHECKED or not os.path.isfile(path):
            continue
        files[name] = {"size": os.path.getsize(path)}
        if not name.startswith("data."):
            with open(path, "rb") as f:
                files[name]["xxh3"] = checksum_bytes(f.read())
    doc = {"files": files, "xxh3": checksum_bytes(_files_json(files))}
    with open(os.path.join(folder, CHECKSUMS), "w") as f:
        json.dump(doc, f)


def unit_files(folder: str) -> dict[str, int]:
    """The size of every file of a BP5 unit, listed without following links: a unit
    holding a symbolic link or anything but a regular file is refused before ADIOS2
    or anything else opens it, so that no byte read comes from outside the run.

    Raises:
        CorruptionError: naming the entry and what it is.
    """
    sizes = {}
    with os.scandir(folder) as listing:
        entries = sorted(listing, key=lambda e: e.name)  # the same entry named first on every file system
    for entry in entries:
        st = entry.stat(follow_symlinks=False)
        if stat.S_ISREG(st.st_mode):
            sizes[entry.name] = st.st_size
        elif entry.name == PROFILE and stat.S_ISLNK(st.st_mode) and os.readlink(entry.path) == os.devnull:
            continue  # what writers of earlier versions left (capi.PROFILE); nothing reads it
        else:
            kind = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a regular file"
            raise CorruptionError(f"{entry.path} is {kind}; the files of a step's BP5 unit are read "
                                  f"only inside {folder}: refused")
    return sizes


def _read(folder: str, name: str, offset: int = 0, size: int = -1) -> bytes:
    # O_NOFOLLOW: a file swapped for a link after unit_files listed it is not followed either
    fd = os.open(os.path.join(folder, name), os.O_RDONLY | os.O_NOFOLLOW)
    with open(fd, "rb") as f:
        f.seek(offset)
        return f.read(size)


def check_checksums(folder: str) -> dict[str, int]:
    """Raise :class:`CorruptionError` naming the damaged file; units written
    without ``checksums.json`` only get :func:`check_structure`. Returns the
    size of every file of the unit (:func:`unit_files`)."""
    sizes = unit_files(folder)
    path = os.path.join(folder, CHECKSUMS)
    if CHECKSUMS not in sizes:
        check_structure(folder, sizes)
        return sizes
    try:
        doc = json.loads(_read(folder, CHECKSUMS))
        files = doc["files"]
        intact = checksum_bytes(_files_json(files)) == doc["xxh3"]
    except (ValueError, KeyError, TypeError):
        intact = False
    if not intact:
        raise CorruptionError(f"{path} is damaged: the step's BP5 files cannot be checked")
    for name, want in files.items():
        file = entry_path(folder, name, f"the file {name!r} of {CHECKSUMS}")
        if name not in sizes:
            raise CorruptionError(f"{file} is missing from the step's BP5 files")
        if sizes[name] != want["size"]:
            raise CorruptionError(f"{file} has {sizes[name]} bytes, {want['size']} were written: it is truncated or damaged")
        if "xxh3" in want and checksum_bytes(_read(folder, name)) != want["xxh3"]:
            raise CorruptionError(f"{file} does not match its checksum: the step's BP5 metadata is damaged")
    # checksums.json is an unkeyed hash anyone can redo: the structure is checked too
    check_structure(folder, sizes)
    return sizes


# md.idx begins with a header of 64 bytes; its byte 36 is 0 for little-endian
# files, 37 the BP format version, 38 BP5's minor version (2 from ADIOS2 2.9 on).
_INDEX_HEADER, _ENDIAN_AT, _VERSION_AT, _MINOR_AT = 64, 36, 37, 38


def check_structure(folder: str, sizes: dict[str, int] | None = None) -> None:
    """Raise :class:`CorruptionError` when a file ADIOS2 needs is missing or ``md.idx``
    is no BP5 index: otherwise ADIOS2 fails, and prints its own error on stderr too.
    Then, for BP5 minor version 2, whatever ADIOS2 would read beyond a file's end
    (it does not check, and crashes on a truncated ``mmd.0`` or ``md.0``):
    :func:`_check_layout`."""
    if sizes is None:
        sizes = unit_files(folder)
    for name in ("md.idx", "md.0", "mmd.0", "data.0"):
        if name not in sizes:
            raise CorruptionError(f"{os.path.join(folder, name)} is missing from the step's BP5 files")
    index = os.path.join(folder, "md.idx")
    header = _read(folder, "md.idx", 0, _INDEX_HEADER)
    if len(header) < _INDEX_HEADER or header[_VERSION_AT] != 5:
        raise CorruptionError(f"{index} is no BP5 index ({len(header)} bytes read): the step's BP5 metadata is damaged")
    if header[_ENDIAN_AT] == 0 and header[_MINOR_AT] == 2:
        _check_layout(folder, sizes)


class _Damaged(Exception):
    """What is wrong with one file of a BP5 unit (see _check_layout)."""

    def __init__(self, name: str, why: str):
        super().__init__(name, why)
        self.name, self.why = name, why


def _u64(buf: bytes, at: int, count: int, name: str) -> tuple[int, ...]:
    if at + 8 * count > len(buf):
        raise _Damaged(name, "ends inside a record")
    return struct.unpack_from(f"<{count}Q", buf, at)


def _check_layout(folder: str, sizes: dict[str, int]) -> None:
    """Check what ADIOS2 reads before it reads any tensor against the files' sizes
    (layouts as ADIOS2's own ``bp5dbg`` reads them):

    - ``md.idx``: a sequence of records ``kind (1 byte), length (u64), body``; a
      writer map ``w`` is ``writers, aggregators, subfiles`` and each writer's
      subfile; a step ``s`` is ``metadata position, metadata size, flushes`` and,
      per writer, ``flushes`` (position, size) pairs in its data file and the
      position of its last chunk there;
    - ``mmd.0``: records ``id length, info length (u64 each), id, info``, ending at
      the file's end; every metadata block of ``md.0`` begins with one of their ids;
    - ``md.0``, per step: its size less 8 (u64), each writer's variable and
      attribute metadata sizes (u64 each), then those blocks.

    The FFS-encoded contents of the metadata blocks are not checked (see
    docs/guarantees.md, section 16)."""
    try:
        index = _read(folder, "md.idx")
        steps, writers = [], None
        pos = _INDEX_HEADER
        while pos < len(index):
            kind = index[pos:pos + 1]
            (length,) = _u64(index, pos + 1, 1, "md.idx")
            body = index[pos + 9:pos + 9 + length]
            if len(body) < length:
                raise _Damaged("md.idx", "ends inside a record")
            if kind == b"w":
                count, _aggregators, subfiles = _u64(body, 0, 3, "md.idx")
                if length != 8 * (3 + count):
                    raise _Damaged("md.idx", f"has a writer map of {length} bytes for {count} writers")
                writers = _u64(body, 24, count, "md.idx")
                for subfile in set(writers):
                    if subfile >= subfiles or f"data.{subfile}" not in sizes:
                        raise _Damaged(f"data.{subfile}", "is missing from the step's BP5 files")
            elif kind == b"s":
                if writers is None:
                    raise _Damaged("md.idx", "records a step before its writer map")
                mdpos, mdsize, flushes = _u64(body, 0, 3, "md.idx")
                if length != 8 * (3 + len(writers) * (2 * flushes + 1)):
                    raise _Damaged("md.idx", f"has a step record of {length} bytes for {len(writers)} writers "
                                             f"and {flushes} flushes")
                if mdpos + mdsize > sizes["md.0"]:
                    raise _Damaged("md.0", f"has {sizes['md.0']} bytes; md.idx records the metadata of a step "
                                           f"at {mdpos} to {mdpos + mdsize}: it is truncated")
                places = _u64(body, 24, len(writers) * (2 * flushes + 1), "md.idx")
                for w, subfile in enumerate(writers):
                    mine = places[w * (2 * flushes + 1):(w + 1) * (2 * flushes + 1)]
                    end = max([mine[-1]] + [at + n for at, n in zip(mine[:-1:2], mine[1::2])])
                    data = f"data.{subfile}"
                    if end > sizes[data]:
                        raise _Damaged(data, f"has {sizes[data]} bytes; md.idx records data up to {end}: "
                                             f"it is truncated")
                steps.append((mdpos, mdsize, len(writers)))
            pos += 9 + length  # records of other kinds are skipped, as ADIOS2 does
        if not steps:
            raise _Damaged("md.idx", "records no step")
        ids = _metameta_ids(_read(folder, "mmd.0"))
        for mdpos, mdsize, count in steps:
            _check_step_metadata(_read(folder, "md.0", mdpos, mdsize), mdpos, count, ids)
    except _Damaged as damage:
        raise CorruptionError(f"{os.path.join(folder, damage.name)} {damage.why}: the step's BP5 "
                              f"metadata is damaged") from None


def _metameta_ids(mmd: bytes) -> list[bytes]:
    ids, pos = [], 0
    while pos < len(mmd):
        id_length, info_length = _u64(mmd, pos, 2, "mmd.0")
        end = pos + 16 + id_length + info_length
        if end > len(mmd):
            raise _Damaged("mmd.0", f"has {len(mmd)} bytes; a record at {pos} ends at {end}: it is truncated")
        ids.append(mmd[pos + 16:pos + 16 + id_length])
        pos = end
    return ids


def _check_step_metadata(block: bytes, mdpos: int, writers: int, ids: list[bytes]) -> None:
    (size,) = _u64(block, 0, 1, "md.0")
    parts = _u64(block, 8, 2 * writers, "md.0")
    if size + 8 != len(block) or 16 * writers + sum(parts) != size:
        raise _Damaged("md.0", f"does not hold the metadata md.idx records at {mdpos} ({len(block)} bytes)")
    at = 8 + 16 * writers
    for n in parts:
        if n and not any(block.startswith(i, at) for i in ids if i):
            raise _Damaged("md.0", f"has metadata at {mdpos + at} of a format mmd.0 does not hold")
        at += n

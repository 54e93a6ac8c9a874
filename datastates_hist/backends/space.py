"""Disk space reserved before a storage library writes into it.

A full disk then fails in a clean ``OSError`` of our own, before the library
meets it: HDF5 cannot recover from a metadata write that fails for want of
space, and ADIOS2 prints its own error on stderr when a write fails.
"""

from __future__ import annotations

import ctypes
import errno
import os

FALLOC_FL_KEEP_SIZE = 1  # the file's size stays what the library writes; trim() frees the rest
_FALLOCATE_UNSUPPORTED = (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)
_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)


def reserve_space(fd: int, offset: int, nbytes: int, what: str) -> None:
    """fallocate(2) ``nbytes`` at ``offset`` of ``fd`` (for ``what``, named in the error),
    keeping its size (ENOSPC raised as OSError). A file system that cannot reserve space
    is left alone (posix_fallocate would write zeros)."""
    if _libc.fallocate(fd, FALLOC_FL_KEEP_SIZE, offset, nbytes) != 0:
        err = ctypes.get_errno()
        if err not in _FALLOCATE_UNSUPPORTED:
            raise OSError(err, f"cannot reserve {nbytes} bytes for {what}: {os.strerror(err)}")


def reserve_after_end(path: str, nbytes: int) -> None:
    """Reserve ``nbytes`` past the current end of the existing file ``path``."""
    fd = os.open(path, os.O_WRONLY)
    try:
        reserve_space(fd, os.fstat(fd).st_size, nbytes, path)
    finally:
        os.close(fd)


def trim(path: str) -> None:
    """Free the space reserved past the end of ``path``."""
    os.truncate(path, os.path.getsize(path))

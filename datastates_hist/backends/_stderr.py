"""What a C library prints on stderr during one call, kept instead of shown."""

from __future__ import annotations

import contextlib
import os
import re
import sys
import threading

_lock = threading.Lock()  # one redirection of fd 2 at a time
_COLOURS = re.compile(r"\x1b\[[0-9;]*m")


def _flush_python_stderr() -> None:
    if sys.stderr is not None:
        sys.stderr.flush()


@contextlib.contextmanager
def stderr_kept(kept: list[str]):
    """Send file descriptor 2 into memory for the duration, and append what was
    written there (colour codes removed, whitespace collapsed) to ``kept``.

    fd 2 is the whole process's, so this is only used around a call made on an
    error path (the ADIOS2 binding closing a file whose step has already
    failed), for milliseconds; whatever another thread prints meanwhile is kept
    in the same exception, not lost. A memfd, not a file: the disk may be the
    full one.
    """
    with _lock:
        _flush_python_stderr()
        saved, memory = os.dup(2), os.memfd_create("stderr-kept")
        try:
            os.dup2(memory, 2)
            yield
        finally:
            _flush_python_stderr()
            os.dup2(saved, 2)
            os.close(saved)
            os.lseek(memory, 0, os.SEEK_SET)
            with open(memory, "rb") as f:
                text = f.read().decode(errors="replace")
            kept.append(" ".join(_COLOURS.sub("", text).split()))

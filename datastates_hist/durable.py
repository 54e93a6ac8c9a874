"""Durability on a POSIX file system: what makes written bytes and renames survive a crash.

A unit is written at a temporary name, its files and folders are fsynced
(:func:`fsync_tree`), and it is renamed to its final name with the rename
itself made durable (:func:`rename_into_place`). :func:`remove_tree` deletes
a unit, never following a symbolic link.
"""

from __future__ import annotations

import os
import shutil


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: str) -> None:
    """fsync every file under ``path`` (or the file itself), then the folders."""
    if os.path.isdir(path):
        for root, _dirs, files in os.walk(path):
            for f in files:
                fsync_path(os.path.join(root, f))
            fsync_dir(root)
    else:
        fsync_path(path)


def remove_tree(path: str) -> None:
    """Delete a file or a folder; a symbolic link is removed itself, never followed."""
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)  # removes links inside as links
        elif os.path.lexists(path):
            os.remove(path)
    except FileNotFoundError:
        pass  # removed meanwhile (by another rank)


def rename_into_place(tmp_path: str, final_path: str) -> None:
    """Rename the durable ``tmp_path`` to ``final_path`` atomically, and make the rename durable."""
    if os.path.exists(final_path):  # left by a crash before its step was committed
        remove_tree(final_path)
    os.rename(tmp_path, final_path)
    fsync_dir(os.path.dirname(final_path))

"""Files and folders replaced so that a kill at any point leaves either the old one or the new one, whole.

Each writes the new content under a temporary name, flushes it to disk (``fsync``), and renames it into place (one
atomic step on POSIX); a folder to drop is renamed out of the names readers look for before it is deleted, so a
kill in the middle of the deletion leaves a ``.old`` folder that nothing reads as complete (``sweep``).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

OLD = ".old"  # a folder being deleted
TMP = ".tmp"  # a file or folder being written


def fsync_tree(path: Path) -> None:
    """Every file under ``path`` (or ``path`` itself) on disk, and each folder's entries."""
    files = [path] if path.is_file() else [f for f in path.rglob("*") if f.is_file()]
    for f in files:
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    if path.is_dir():
        for folder in [path, *(d for d in path.rglob("*") if d.is_dir())]:
            fsync_dir(folder)


def fsync_dir(path: Path) -> None:
    """Make renames and new entries in ``path`` durable (POSIX: a directory's entries are flushed by fsync on it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # a platform without directory handles: the rename is still atomic, only not yet durable
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text(path: Path, text: str) -> None:
    """``path`` holds ``text``, or (killed before the rename) what it held before."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + TMP)
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def remove_folder(path: Path) -> None:
    """Delete ``path``: first renamed to ``<name>.old`` (what readers never take), then removed."""
    if not path.exists():
        return
    doomed = path.with_name(path.name + OLD)
    shutil.rmtree(doomed, ignore_errors=True)  # a leftover of a kill during an earlier removal
    os.replace(path, doomed)
    fsync_dir(path.parent)
    shutil.rmtree(doomed)


def replace_folder(tmp: Path, final: Path) -> None:
    """Make the fully written folder ``tmp`` be ``final``, replacing any ``final`` there. A kill between the two
    renames leaves ``final.old`` (the previous, whole) and ``tmp`` (the new, whole), never a half of either."""
    fsync_tree(tmp)
    if final.exists():
        doomed = final.with_name(final.name + OLD)
        shutil.rmtree(doomed, ignore_errors=True)
        os.replace(final, doomed)
    os.replace(tmp, final)  # the commit point
    fsync_dir(final.parent)
    shutil.rmtree(final.with_name(final.name + OLD), ignore_errors=True)


def sweep(root: Path, prefix: str) -> None:
    """Remove what kills left under ``root``: ``<prefix>*.tmp`` (half written) and ``<prefix>*.old`` (half deleted)."""
    if root.is_dir():
        for p in [*root.glob(f"{prefix}*{TMP}"), *root.glob(f"{prefix}*{OLD}")]:
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)

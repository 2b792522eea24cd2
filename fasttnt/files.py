"""Files and folders replaced so that a kill at any point leaves either the old one or the new one, whole.

Each writes the new content under a temporary name, flushes it to disk (``fsync``), and renames it into place (one
atomic step on POSIX); a folder to drop is renamed out of the names readers look for before it is deleted, so a
kill in the middle of the deletion leaves a ``.old`` folder that nothing reads as complete (``sweep``). A folder
replaced by another is first moved aside whole (``.replaced``): a kill between the two renames leaves no folder by
its name until ``restore_replaced`` (which ``sweep`` and a run's start call) puts the previous one back.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

OLD = ".old"  # a folder being deleted
REPLACED = ".replaced"  # a whole folder moved aside by replace_folder until its replacement is in place
TMP = ".tmp"  # a file or folder being written


def fsync_tree(path: Path) -> None:
    """Every file under ``path`` (or ``path`` itself) on disk, and each folder's entries."""
    paths = [path] if path.is_file() else [f for f in path.rglob("*") if f.is_file()]
    for f in paths:
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
    shutil.rmtree(doomed, ignore_errors=True)  # what a failed deletion leaves, sweep removes


def replace_folder(tmp: Path, final: Path) -> None:
    """Make the fully written folder ``tmp`` be ``final``, replacing any ``final`` there. A kill between the two
    renames leaves ``final.replaced`` (the previous, whole) and ``tmp`` (the new, whole), never a half of either;
    ``restore_replaced`` puts the previous one back."""
    fsync_tree(tmp)
    aside = final.with_name(final.name + REPLACED)
    restore_replaced(final)
    if final.exists():
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(final, aside)
    os.replace(tmp, final)  # the commit point
    fsync_dir(final.parent)
    shutil.rmtree(aside, ignore_errors=True)


def restore_replaced(final: Path) -> None:
    """``final`` back where a kill between ``replace_folder``'s renames left it aside (whole: it moved in one rename,
    and its deletion starts only once its replacement is in place)."""
    aside = final.with_name(final.name + REPLACED)
    if not final.exists() and aside.is_dir():
        os.replace(aside, final)
        fsync_dir(final.parent)


def sweep(root: Path, prefix: str) -> None:
    """Undo what kills left under ``root``: a ``<prefix>*`` folder moved aside by ``replace_folder`` put back, then
    ``<prefix>*.tmp`` (half written), ``<prefix>*.old`` (half deleted) and ``.replaced`` folders already replaced
    removed."""
    if root.is_dir():
        for aside in root.glob(f"{prefix}*{REPLACED}"):
            restore_replaced(aside.with_name(aside.name.removesuffix(REPLACED)))
        for p in [*root.glob(f"{prefix}*{TMP}"), *root.glob(f"{prefix}*{OLD}"), *root.glob(f"{prefix}*{REPLACED}")]:
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)

"""Files that survive a crash and that two nodes cannot both create: the batch ledger's only primitives.

Everything is plain POSIX that works on the shared filesystems of a cluster (NFS, Lustre, GPFS): a write
lands in a temporary file, is fsync'ed, and is renamed into place; exclusivity comes from O_EXCL creation
or from link(2), which fails when the name exists. No flock: it is not reliable across nodes.
"""
from __future__ import annotations

import os
import secrets
from pathlib import Path


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_fsynced(path: Path, data: bytes, flags: int) -> None:
    fd = os.open(path, flags, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def _temporary(path: Path) -> Path:
    return path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")


def write_durable(path: Path, data: bytes) -> None:
    """Replace `path` with `data`: readers see the old or the new content, and after a crash one of them."""
    tmp = _temporary(path)
    try:
        _write_fsynced(tmp, data, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def create_exclusive(path: Path, data: bytes) -> bool:
    """Create `path` with `data` unless it exists (then False). Exactly one of racing creators wins, and the
    content is complete before the name appears (written aside, then linked), so a reader never sees half."""
    tmp = _temporary(path)
    try:
        _write_fsynced(tmp, data, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        except OSError:
            if os.stat(tmp).st_nlink != 2:   # NFS: a retried link may report an error although it was made
                raise
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)
    return True

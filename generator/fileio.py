"""Writing files so that a fault never leaves one half-written.

Every file deepgen writes goes through `write_atomic`: the bytes go to a
temporary file in the same folder, are flushed to the disk (fsync), and the
temporary is renamed over the target. A rename within one folder is atomic on
POSIX, so after ENOSPC, SIGKILL or a power cut the target holds either its old
content or the new, never a truncated mix. `stage` + `Staged.commit` split the
same steps for a caller that must prepare several files before replacing any.
"""

from __future__ import annotations

import os
from pathlib import Path

TEMP_PREFIX = ".deepgen-tmp-"  # temporaries beside their target; swept by `remove_temporaries`


def fsync_dir(folder: Path) -> None:
    """Make a rename in folder durable (best effort: some filesystems refuse a folder's fsync)."""
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class Staged:
    """New content for `target`, written and synced to a temporary beside it."""

    def __init__(self, target: Path, temp: Path):
        self.target, self.temp = target, temp

    def commit(self) -> None:
        """Replace the target by the staged content (one atomic rename)."""
        os.replace(self.temp, self.target)
        fsync_dir(self.target.parent)

    def discard(self) -> None:
        try:
            os.unlink(self.temp)
        except FileNotFoundError:
            pass


def stage(path, data: bytes, mode: int | None = None) -> Staged:
    """Write data to a synced temporary beside path (its folder is made if missing);
    `mode` defaults to the existing file's permissions, else 0o644 less the umask."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    temp = target.parent / f"{TEMP_PREFIX}{os.getpid()}-{target.name}"
    if mode is None:
        try:
            mode = target.stat().st_mode & 0o7777 if target.is_file() and not target.is_symlink() else None
        except OSError:
            mode = None
    if mode is None:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o600)
    try:
        view = memoryview(data)
        while view:
            done = os.write(fd, view)
            view = view[done:]
        os.fchmod(fd, mode)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        try:
            os.unlink(temp)
        except OSError:
            pass
        raise
    os.close(fd)
    return Staged(target, temp)


def write_atomic(path, data: bytes, mode: int | None = None) -> None:
    """Replace path's content by data atomically (see the module docstring). A symlink
    at path is replaced by the file, never written through."""
    stage(path, data, mode).commit()


def remove_temporaries(folder) -> list:
    """Delete the temporaries an interrupted write left directly in folder; their paths."""
    removed = []
    folder = Path(folder)
    if not folder.is_dir():
        return removed
    for entry in sorted(folder.iterdir()):
        if entry.name.startswith(TEMP_PREFIX) and (entry.is_file() or entry.is_symlink()):
            entry.unlink()
            removed.append(entry)
    return removed

"""Build a directory under a scratch name beside its final path, then swap it in whole.

The final path always names a complete directory: the old one until the swap, the new one after. On
Linux the swap is one renameat2(RENAME_EXCHANGE); where the filesystem lacks it (NFS, other systems)
the old directory is first renamed to a backup name, which the next run renames back if a crash came
between the two renames. Every scratch directory is flock()ed by the process that owns it, so a later
run can tell leftovers of a killed run (unlocked: removed) from those of a run still going (locked:
left alone).
"""
from __future__ import annotations

import ctypes
import errno
import glob
import os
import secrets
import shutil
import stat
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

try:
    import fcntl
except ImportError:  # Windows: without flock a live run's scratch cannot be told from a dead one's
    fcntl = None

SCRATCH = ".prepare-tmp-"
BACKUP = ".prepare-old-"


def _lock(path: Path, wait: bool) -> int | None:
    """An fd holding an exclusive flock on directory `path`; None if another process holds it (or the
    filesystem cannot lock directories, when nothing can be known about the owner)."""
    if fcntl is None:
        return None
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        return fd
    except OSError:
        os.close(fd)
        return None


def _fsync(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # directories cannot be fsynced everywhere; the data files already are
        pass
    finally:
        os.close(fd)


def remove_leftovers(final: Path) -> None:
    """Remove scratch directories of killed runs beside `final`, and restore a backup that a crash
    mid-swap left without its replacement."""
    if fcntl is None:
        return
    stem = glob.escape(final.name)
    inside = sorted(final.glob(SCRATCH + "*")) if final.is_dir() and not final.is_symlink() else []
    for kind in (BACKUP, SCRATCH):  # backups first: a restore must not wait for a scratch sweep
        for path in sorted(final.parent.glob(stem + kind + "*")) + (inside if kind == SCRATCH else []):
            if path.is_symlink() or not path.is_dir():
                continue
            fd = _lock(path, wait=False)
            if fd is None:
                continue
            try:
                if kind == BACKUP and not os.path.lexists(final):
                    os.rename(path, final)
                else:
                    shutil.rmtree(path, ignore_errors=True)
            finally:
                os.close(fd)


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths; False where the system or filesystem cannot."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # glibc < 2.28, musl
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _swap_in(scratch: Path, final: Path) -> None:
    for path in (scratch, *(p for p in scratch.iterdir() if p.is_file())):
        _fsync(path)
    if not os.path.lexists(final):
        os.rename(scratch, final)
        _fsync(final.parent)
        return
    if scratch.parent == final:  # built inside the empty directory: it is kept, its entries moved up
        _move_into(scratch, final)
        return
    os.chmod(scratch, stat.S_IMODE(os.stat(final).st_mode))  # a shared directory stays shared
    if _exchange(scratch, final):
        shutil.rmtree(scratch, ignore_errors=True)  # now the old directory
    else:
        backup = final.with_name(final.name + BACKUP + f"{os.getpid()}-{secrets.token_hex(4)}")
        # Locked before it takes the backup name, so a concurrent remove_leftovers never restores it
        # in the instant before the new directory takes its place.
        fd = _lock(final, wait=True)
        try:
            os.rename(final, backup)
            try:
                os.rename(scratch, final)
            except OSError:
                os.rename(backup, final)
                raise
        finally:
            if fd is not None:
                os.close(fd)
        shutil.rmtree(backup, ignore_errors=True)
    _fsync(final.parent)


def _move_into(scratch: Path, final: Path) -> None:
    """Fill the empty directory `final` with scratch's entries, keeping the directory itself: swapping it out
    failed on a mount point (a container's empty volume: EBUSY) and left a shell inside it (`--out .`) in a
    deleted directory. The scratch directory is inside `final` (one filesystem); an error moves back what was
    moved, so `final` holds only the scratch directory, which is removed."""
    moved = []
    try:
        for entry in sorted(scratch.iterdir()):
            os.rename(entry, final / entry.name)
            moved.append(entry.name)
    except BaseException:
        for name in moved:
            try:
                os.rename(final / name, scratch / name)
            except OSError:
                pass
        raise
    shutil.rmtree(scratch, ignore_errors=True)
    _fsync(final)


@contextmanager
def building(final: Path) -> Iterator[Path]:
    """A fresh, locked scratch directory beside `final`; on a clean exit it replaces `final`, on an
    exception it is removed and `final` is left as it was."""
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_leftovers(final)
    # An existing empty directory is kept (it may be a mount point, or a shell's working directory): the
    # scratch directory goes inside it, on its filesystem.
    inside = final.is_dir() and not final.is_symlink() and not any(final.iterdir())
    for _ in range(8):
        name = SCRATCH + f"{os.getpid()}-{secrets.token_hex(4)}"
        scratch = final / name if inside else final.with_name(final.name + name)
        scratch.mkdir()
        # A concurrent remove_leftovers may take the lock between mkdir and flock and remove the
        # directory: waiting for the lock and checking that the directory is still there covers it.
        fd = _lock(scratch, wait=True)
        if fd is None or os.path.exists(scratch) and os.path.samestat(os.fstat(fd), os.stat(scratch)):
            break
        os.close(fd)
    else:
        raise OSError(f"could not create a scratch directory beside {final}")
    try:
        yield scratch
        _swap_in(scratch, final)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    finally:
        if fd is not None:
            os.close(fd)

"""The disk tier's file operations: a private directory, atomic writes, quiet deletes.

Writes are atomic the classic way (temp file / fsync / rename / fsync of the directory,
as described for SQLite's and LMDB's crash safety and done by ``atomicwrites``): a temp
file opened ``O_EXCL`` with mode 0600, written, fsynced, ``os.replace``-d onto its final
name, then the directory is fsynced. A crash leaves at most the temp file.
"""

from __future__ import annotations

import logging
import os
import secrets
import stat
from pathlib import Path

log = logging.getLogger("cache.disk")  # the tier's own logger


def secure_dir(path: Path) -> None:
    """Make ``path`` a directory of this user with mode exactly 0700 (created if missing).

    Raises:
        NotADirectoryError / PermissionError / OSError, naming the path.
    """
    try:
        if not path.exists():
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.stat(path)
    except OSError as e:
        raise OSError(e.errno, f"disk cache directory {path} cannot be created: {e.strerror}") from e
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(f"disk cache path {path} is not a directory")
    if hasattr(os, "geteuid") and st.st_uid != os.geteuid():
        raise PermissionError(f"disk cache directory {path} is owned by uid {st.st_uid}, not {os.geteuid()}")
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(path, 0o700)
    if not os.access(path, os.W_OK | os.X_OK):
        raise PermissionError(f"disk cache directory {path} is not writable")


def unlink_quietly(path: Path) -> None:
    """Delete ``path``; a missing file is fine, another failure is logged, never raised."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        log.warning("disk cache: cannot delete %s: %s", path, e)


def write_atomic(final: Path, payload: bytes, tmp_prefix: str) -> None:
    """Write ``payload`` to ``final`` (mode 0600) so that ``final`` is either absent or
    complete: through a temp file named ``tmp_prefix`` + random hex in the same directory,
    removed again when the write fails.

    Raises:
        OSError: the write failed (ENOSPC, EFBIG, EDQUOT, EACCES, EIO, ...); ``final`` is untouched.
    """
    tmp = final.parent / f"{tmp_prefix}{secrets.token_hex(8)}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
        try:
            os.fchmod(fd, 0o600)  # whatever the umask
            view = memoryview(payload)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, final)
    except OSError:
        unlink_quietly(tmp)
        raise
    try:
        dfd = os.open(final.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError as e:  # the file is complete; only its new name may not be durable yet
        log.debug("disk cache: fsync of %s failed: %s", final.parent, e)

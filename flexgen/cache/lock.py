"""Inter-process lock: fcntl.flock on one lock file per kernel.

The kernel releases a flock when its holder dies, however it dies, so a lock left
by a killed process never blocks the next run; the stale file is simply reused.
A holder that is stopped or hung keeps its lock, so waiting ends after
FLEXGEN_LOCK_TIMEOUT seconds (default 300) with LockTimeoutError.
Lock files are private (0600) and opened without following links.
"""
from __future__ import annotations

import errno
import fcntl
import os
import stat
import time
import warnings
from pathlib import Path

from . import paths, safefs
from .errors import LockTimeoutError, UnsafeCacheError

_POLL_SECONDS = 0.02


class FileLock:
    """`timeout`: seconds to wait for the lock (None: FLEXGEN_LOCK_TIMEOUT)."""

    def __init__(self, path: str | Path, timeout: float | None = None, notice_after: float = 15.0, what: str = ""):
        self.path = Path(path)
        self.timeout = paths.lock_timeout() if timeout is None else timeout
        self.notice_after = notice_after
        self.what = what
        self._fd: int | None = None

    def _open(self) -> int:
        dir_fd = safefs.open_path(self.path.parent, create=True)
        try:
            fd = os.open(self.path.name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                         safefs.FILE_MODE, dir_fd=dir_fd)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise UnsafeCacheError(f"the lock {self.path} is a symbolic link; flexgen follows no links "
                                       "inside its cache") from None
            raise
        finally:
            os.close(dir_fd)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise UnsafeCacheError(f"the lock {self.path} is not a regular file")
        return fd

    def acquire(self) -> None:
        fd = self._open()
        start = time.monotonic()
        noticed = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                waited = time.monotonic() - start
                if waited >= self.timeout:
                    os.close(fd)
                    raise LockTimeoutError(
                        f"flexgen: gave up after {waited:.1f} s waiting for the lock {self.path} "
                        f"({self.what or 'a compile'}): another process holds it and has not finished; it may be "
                        f"stopped or hung. End that process, or set FLEXGEN_LOCK_TIMEOUT (seconds, now "
                        f"{self.timeout:g}; 'inf' waits forever) to wait longer.") from None
                if not noticed and waited > self.notice_after:
                    warnings.warn(f"flexgen: waiting for another process to finish {self.what or 'a compile'} "
                                  f"(lock {self.path}; giving up after {self.timeout:g} s, FLEXGEN_LOCK_TIMEOUT)",
                                  stacklevel=3)
                    noticed = True
                time.sleep(_POLL_SECONDS)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "FileLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

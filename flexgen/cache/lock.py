"""Inter-process lock: fcntl.flock on one lock file per kernel.

The kernel releases a flock when its holder dies, however it dies, so a lock left
by a killed process never blocks the next run; the stale file is simply reused.
"""
from __future__ import annotations

import fcntl
import os
import time
import warnings
from pathlib import Path


class FileLock:
    def __init__(self, path: str | Path, timeout: float | None = None, notice_after: float = 15.0, what: str = ""):
        self.path = Path(path)
        self.timeout = timeout
        self.notice_after = notice_after
        self.what = what
        self._fd: int | None = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        start = time.monotonic()
        noticed = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                waited = time.monotonic() - start
                if self.timeout is not None and waited > self.timeout:
                    os.close(fd)
                    raise TimeoutError(f"gave up after {waited:.0f}s waiting for lock {self.path}") from None
                if not noticed and waited > self.notice_after:
                    warnings.warn(f"flexgen: waiting for another process to finish {self.what or 'a compile'} "
                                  f"(lock {self.path})", stacklevel=3)
                    noticed = True
                time.sleep(0.02)
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

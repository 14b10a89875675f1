"""An exclusive lock on a run directory, so two runs never write one directory at once.

``with RunLock(run_dir): ...`` takes an ``fcntl.flock`` on ``run_dir/.lock`` (and writes the
holder's pid, host and start time into it). A second run on the same directory fails within
a fifth of a second (the time it gives a reader's instant check, :func:`is_held`, to let go)
with :class:`RunLockedError` naming the holder and the fix. The operating system drops the
lock when its process dies (kill -9 included), so a stale ``.lock`` file left by a crashed run
never blocks the next one: it is simply taken over.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time

__all__ = ["RunLock", "RunLockedError", "is_held"]


class RunLockedError(RuntimeError):
    """Another live process holds the run directory."""


# a reader's check (:func:`is_held`) holds a shared lock for an instant: a run that starts
# in that instant tries again this many times, this far apart, before it is refused
_RETRIES, _RETRY_S = 10, 0.02


class RunLock:
    """Exclusive, non-blocking lock of ``directory`` (created if missing)."""

    def __init__(self, directory):
        self.directory = os.path.abspath(os.fspath(directory))
        self.path = os.path.join(self.directory, ".lock")
        self._fd: int | None = None

    def acquire(self) -> RunLock:
        os.makedirs(self.directory, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            _flock_soon(fd)
        except OSError:
            holder = _read_holder(fd)
            os.close(fd)
            raise RunLockedError(
                f"run directory {self.directory} is in use by another run ({holder}); two "
                "runs writing one directory would corrupt its metrics and checkpoints. Fix: "
                "wait for that run to finish, stop it, or give this run another directory "
                "(out=...)") from None
        info = {"pid": os.getpid(), "host": socket.gethostname(),
                "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _flock_soon(fd: int) -> None:
    """Take the exclusive lock on ``fd``, trying again for a moment where it is held (a
    reader's instant shared lock); ``OSError`` where it is still held after that."""
    for attempt in range(_RETRIES + 1):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except OSError:
            if attempt == _RETRIES:
                raise
            time.sleep(_RETRY_S)


def is_held(directory) -> bool:
    """Whether a live process holds ``directory``'s run lock now (a reader's check: it takes
    a shared lock for an instant and drops it, so it never blocks or breaks a run)."""
    path = os.path.join(os.fspath(directory), ".lock")
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def _read_holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
        return f"pid {info['pid']} on {info['host']} since {info['since']}"
    except (ValueError, KeyError, OSError):
        return "holder unknown"

"""Atomic file writes: a reader sees the old file or the new one, never half of one.

    with atomic_open(path, "wb") as f:     # any writer that takes a file object
        np.savez(f, **arrays)
    atomic_write_bytes(path, data)
    atomic_write_text(path, text)
    with exclusive(directory / ".lock"):   # one process at a time builds what is cached there
        ...

The data goes to a temporary file in the target's directory, is flushed and fsynced, gets the
permissions an ordinary ``open`` would give it (``0o666`` less the umask, where ``mkstemp``
alone gives ``0o600``), and is renamed over the target. On any failure, an interrupt included,
the temporary file is removed and the previous file is left as it was.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

__all__ = ["atomic_open", "atomic_write_bytes", "atomic_write_text", "default_file_mode",
           "exclusive", "move_aside", "unused_name", "writable_dir", "UnusableDirError"]


class UnusableDirError(OSError):
    """A directory cannot be created or written; the message names it and the fix."""


def writable_dir(path: str | os.PathLike, what: str, fix: str, *, root=None) -> Path:
    """Create ``path`` (and its parents) or raise :class:`UnusableDirError` in one line:
    ``what`` names the directory for the user (``out=runs/x``), ``fix`` says what to do.
    ``root``: the directory the user chose, checked for being a file first."""
    path = Path(path)
    try:  # exists() itself fails on a name the filesystem refuses (too long)
        for p in (Path(root) if root is not None else path, path):
            if p.exists() and not p.is_dir():
                raise UnusableDirError(f"{what}: {p} is a file, not a directory. Fix: {fix}")
        path.mkdir(parents=True, exist_ok=True)
    except UnusableDirError:
        raise
    except OSError as e:
        raise UnusableDirError(f"{what}: cannot create {path} ({e.strerror}). "
                               f"Fix: {fix}") from None
    try:  # a real write: os.access says yes for root on read-only mounts and /sys
        fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise UnusableDirError(f"{what}: {path} is not writable ({e.strerror}). "
                               f"Fix: {fix}") from None
    return path


@contextlib.contextmanager
def exclusive(lock_path: str | os.PathLike) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``lock_path`` (created if missing), waiting while another
    process (or another open of the file in this one) holds it. The operating system drops it
    when its holder dies, so a crashed builder never blocks the next one."""
    with open(lock_path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def default_file_mode() -> int:
    """The mode ``open()`` gives a new file here: ``0o666`` less the process umask, read from
    ``/proc/self/status`` where the kernel reports it. Elsewhere the umask is read by setting
    it and back, a moment in which a file another thread creates (an async checkpoint save)
    would get no umask at all."""
    try:
        with open("/proc/self/status") as f:
            umask = next((int(line.split()[1], 8) for line in f
                          if line.startswith("Umask:")), None)
    except (OSError, ValueError, IndexError):
        umask = None
    if umask is None:
        umask = os.umask(0)
        os.umask(umask)
    return 0o666 & ~umask


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "wb",
                encoding: str | None = None) -> Iterator[IO]:
    """A file object whose content replaces ``path`` when the block exits without error;
    ``mode`` is ``"wb"`` or ``"w"`` (text, ``encoding`` default UTF-8). Creates the parent
    directory."""
    if mode not in ("wb", "w"):
        raise ValueError(f"atomic_open: mode={mode!r}; use 'wb' or 'w'")
    path = Path(path)
    if path.is_dir():  # before anything is written: the rename would fail at the end
        raise IsADirectoryError(f"cannot write {path}: it is a directory. Fix: name a file")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        file = next((p for p in path.parents if p.exists() and not p.is_dir()), None)
        why = f"{file} is a file, not a directory" if file else e.strerror
        raise UnusableDirError(f"cannot write {path}: cannot create its folder {path.parent} "
                               f"({why}). Fix: name a file in a writable folder") from None
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        kw = {} if mode == "wb" else {"encoding": encoding or "utf-8"}
        with os.fdopen(fd, mode, **kw) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, default_file_mode())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    with atomic_open(path, "wb") as f:
        f.write(data)
    return Path(path)


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    with atomic_open(path, "w") as f:
        f.write(text)
    return Path(path)


def unused_name(stem: str | os.PathLike) -> str:
    """``<stem>-<time>``, or ``<stem>-<time>-<n>`` where a file of that name exists already
    (something set aside twice within one second keeps both)."""
    first = f"{stem}-{time.strftime('%Y%m%dT%H%M%S')}"
    name, n = first, 1
    while os.path.lexists(name):
        n += 1
        name = f"{first}-{n}"
    return name


def move_aside(path: str | os.PathLike, tag: str = "corrupt") -> Path:
    """Move a file or directory that cannot be trusted out of the way, kept beside it as
    ``<name>.<tag>-<time>`` (a cache then rebuilds it); returns where it went."""
    path = Path(path)
    dest = Path(unused_name(path.with_name(f"{path.name}.{tag}")))
    os.replace(path, dest)
    return dest

"""The disk tier's shared accounting: one file per ``--disk-cache-dir``, ``DIR/ledger`` (0600,
16 bytes, little-endian), kept by every server process of every model that uses the directory:

    bytes used    every store's block files and temporaries, counted together
    capacity      the directory's bound (engine/contracts/disk_capacity.py); 0: none recorded

Two locks on the file (``flock``; a thread lock besides, since flock is per open file):

    exclusive (``locked``)   every change of the count, every trim (its scan and removals), and
                             making or removing a file the count covers, which happen together
                             with their count under it
    shared (``shared``)      renaming a written block into place: a scan never runs while a
                             name changes (a listing during a rename may show neither name)

So, seen under the exclusive lock, the count is at least the bytes of the files there. It can
run high (a file someone removed by hand, a process killed while writing, two servers writing
one block at once), never low; each trim rescans the directory and sets it to what is there.
A file made empty (new, or cut short) is filled by a rescan first.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import struct
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from engine.contracts.disk_guard import NOFOLLOW, Untrusted, check_owner

_LEDGER = struct.Struct("<QQ")


class Ledger:
    """``rescan``: the bytes the directory holds, read from the files (run under the lock)."""

    def __init__(self, path: str, rescan: Callable[[], int]) -> None:
        self.path = path
        self.rescan = rescan
        self._thread_lock = threading.Lock()

    def check(self) -> None:
        """Refuse (``Untrusted``) a ledger that is not a regular file of this user's that
        group and others cannot write (made here if missing)."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_CREAT | NOFOLLOW, 0o600)
        except OSError as exc:
            if exc.errno != errno.ELOOP:
                raise
            raise Untrusted(f"the disk cache's ledger {self.path} is a symbolic link: remove "
                            "it and a new one is made") from None
        try:
            st = os.fstat(fd)
        finally:
            os.close(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Untrusted(f"the disk cache's ledger {self.path} is not a regular file: "
                            "remove it and a new one is made")
        check_owner(self.path, st, "the disk cache's ledger")

    @contextmanager
    def locked(self) -> Iterator[int]:
        """The file, locked against every other process and thread (its fd)."""
        with self._thread_lock:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | NOFOLLOW, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                yield fd
            finally:
                os.close(fd)  # releases the flock

    @contextmanager
    def shared(self) -> Iterator[None]:
        """Held by any number of renames at once, never while the exclusive lock is held."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            yield
        finally:
            os.close(fd)

    @staticmethod
    def read(fd: int) -> tuple[int | None, int]:
        """(bytes used, None when not yet counted; the capacity, 0 when none is recorded)."""
        data = os.pread(fd, _LEDGER.size, 0)
        if len(data) < _LEDGER.size:
            return None, 0
        used, capacity = _LEDGER.unpack(data)
        return used, capacity

    @staticmethod
    def write(fd: int, used: int, capacity: int) -> None:
        os.pwrite(fd, _LEDGER.pack(max(0, used), capacity), 0)

    def current(self, fd: int) -> tuple[int, int]:
        """(bytes used, capacity), under the lock; counted from the files if not yet."""
        used, capacity = self.read(fd)
        if used is None:
            used = self.rescan()
            self.write(fd, used, capacity)
        return used, capacity

    def state(self) -> tuple[int, int]:
        with self.locked() as fd:
            return self.current(fd)

    def record_capacity(self, capacity: int) -> int:
        """Raise the recorded capacity to ``capacity`` if it is larger: the directory's now."""
        with self.locked() as fd:
            used, recorded = self.current(fd)
            if capacity > recorded:
                self.write(fd, used, capacity)
                recorded = capacity
            return recorded

    def add(self, fd: int, delta: int) -> None:
        """``delta`` bytes more (negative: a file removed), under the lock (``fd``)."""
        used, capacity = self.current(fd)
        self.write(fd, used + delta, capacity)

    def recount(self, count: Callable[[], int]) -> int:
        """Set the count to ``count()`` (a trim: it removes files and returns what is left),
        run under the lock so that no reservation falls between its scan and the count."""
        with self.locked() as fd:
            _, capacity = self.read(fd)
            used = count()
            self.write(fd, used, capacity)
            return used

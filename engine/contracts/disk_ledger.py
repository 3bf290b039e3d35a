"""The disk tier's shared accounting: one count of the bytes a store directory holds, kept by
every server process that uses it, so that all of them together stay under
``--disk-cache-gb``.

The count is 8 bytes (little-endian) in ``<fingerprint>/usage`` (0600), read and written
under an exclusive ``flock`` of that file (and a thread lock: flock is per open file, and a
process's threads would share one). A writer reserves its block's bytes before it writes and
gives them back if the write fails; a removal takes its bytes off. The count can only run
high (a file someone removed by hand, a process killed between reserving and writing), never
low, so the bound holds; each trim (``DiskStore.trim``, run under the same lock) rescans the
directory and sets the count to what is there. A file made empty (new, or cut short) is
filled by a rescan first.
"""

from __future__ import annotations

import fcntl
import os
import struct
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from engine.contracts.disk_guard import NOFOLLOW

_COUNT = struct.Struct("<Q")


class Ledger:
    """``rescan``: the bytes the directory holds, read from the files (run under the lock)."""

    def __init__(self, path: str, rescan: Callable[[], int]) -> None:
        self.path = path
        self.rescan = rescan
        self._thread_lock = threading.Lock()

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

    @staticmethod
    def read(fd: int) -> int | None:
        data = os.pread(fd, _COUNT.size, 0)
        return _COUNT.unpack(data)[0] if len(data) == _COUNT.size else None

    @staticmethod
    def write(fd: int, used: int) -> None:
        os.pwrite(fd, _COUNT.pack(max(0, used)), 0)

    def used(self) -> int:
        with self.locked() as fd:
            return self._current(fd)

    def _current(self, fd: int) -> int:
        used = self.read(fd)
        if used is None:
            used = self.rescan()
            self.write(fd, used)
        return used

    def reserve(self, size: int, capacity: int, make_room: Callable[[], int]) -> bool:
        """Count ``size`` more bytes unless that passes ``capacity`` (0: no limit) even after
        ``make_room()`` (the store's trim, which returns the bytes left) ran."""
        with self.locked() as fd:
            used = self._current(fd)
            if capacity and used + size > capacity:
                used = make_room()
                if used + size > capacity:
                    self.write(fd, used)
                    return False
            self.write(fd, used + size)
            return True

    def add(self, delta: int) -> None:
        """``delta`` bytes more (a negative one: a reservation given back, a file removed)."""
        with self.locked() as fd:
            self.write(fd, self._current(fd) + delta)

    def recount(self, count: Callable[[], int]) -> int:
        """Set the count to ``count()`` (a trim: it removes files and returns what is left),
        run under the lock so that no reservation falls between its scan and the count."""
        with self.locked() as fd:
            used = count()
            self.write(fd, used)
            return used

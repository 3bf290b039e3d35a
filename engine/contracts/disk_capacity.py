"""The disk tier's capacity: one per ``--disk-cache-dir``, however many models and servers
share the directory, kept through one count (engine/contracts/disk_ledger.py)::

    DIR/
      ledger                                    the bytes every store holds, and the capacity
      <fingerprint>/<hh>/<hash>.kv              one model's blocks (engine/contracts/disk_cache.py)
      <fingerprint>/<hh>/.<hash>.kv.<pid>.<random>.tmp   a block being written, at its full size

The capacity is the largest ``--disk-cache-gb`` any server has given the directory: the first
server with a limit records it, one with a larger limit raises it, one with a smaller limit (or
0, no limit of its own) keeps the recorded one, so that a replica started with a smaller number
never trims the others' files down to it. To lower it, stop the servers and remove
``DIR/ledger`` (the next server records its own; the count is rebuilt from the files).

A writer reserves its block's bytes and makes the block's temporary (sized whole at once) under
the ledger's lock; a write that would pass the capacity first removes the least recently used
files of every store in the directory (by modification time, which a read refreshes) down to
``TRIM_TO`` of it, and temporaries older than ``STALE_TMP_SECONDS`` (a killed writer's). No link
is followed: a ``<fingerprint>/`` or ``<hh>/`` that is a link, or a directory that is not this
user's or that others may write, is neither counted nor trimmed.
"""

from __future__ import annotations

import errno
import math
import os
import re
import stat
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import NamedTuple

from engine.contracts.disk_guard import open_dir, opened_dir
from engine.contracts.disk_ledger import Ledger

TRIM_TO = 0.9  # a write over the capacity first removes the oldest files down to this fraction
STALE_TMP_SECONDS = 600.0  # a temporary this old is a killed writer's: a trim removes it
FINGERPRINT = re.compile(r"[0-9a-f]{32}")
SUBDIR = re.compile(r"[0-9a-f]{2}")
_REFUSED = (errno.ELOOP, errno.ENOTDIR, errno.ENOENT)  # a link, not a directory, gone


class StoredFile(NamedTuple):
    mtime_ns: int
    size: int
    fingerprint: str
    subdir: str
    name: str


class Capacity:
    """The directory ``root``'s capacity and count, shared with every process using it."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.ledger = Ledger(os.path.join(root, "ledger"), lambda: self._trim(math.inf))
        self.files_removed = 0  # by this process's trims: room made

    def record(self, capacity: int) -> int:
        """Check the ledger and raise the directory's capacity to ``capacity`` if it is larger
        (0: no limit of this server's); the directory's capacity (0: none)."""
        self.ledger.check()
        return self.ledger.record_capacity(capacity)

    @property
    def limit(self) -> int:
        """The directory's capacity in bytes (0: no limit but the disk's)."""
        return self.ledger.state()[1]

    @property
    def used(self) -> int:
        """Bytes every store's files hold, by the shared count."""
        return self.ledger.state()[0]

    @contextmanager
    def reserving(self, size: int) -> Iterator[bool]:
        """Under the ledger's lock: whether ``size`` more bytes fit the capacity (after a trim
        if they did not). The body makes the file they are for; they are counted unless it
        raised."""
        with self.ledger.locked() as fd:
            used, capacity = self.ledger.current(fd)
            room = not capacity or used + size <= capacity
            if not room:
                used = self._trim(capacity * TRIM_TO - size)
                room = used + size <= capacity
            try:
                yield room
            except BaseException:
                self.ledger.write(fd, used, capacity)
                raise
            self.ledger.write(fd, used + size if room else used, capacity)

    @contextmanager
    def renaming(self) -> Iterator[None]:
        """While a written block's temporary is renamed into place: no trim scans meanwhile."""
        with self.ledger.shared():
            yield

    def remove(self, unlink: Callable[[], None], size: int) -> bool:
        """``unlink()`` a counted file and take its ``size`` bytes off together, under the lock
        (a rescan between the two would count it gone twice); False when it was gone already
        (whoever removed it counted that)."""
        with self.ledger.locked() as fd:
            try:
                unlink()
            except FileNotFoundError:
                return False
            self.ledger.add(fd, -size)
            return True

    def trim(self, target: float) -> None:
        """Remove the least recently used files of every store until the directory holds at
        most ``target`` bytes, and temporaries a killed writer left; the count becomes what is
        left. OSError when the directory itself is gone."""
        self.ledger.recount(lambda: self._trim(target))

    def _trim(self, target: float) -> int:
        """``trim``'s work, under the ledger's lock: the bytes left."""
        blocks, temporaries = self.scan()
        stale = time.time_ns() - int(STALE_TMP_SECONDS * 1e9)
        total = sum(f.size for f in blocks)
        for tmp in temporaries:
            if tmp.mtime_ns < stale:
                self._unlink(tmp)
            else:
                total += tmp.size  # sized whole when it was made
        blocks.sort()
        for block in blocks:
            if total <= target:
                break
            self._unlink(block)  # gone already (a read that rejected it) is as good
            total -= block.size
            self.files_removed += 1
        return total

    def scan(self) -> tuple[list[StoredFile], list[StoredFile]]:
        """Every store's block files and temporaries; a file or directory that goes between
        the listing and its ``stat`` is skipped, and so is a link at any level."""
        blocks: list[StoredFile] = []
        temporaries: list[StoredFile] = []
        with opened_dir(self.root) as root:  # the directory itself gone: the caller decides
            for store in _directories(root, FINGERPRINT, private=True):
                for subdir, entry in _files(root, store):
                    kind = blocks if entry.name.endswith(".kv") else (
                        temporaries if entry.name.endswith(".tmp") else None)
                    if kind is None:
                        continue
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    if stat.S_ISREG(st.st_mode):
                        kind.append(StoredFile(st.st_mtime_ns, st.st_size, store, subdir,
                                               entry.name))
        return blocks, temporaries

    def _unlink(self, f: StoredFile) -> None:
        try:
            with opened_dir(self.root, f.fingerprint, f.subdir) as directory:
                os.unlink(f.name, dir_fd=directory)
        except OSError as exc:
            if exc.errno not in _REFUSED:
                raise


def _directories(fd: int, pattern: re.Pattern, private: bool = False) -> list[str]:
    """The subdirectories of ``fd`` named by ``pattern`` (links are not directories here);
    ``private``: only those of this user's that group and others cannot write (not ours to
    count or trim otherwise)."""
    found = []
    with os.scandir(fd) as entries:
        for entry in entries:
            if not (pattern.fullmatch(entry.name) and entry.is_dir(follow_symlinks=False)):
                continue
            if private:
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if st.st_uid != os.getuid() or st.st_mode & 0o022:
                    continue
            found.append(entry.name)
    return found


def _files(root: int, fingerprint: str) -> Iterator[tuple[str, os.DirEntry]]:
    """(subdirectory, entry) of every file in ``<fingerprint>/<hh>/``, each directory opened
    without following a link; one that goes meanwhile is skipped."""
    try:
        store = open_dir(fingerprint, dir_fd=root)
    except OSError as exc:
        if exc.errno in _REFUSED:
            return
        raise
    try:
        for subdir in _directories(store, SUBDIR):
            try:
                inner = open_dir(subdir, dir_fd=store)
            except OSError as exc:
                if exc.errno in _REFUSED:
                    continue
                raise
            try:
                with os.scandir(inner) as entries:
                    for entry in entries:
                        yield subdir, entry
            finally:
                os.close(inner)
    finally:
        os.close(store)

"""The disk tier's store (L3, ``--disk-cache-dir``): KV blocks as files, shared by every server
process on the machine and kept across restarts. The scheduler asks which blocks are there
(engine/contracts/disk_blocks.py's ``DiskView``); the worker reads and writes them
(``DiskStore``, used by engine/worker/tier_io.py). Bytes only here: what a block's bytes mean
(the pool's pages) is the worker's.

Addressing (which names, which directory: engine/contracts/disk_blocks.py)::

    DIR/                                      given: this uid's, not group/other-writable
      ledger                                  0600, the bytes all stores hold; the capacity
      <fingerprint>/                          0700, one per model + layout
        manifest.json                         what the fingerprint stands for (for people)
        key                                   0600, the directory's tag key (32 bytes)
        <hh>/<hash>.kv                        0600, one block: header + tag + payload
        <hh>/.<hash>.kv.<pid>.<random>.tmp    a block being written

The fingerprint hashes everything that changes a block's bytes (engine/worker/tier_io.py's
``identity``: the weights and the format each is served in, the dtypes, the page size, the
tensor-parallel layout, the code's KV layout version): another model, weight format or layout
looks in another directory and never reads these files.

A file: ``MAGIC``, a header (fingerprint, block hash, tokens, payload bytes, the payload's
CRC-32, which names torn and flipped bytes as such), a tag (keyed blake2b over magic, header and
payload, keyed by the directory's ``key``, engine/contracts/disk_guard.py: another local user
who plants or edits a file cannot make one), the payload. A read checks every header field, the
checksum and the tag: a file that fails is logged, removed and reported missing (the caller
recomputes). A failed tag is first tried against the key file as it is now: a key another
server made after the directory was removed or its key replaced is read and used, so servers
never take each other's blocks for forgeries (each write also checks the key file first, an
``lstat``). A block is written to a temporary (``O_EXCL``, 0600, sized whole) and renamed into
place, so a reader sees a whole file or none, and two processes writing one block write the
same bytes. No link is followed at any level below ``DIR``.

Many processes, one directory: every filesystem race is the normal case. A file another server
removes between a listing and a ``stat``, ``open`` or ``unlink`` is skipped; only the store's
directory itself gone (an ``lstat``) turns the store off, and the model worker tells the
scheduler (``BatchResult.disk_off``). One capacity bounds every store's files in ``DIR``
(engine/contracts/disk_capacity.py). A full disk (``ENOSPC``) is someone's, perhaps not ours:
writing stops (logged once), every file there is still served, nothing is removed for it, and
writing is tried again after a back-off (doubling up to ``FULL_RETRY_SECONDS[1]``) or as soon
as this store's own trim has made room. A store that cannot make its directory, key or manifest
(a full disk at start) is not set up (``ready`` False): the server serves without it, says so
once in its log and in ``/metrics``, and tries again on the same back-off.
"""

from __future__ import annotations

import errno
import hmac
import json
import logging
import math
import os
import stat
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager

from engine.contracts.disk_blocks import DiskView
from engine.contracts.disk_capacity import Capacity
from engine.contracts.disk_guard import (
    TAG_BYTES,
    DirectoryKey,
    Untrusted,
    check_private_dir,
    create_private,
    fill,
    open_dir,
    open_nofollow,
    opened_dir,
    tag,
    write_whole,
)

logger = logging.getLogger("radixserve.disk_cache")

MAGIC = b"RSKV\x02\n"  # 2: a tag after the header
_HEADER = struct.Struct("<16s16sQQI")  # fingerprint, block hash, tokens, payload bytes, CRC-32
_HEAD_BYTES = len(MAGIC) + _HEADER.size + TAG_BYTES
FULL_RETRY_SECONDS = (5.0, 300.0)  # after ENOSPC, the first and the longest wait to retry
_UNTAGGED = "its tag does not match this directory's key (not written by a server of it)"


def check_directory(path: str) -> None:
    """Refuse, with a sentence naming ``path`` and the fix, a ``--disk-cache-dir`` that is
    missing, not a directory, a symbolic link, another user's, writable by group or others, or
    not writable by this user (the store makes its own subdirectory inside)."""
    check_private_dir(path, "--disk-cache-dir")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"--disk-cache-dir {path} is not writable by this user")


class DiskStore(DiskView):
    """One process's handle on ``root/<fingerprint>``, for reading and writing blocks.
    ``capacity``: this server's ``--disk-cache-gb`` in bytes (0: no limit of its own); the
    directory keeps the largest any server gave (``Capacity``). ``ready``: set up (its
    directory made and checked, the key read, the capacity and manifest written). Thread-safe."""

    def __init__(self, root: str, fingerprint_hex: str, capacity: int = 0,
                 identity: dict | None = None) -> None:
        check_directory(root)
        super().__init__(root, fingerprint_hex)
        self.space = Capacity(self.root)
        self.ready = False
        self._given_capacity = capacity
        self._identity = identity
        self._key: DirectoryKey | None = None
        self._lock = threading.Lock()
        self.bytes_read = self.bytes_written = 0
        self.rejected = 0  # files found corrupt, truncated, foreign or untagged
        self._retry_at = 0.0  # monotonic time before which nothing is written or set up
        self._wait = FULL_RETRY_SECONDS[0]
        self._full = False  # the last write found the disk full (logged once)
        self._unset = False  # the last set-up failed (logged once)
        self._set_up()  # Untrusted: refused at start

    @property
    def key(self) -> bytes | None:
        return self._key.value if self._key is not None else None

    @property
    def writing(self) -> bool:
        """On and not waiting out a full disk or a failed set-up (a save is worth copying)."""
        return self.enabled and time.monotonic() >= self._retry_at

    @property
    def capacity(self) -> int:
        """The directory's capacity in bytes (0: no limit but the disk's)."""
        return self.space.limit

    @property
    def used(self) -> int:
        """Bytes every store's files in the directory hold, by the shared count."""
        return self.space.used

    # ----------------------------------------------------------------- set-up
    def _set_up(self) -> bool:
        """Make and check the store's directory, read (or make) its key, record the capacity,
        write the manifest and count the directory: whether the store is ready. A step the
        disk refuses (full, read-only) leaves it off, said once, until the back-off passes."""
        try:
            try:
                os.mkdir(self.dir, 0o700)
            except FileExistsError:
                pass  # another server's, or an earlier run's: checked like a new one
            check_private_dir(str(self.dir), "the disk cache's directory")
            key = DirectoryKey(str(self.dir))
            self.space.record(self._given_capacity)
            if self._identity is not None and not os.path.lexists(self.dir / "manifest.json"):
                text = json.dumps(self._identity, indent=1, sort_keys=True).encode()
                with opened_dir(self.root, self.fingerprint) as directory:
                    write_whole(directory, "manifest.json", text)
            self.space.trim(math.inf)  # a killed writer's temporaries go; the count is set
        except OSError as exc:
            if not self._unset:
                logger.warning("the disk cache (%s) cannot be set up (%s): serving without it, "
                               "tried again in %.0f s", self.dir, exc, self._wait)
            self._unset = True
            self._back_off()
            return False
        self._key, self.ready = key, True
        self._wait = FULL_RETRY_SECONDS[0]
        if self._unset:
            logger.info("the disk cache (%s) is set up and on", self.dir)
            self._unset = False
        return True

    def _back_off(self) -> None:
        self._retry_at = time.monotonic() + self._wait
        self._wait = min(2 * self._wait, FULL_RETRY_SECONDS[1])

    # ----------------------------------------------------------------- writing
    def write(self, name: str, tokens: int, payload: bytes | memoryview) -> bool:
        """Store one block (atomically; a block already there is left as it is). False when it
        was not written: the store is off or not set up, full (the capacity, even after a
        trim), or the disk is full (logged once; writing stops until ``_retry_at`` or this
        store's trim)."""
        if not self.writing:
            return False
        try:
            if not self.ready and not self._set_up():
                return False
            if self.contains(name):
                return True
            if self._key.changed():
                self._key.reload()  # another server's key now: blocks written for it
        except Untrusted as exc:
            self.turn_off(str(exc))
            return False
        except OSError as exc:
            return self._write_failed(exc)
        header = MAGIC + _HEADER.pack(bytes.fromhex(self.fingerprint), bytes.fromhex(name),
                                      tokens, len(payload), zlib.crc32(payload))
        parts = (header, tag(self.key, header, payload), payload)
        try:
            self._write_block(name, parts, _HEAD_BYTES + len(payload))
        except _NoRoom:
            return False
        except OSError as exc:
            return self._write_failed(exc)
        with self._lock:
            self.bytes_written += _HEAD_BYTES + len(payload)
        if self._full:
            logger.info("the disk cache (%s) is writing again", self.dir)
            self._full, self._wait = False, FULL_RETRY_SECONDS[0]
        return True

    def _write_block(self, name: str, parts: tuple, size: int) -> None:
        """The block's temporary made and counted at its full size under the ledger's lock,
        filled, then renamed into place where no scan can miss both names."""
        tmp = f".{name}.kv.{os.getpid()}.{os.urandom(6).hex()}.tmp"
        with self._subdir(name[:2]) as directory:
            with self.space.reserving(size) as room:
                if not room:
                    raise _NoRoom
                fd = create_private(directory, tmp, size)
            try:
                fill(fd, parts)
                with self.space.renaming():
                    os.replace(tmp, f"{name}.kv", src_dir_fd=directory, dst_dir_fd=directory)
            except BaseException:
                try:
                    self.space.remove(lambda: os.unlink(tmp, dir_fd=directory), size)
                except OSError:
                    pass  # the directory is gone too: _write_failed says so
                raise

    @contextmanager
    def _subdir(self, subdir: str) -> Iterator[int]:
        """``<hh>/`` of the store, made if missing (someone may have emptied the store by hand);
        a link at either level is refused, never followed."""
        with opened_dir(self.root, self.fingerprint) as store:
            try:
                fd = open_dir(subdir, dir_fd=store)
            except FileNotFoundError:
                try:
                    os.mkdir(subdir, 0o700, dir_fd=store)
                except FileExistsError:
                    pass
                fd = open_dir(subdir, dir_fd=store)
            try:
                yield fd
            finally:
                os.close(fd)

    def _write_failed(self, exc: OSError) -> bool:
        if self._gone():
            self.turn_off("its directory is gone")
        elif exc.errno in (errno.ENOSPC, errno.EDQUOT):
            # Whatever filled the disk, the files here stay: other servers read them, and
            # removing them would not empty a disk something else fills.
            if not self._full:
                logger.warning("the disk cache's disk is full (%s): writing stops, every block "
                               "there is still served, and writing is tried again in %.0f s",
                               exc, self._wait)
            self._full = True
            self._back_off()
        else:
            logger.warning("writing a block to the disk cache failed: %s", exc)
        return False

    def _gone(self) -> bool:
        """Whether the store's directory itself is gone (or no longer a directory)."""
        try:
            return not stat.S_ISDIR(os.lstat(self.dir).st_mode)
        except FileNotFoundError:
            return True
        except OSError:
            return False

    # ----------------------------------------------------------------- reading
    def read(self, name: str, tokens: int, payload_bytes: int) -> memoryview | None:
        """One block's payload (a writable view of the bytes read), or None when it is missing
        or fails a check (then it is removed: a corrupt, truncated, foreign or untagged file is
        never served)."""
        if not (self.enabled and self.ready):
            return None
        try:
            with opened_dir(self.root, self.fingerprint, name[:2]) as directory:
                return self._read_in(directory, name, tokens, payload_bytes)
        except FileNotFoundError:
            if self._gone():
                self.turn_off("its directory is gone")
        except Untrusted as exc:
            self.turn_off(str(exc))
        except OSError as exc:
            refused = exc.errno in (errno.ELOOP, errno.ENOTDIR)
            logger.warning("reading disk cache block %s failed: %s", name,
                           "a symbolic link on its path, which is never followed" if refused
                           else exc)
        return None

    def _read_in(self, directory: int, name: str, tokens: int,
                 payload_bytes: int) -> memoryview | None:
        # O_NONBLOCK: a FIFO under a block's name must not hang the I/O thread
        fd = open_nofollow(f"{name}.kv", os.O_RDONLY | os.O_NONBLOCK, dir_fd=directory)
        with os.fdopen(fd, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            # at most one byte more than a block: a planted huge file costs no memory
            data = bytearray(min(size, _HEAD_BYTES + payload_bytes + 1))
            del data[f.readinto(data) :]  # a file cut short while open
        problem = self._check(data, name, tokens, payload_bytes)
        if problem is None and not self._tagged(data):
            # a key another server made since this one read its own: used from now on
            problem = None if self._key.reload() and self._tagged(data) else _UNTAGGED
        if problem is not None:
            logger.warning("disk cache block %s skipped and removed: %s", self.path(name),
                           problem)
            with self._lock:
                self.rejected += 1
            self.space.remove(lambda: os.unlink(f"{name}.kv", dir_fd=directory), size)
            return None
        try:
            # recently used: the last to be trimmed
            os.utime(f"{name}.kv", dir_fd=directory, follow_symlinks=False)
        except OSError:
            pass
        with self._lock:
            self.bytes_read += len(data)
        return memoryview(data)[_HEAD_BYTES:]

    def _check(self, data: bytearray, name: str, tokens: int, payload_bytes: int) -> str | None:
        """What is wrong with the block's bytes, but for its tag (``_tagged``)."""
        if len(data) < _HEAD_BYTES or not data.startswith(MAGIC):
            return "not a radixserve KV block of this version"
        fp, digest, n, size, checksum = _HEADER.unpack_from(data, len(MAGIC))
        if fp.hex() != self.fingerprint:
            return "written for another model or layout"
        if digest.hex() != name or n != tokens or size != payload_bytes:
            return "its header does not match its name"
        if len(data) != _HEAD_BYTES + size:
            return f"its size is wrong ({len(data)} bytes read, a block has {_HEAD_BYTES + size})"
        if zlib.crc32(memoryview(data)[_HEAD_BYTES:]) != checksum:
            return "its checksum does not match"
        return None

    def _tagged(self, data: bytearray) -> bool:
        view, header_end = memoryview(data), len(MAGIC) + _HEADER.size
        return hmac.compare_digest(tag(self.key, view[:header_end], view[_HEAD_BYTES:]),
                                   view[header_end:_HEAD_BYTES])

    # -------------------------------------------------------------- capacity
    def trim(self, target: float) -> None:
        """Remove the least recently used files of every store in the directory until it holds
        at most ``target`` bytes (every process's files count: the directory is read, not this
        process's records), and temporaries a killed writer left; the count becomes what is
        left."""
        removed = self.space.files_removed
        try:
            self.space.trim(target)
        except OSError:
            if self._gone():
                self.turn_off("its directory is gone")
                return
            raise
        if self.space.files_removed > removed:
            self._retry_at = 0.0  # room made: a full disk is tried again at once


class _NoRoom(Exception):
    """The capacity is reached even after a trim."""

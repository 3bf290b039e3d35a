"""The disk tier's store (L3, ``--disk-cache-dir``): KV blocks as files, shared by every server
process on the machine and kept across restarts. The scheduler asks which blocks are there
(``contains``); the worker reads and writes them (engine/worker/tier_io.py). Bytes only here:
what a block's bytes mean (the pool's pages) is the worker's.

Addressing. A block is ``block_tokens(page_size)`` tokens of one path from position 0, named
by the chained hash of the whole prefix up to its end (``block_hashes``: 128-bit blake2b, the
KV events' chain with the store's fingerprint in its seed), so equal names mean equal prefixes
in the same namespace (``cache_salt`` and LoRA namespaces hash apart) on the same model::

    DIR/                                      given: this uid's, not group/other-writable
      <fingerprint>/                          0700, one per model + layout
        manifest.json                         what the fingerprint stands for (for people)
        key                                   0600, the directory's tag key (32 bytes)
        usage                                 0600, the bytes all servers' files hold
        <hh>/<hash>.kv                        0600, one block: header + tag + payload
        <hh>/.<hash>.kv.<pid>.<random>.tmp    a block being written

The fingerprint hashes the model's identity (architecture, shapes, the checkpoint files' names,
sizes and modification times), the dtype, the KV dtype, the page size, the tensor-parallel
layout and the file format: a different model, layout or format looks in another directory and
never reads these files.

Trust (engine/contracts/disk_guard.py). Both directories must be real directories owned by the
serving uid that group and others cannot write, or the server refuses to start; files are
opened without following links. A file: ``MAGIC``, a header (fingerprint, block hash, tokens,
payload bytes, the payload's CRC-32, which names torn and flipped bytes as such), a tag (keyed
blake2b over magic, header and payload, keyed by the directory's ``key``: another local user
who plants or edits a file cannot make one), the payload. A read checks every header field, the
checksum and the tag: a file that fails is logged, removed and reported missing (the caller
recomputes). A block is written to a temporary name (``O_EXCL``, 0600) and renamed into place,
so a reader sees a whole file or none, and two processes writing one block write the same
bytes.

Many processes, one directory: every filesystem race is the normal case. A file another server
removes between a listing and a ``stat``, ``open`` or ``unlink`` is skipped; only the store's
directory itself gone (an ``lstat``) turns the store off, and the model worker tells the
scheduler (``BatchResult.disk_off``). ``capacity`` bounds all servers' files together through
one shared count (engine/contracts/disk_ledger.py): a write that would pass it first removes
the least recently used files (by modification time, which a read refreshes) down to 90%, and
temporaries older than ``STALE_TMP_SECONDS`` (a killed writer's). A full disk (``ENOSPC``) is
someone's, perhaps not ours: writing stops (logged once), every file there is still served,
nothing is removed for it, and writing is tried again after a back-off (doubling up to
``FULL_RETRY_SECONDS[1]``) or as soon as this store's own trim has made room.
"""

from __future__ import annotations

import errno
import hmac
import itertools
import json
import logging
import math
import os
import stat
import struct
import threading
import time
import zlib
from collections.abc import Hashable, Iterable
from hashlib import blake2b
from pathlib import Path

import numpy as np

from engine.contracts.disk_guard import (
    TAG_BYTES,
    check_private_dir,
    directory_key,
    open_nofollow,
    tag,
)
from engine.contracts.disk_ledger import Ledger

logger = logging.getLogger("radixserve.disk_cache")

MAGIC = b"RSKV\x02\n"  # 2: a tag after the header
_HEADER = struct.Struct("<16s16sQQI")  # fingerprint, block hash, tokens, payload bytes, CRC-32
_HEAD_BYTES = len(MAGIC) + _HEADER.size + TAG_BYTES
DISK_BLOCK_TOKENS = 16  # the smallest block; a block is a whole number of pages
TRIM_TO = 0.9  # a store over its capacity removes its oldest files down to this fraction
STALE_TMP_SECONDS = 600.0  # a temporary this old is a killed writer's: a trim removes it
FULL_RETRY_SECONDS = (5.0, 300.0)  # after ENOSPC, the first and the longest wait to retry


def block_tokens(page_size: int) -> int:
    """Tokens per disk block: whole pages, at least ``DISK_BLOCK_TOKENS``."""
    return page_size * -(-DISK_BLOCK_TOKENS // page_size)


def fingerprint(identity: dict) -> str:
    """32 hex digits naming ``identity`` (JSON-able: the model, dtypes and layout)."""
    text = json.dumps(identity, sort_keys=True, separators=(",", ":"))
    return blake2b(text.encode(), digest_size=16).hexdigest()


def block_hashes(fingerprint_hex: str, namespace: Hashable, tokens: np.ndarray | list[int],
                 block: int, start_block: int = 0) -> list[str]:
    """The names (32 hex digits) of the whole blocks of ``tokens`` (a path from position 0),
    from block ``start_block`` on; each hashes its parent's name, so the chain runs from 0."""
    data = np.ascontiguousarray(tokens, dtype="<i4").tobytes()
    step = 4 * block
    seed = b"radixserve-disk\x00" + bytes.fromhex(fingerprint_hex)
    if namespace is not None:
        seed += b"\x01" + str(namespace).encode()
    parent = blake2b(seed, digest_size=16).digest()
    names = []
    for k, at in enumerate(range(0, len(data) - step + 1, step)):
        parent = blake2b(parent + data[at : at + step], digest_size=16).digest()
        if k >= start_block:
            names.append(parent.hex())
    return names



def check_directory(path: str) -> None:
    """Refuse, with a sentence naming ``path`` and the fix, a ``--disk-cache-dir`` that is
    missing, not a directory, a symbolic link, another user's, writable by group or others, or
    not writable by this user (the store makes its own subdirectory inside)."""
    check_private_dir(path, "--disk-cache-dir")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"--disk-cache-dir {path} is not writable by this user")


class DiskStore:
    """One process's handle on ``root/<fingerprint>``. ``capacity``: bytes the store may hold
    (all processes' files together; 0 is no limit but the disk's). Thread-safe."""

    def __init__(self, root: str, fingerprint_hex: str, capacity: int = 0,
                 identity: dict | None = None) -> None:
        check_directory(root)
        self.fingerprint = fingerprint_hex
        self.dir = Path(root) / fingerprint_hex
        self.capacity = capacity
        self.enabled = True  # False once the directory is gone
        self._lock = threading.Lock()
        self._subdirs: set[str] = set()  # checked by this process (a write that fails forgets)
        try:
            os.mkdir(self.dir, 0o700)
        except FileExistsError:
            pass  # another server's, or an earlier run's: checked like a new one
        check_private_dir(str(self.dir), "the disk cache's directory")
        self.key = directory_key(str(self.dir))
        self.ledger = Ledger(str(self.dir / "usage"), lambda: self._trim(math.inf))
        manifest = self.dir / "manifest.json"
        if identity is not None and not os.path.lexists(manifest):
            self._write_atomic(manifest, json.dumps(identity, indent=1, sort_keys=True).encode())
        self.bytes_read = self.bytes_written = 0
        self.rejected = 0  # files found corrupt, truncated, foreign or untagged
        self._retry_at = 0.0  # monotonic time before which a full disk is not written
        self._full_wait = FULL_RETRY_SECONDS[0]
        self._full = False  # the last write found the disk full (logged once)
        self.trim(math.inf)  # a killed writer's temporaries go; the shared count is set

    @property
    def writing(self) -> bool:
        """On and not waiting out a full disk (a save is worth copying out)."""
        return self.enabled and time.monotonic() >= self._retry_at

    @property
    def used(self) -> int:
        """Bytes every process's files hold, by the shared count."""
        return self.ledger.used()

    # ------------------------------------------------------------- addressing
    def path(self, name: str) -> Path:
        return self.dir / name[:2] / f"{name}.kv"

    def contains(self, name: str) -> bool:
        if not self.enabled:
            return False
        try:
            return stat.S_ISREG(os.lstat(self.path(name)).st_mode)
        except OSError:
            return False

    def present(self, names: Iterable[str]) -> int:
        """How many of ``names``, from the first, are stored one after another."""
        return sum(1 for _ in itertools.takewhile(self.contains, names))

    # ----------------------------------------------------------------- writing
    def write(self, name: str, tokens: int, payload: bytes | memoryview) -> bool:
        """Store one block (atomically; a block already there is left as it is). False when it
        was not written: the store is off, full (the capacity, even after a trim), or the disk
        is full (logged once; writing stops until ``_retry_at`` or this store's trim)."""
        if not self.writing:
            return False
        path = self.path(name)
        if self.contains(name):
            return True
        size = _HEAD_BYTES + len(payload)
        header = MAGIC + _HEADER.pack(bytes.fromhex(self.fingerprint), bytes.fromhex(name),
                                      tokens, len(payload), zlib.crc32(payload))
        try:
            if not self.ledger.reserve(size, self.capacity,
                                       lambda: self._trim(self.capacity * TRIM_TO - size)):
                return False
        except OSError as exc:
            return self._write_failed(exc)
        parts = (header, tag(self.key, header, payload), payload)
        try:
            try:
                self._make_subdir(path.parent)
                self._write_atomic(path, *parts)
            except FileNotFoundError:
                # its subdirectory went (someone emptied the store by hand): made again, once
                self._subdirs.discard(path.parent.name)
                self._make_subdir(path.parent)
                self._write_atomic(path, *parts)
        except OSError as exc:
            self._subdirs.discard(path.parent.name)
            try:
                self.ledger.add(-size)
            except OSError:
                pass  # the directory is gone too: _write_failed says so
            return self._write_failed(exc)
        with self._lock:
            self.bytes_written += size
        if self._full:
            logger.info("the disk cache (%s) is writing again", self.dir)
            self._full, self._full_wait = False, FULL_RETRY_SECONDS[0]
        return True

    def _make_subdir(self, path: Path) -> None:
        if path.name in self._subdirs:
            return
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            if not stat.S_ISDIR(os.lstat(path).st_mode):  # never a link: it is not followed
                raise OSError(errno.ENOTDIR, "not a directory", str(path)) from None
        self._subdirs.add(path.name)

    def _write_atomic(self, path: Path, *parts: bytes | memoryview) -> None:
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{os.urandom(6).hex()}.tmp")
        fd = open_nofollow(str(tmp), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            try:
                for part in parts:
                    view = memoryview(part).cast("B")
                    while view:
                        view = view[os.write(fd, view) :]
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def _write_failed(self, exc: OSError) -> bool:
        if self._gone():
            self.turn_off("its directory is gone")
        elif exc.errno in (errno.ENOSPC, errno.EDQUOT):
            # Whatever filled the disk, the files here stay: other servers read them, and
            # removing them would not empty a disk something else fills.
            if not self._full:
                logger.warning("the disk cache's disk is full (%s): writing stops, every block "
                               "there is still served, and writing is tried again in %.0f s",
                               exc, self._full_wait)
            else:
                self._full_wait = min(2 * self._full_wait, FULL_RETRY_SECONDS[1])
            self._full = True
            self._retry_at = time.monotonic() + self._full_wait
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

    def turn_off(self, why: str) -> None:
        """No more reads or writes, for the rest of this process (the directory is gone)."""
        if self.enabled:
            logger.warning("the disk cache (%s) is off: %s", self.dir, why)
        self.enabled = False

    # ----------------------------------------------------------------- reading
    def read(self, name: str, tokens: int, payload_bytes: int) -> memoryview | None:
        """One block's payload (a writable view of the bytes read), or None when it is missing
        or fails a check (then it is removed: a corrupt, truncated, foreign or untagged file is
        never served)."""
        if not self.enabled:
            return None
        path = self.path(name)
        try:
            # O_NONBLOCK: a FIFO under a block's name must not hang the I/O thread
            fd = open_nofollow(str(path), os.O_RDONLY | os.O_NONBLOCK)
        except FileNotFoundError:
            if self._gone():
                self.turn_off("its directory is gone")
            return None
        except OSError as exc:
            logger.warning("reading disk cache block %s failed: %s", name, exc)
            return None
        try:
            with os.fdopen(fd, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                # at most one byte more than a block: a planted huge file costs no memory
                data = bytearray(min(size, _HEAD_BYTES + payload_bytes + 1))
                del data[f.readinto(data) :]  # a file cut short while open
        except OSError as exc:
            logger.warning("reading disk cache block %s failed: %s", name, exc)
            return None
        problem = self._check(data, name, tokens, payload_bytes)
        if problem is not None:
            logger.warning("disk cache block %s skipped and removed: %s", path, problem)
            with self._lock:
                self.rejected += 1
            self._remove(path, size)
            return None
        try:
            os.utime(path, follow_symlinks=False)  # recently used: the last to be trimmed
        except OSError:
            pass
        with self._lock:
            self.bytes_read += len(data)
        return memoryview(data)[_HEAD_BYTES:]

    def _check(self, data: bytearray, name: str, tokens: int, payload_bytes: int) -> str | None:
        if len(data) < _HEAD_BYTES or not data.startswith(MAGIC):
            return "not a radixserve KV block of this version"
        fp, digest, n, size, checksum = _HEADER.unpack_from(data, len(MAGIC))
        if fp.hex() != self.fingerprint:
            return "written for another model or layout"
        if digest.hex() != name or n != tokens or size != payload_bytes:
            return "its header does not match its name"
        if len(data) != _HEAD_BYTES + size:
            return f"its size is wrong ({len(data)} bytes read, a block has {_HEAD_BYTES + size})"
        view = memoryview(data)
        if zlib.crc32(view[_HEAD_BYTES:]) != checksum:
            return "its checksum does not match"
        header_end = len(MAGIC) + _HEADER.size
        if not hmac.compare_digest(tag(self.key, view[:header_end], view[_HEAD_BYTES:]),
                                   view[header_end:_HEAD_BYTES]):
            return "its tag does not match this directory's key (not written by a server of it)"
        return None

    def _remove(self, path: Path, size: int) -> None:
        """Remove one file; its bytes leave the count only if this removal took it (another
        server may have removed it first, and counted that)."""
        try:
            os.unlink(path)
        except OSError:
            return
        try:
            self.ledger.add(-size)
        except OSError:
            pass  # the directory is gone: nothing left to count

    # -------------------------------------------------------------- capacity
    def trim(self, target: float) -> None:
        """Remove the least recently used files until the store holds at most ``target`` bytes
        (every process's files count: the directory is read, not this process's records), and
        temporaries a killed writer left; the shared count becomes what is left."""
        try:
            self.ledger.recount(lambda: self._trim(target))
        except OSError:
            if self._gone():
                self.turn_off("its directory is gone")
            else:
                raise

    def _trim(self, target: float) -> int:
        """``trim``'s work, under the shared count's lock: the bytes left."""
        blocks, temporaries = self._scan()
        stale = time.time_ns() - int(STALE_TMP_SECONDS * 1e9)
        block_bytes = max((size for _, size, _ in blocks), default=0)  # one layout: one size
        total = sum(size for _, size, _ in blocks)
        for mtime, size, path in temporaries:
            if mtime < stale:
                _unlink(path)
            else:
                total += max(size, block_bytes)  # a write in flight, counted whole
        blocks.sort()
        removed = False
        for _, size, path in blocks:
            if total <= target:
                break
            _unlink(path)  # gone already (another server's trim) is as good
            total -= size
            removed = True
        if removed:
            self._retry_at = 0.0  # room made: a full disk is tried again at once
        return total

    def _scan(self) -> tuple[list[tuple[int, int, str]], list[tuple[int, int, str]]]:
        """Every process's block files and temporaries, (mtime ns, bytes, path) each; a file
        or subdirectory that goes between the listing and its ``stat`` is skipped."""
        blocks, temporaries = [], []
        for sub in os.scandir(self.dir):  # the directory itself gone: the caller decides
            if len(sub.name) != 2 or not sub.is_dir(follow_symlinks=False):
                continue
            try:
                entries = list(os.scandir(sub.path))
            except FileNotFoundError:
                continue
            for entry in entries:
                kind = blocks if entry.name.endswith(".kv") else (
                    temporaries if entry.name.endswith(".tmp") else None)
                if kind is None:
                    continue
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if stat.S_ISREG(st.st_mode):
                    kind.append((st.st_mtime_ns, st.st_size, entry.path))
        return blocks, temporaries


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass

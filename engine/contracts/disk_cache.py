"""The disk tier's store (L3, ``--disk-cache-dir``): KV blocks as files, shared by every server
process on the machine and kept across restarts. The scheduler asks which blocks are there
(``contains``); the worker reads and writes them (engine/worker/tier_io.py). Bytes only here:
what a block's bytes mean (the pool's pages) is the worker's.

Addressing. A block is ``block_tokens(page_size)`` tokens of one path from position 0, named
by the chained hash of the whole prefix up to its end (``block_hashes``: 128-bit blake2b, the
KV events' chain with the store's fingerprint in its seed), so equal names mean equal prefixes
in the same namespace (``cache_salt`` and LoRA namespaces hash apart) on the same model::

    DIR/                                      0700, given (must exist and be writable)
      <fingerprint>/                          0700, one per model + layout
        manifest.json                         what the fingerprint stands for (for people)
        <hh>/<hash>.kv                        0600, one block: header + payload

The fingerprint hashes the model's identity (architecture, shapes, the checkpoint files' names,
sizes and modification times), the dtype, the KV dtype, the page size and the tensor-parallel
layout: a different model or layout looks in another directory and never reads these files.

A file: ``MAGIC``, a header (fingerprint, block hash, tokens, payload bytes, the payload's
CRC-32: it catches torn and flipped bytes at a few GB/s; the directory is private, so nothing
hostile writes there), the payload. It is written to a temporary name (``O_EXCL``, 0600) and
renamed into place, so a reader sees a whole file or none, and two processes writing one block
write the same bytes. A read checks every header field and the checksum: a corrupt, truncated
or foreign file is logged, removed and reported missing (the caller recomputes).

Faults never fail a request: a full disk or the ``capacity`` limit stops writing (the oldest
files, by modification time, which a read refreshes, are removed first to make room); the
directory deleted while serving turns the store off. ``check_directory`` refuses a missing or
unwritable directory at start, with a sentence.
"""

from __future__ import annotations

import errno
import itertools
import json
import logging
import os
import struct
import threading
import zlib
from collections.abc import Hashable, Iterable
from hashlib import blake2b
from pathlib import Path

import numpy as np

logger = logging.getLogger("radixserve.disk_cache")

MAGIC = b"RSKV\x01\n"
_HEADER = struct.Struct("<16s16sQQI")  # fingerprint, block hash, tokens, payload bytes, CRC-32
DISK_BLOCK_TOKENS = 16  # the smallest block; a block is a whole number of pages
TRIM_TO = 0.9  # a store over its capacity removes its oldest files down to this fraction


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
    """Refuse, with a sentence, a ``--disk-cache-dir`` that is missing, not a directory or not
    writable (the store makes its own subdirectory inside)."""
    if not os.path.exists(path):
        raise ValueError(f"--disk-cache-dir {path} does not exist: create it (mode 0700) first")
    if not os.path.isdir(path):
        raise ValueError(f"--disk-cache-dir {path} is not a directory")
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
        self._subdirs: set[str] = set()  # made by this process (a write that fails forgets)
        self.dir.mkdir(mode=0o700, exist_ok=True)
        os.chmod(self.dir, 0o700)
        manifest = self.dir / "manifest.json"
        if identity is not None and not manifest.exists():
            self._write_atomic(manifest, json.dumps(identity, indent=1, sort_keys=True).encode())
        self.used = self._scan_bytes()
        self.bytes_read = self.bytes_written = 0
        self.rejected = 0  # files found corrupt, truncated or foreign

    # ------------------------------------------------------------- addressing
    def path(self, name: str) -> Path:
        return self.dir / name[:2] / f"{name}.kv"

    def contains(self, name: str) -> bool:
        return self.enabled and self.path(name).exists()

    def present(self, names: Iterable[str]) -> int:
        """How many of ``names``, from the first, are stored one after another."""
        return sum(1 for _ in itertools.takewhile(self.contains, names))

    # ----------------------------------------------------------------- writing
    def write(self, name: str, tokens: int, payload: bytes | memoryview) -> bool:
        """Store one block (atomically; a block already there is left as it is). False when it
        was not written: the store is off, or full (a write that finds no room is skipped and
        logged once, and writing stops until room is made)."""
        if not self.enabled:
            return False
        path = self.path(name)
        if path.exists():
            return True
        size = len(MAGIC) + _HEADER.size + len(payload)
        if self.capacity and self.used + size > self.capacity:
            self.trim(self.capacity * TRIM_TO - size)
            if self.used + size > self.capacity:
                return False
        header = _HEADER.pack(bytes.fromhex(self.fingerprint), bytes.fromhex(name), tokens,
                              len(payload), zlib.crc32(payload))
        try:
            if path.parent.name not in self._subdirs:
                path.parent.mkdir(mode=0o700, exist_ok=True)
                self._subdirs.add(path.parent.name)
            self._write_atomic(path, MAGIC + header, payload)
        except OSError as exc:
            self._subdirs.discard(path.parent.name)  # perhaps removed: made again next time
            return self._write_failed(exc)
        with self._lock:
            self.used += size
            self.bytes_written += size
        return True

    def _write_atomic(self, path: Path, *parts: bytes | memoryview) -> None:
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
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
        if not self.dir.is_dir():
            self._turn_off("its directory is gone")
        elif exc.errno in (errno.ENOSPC, errno.EDQUOT):
            logger.warning("the disk cache's disk is full (%s): removing its oldest blocks", exc)
            with self._lock:
                self.used = self._scan_bytes()
            self.trim(self.used * TRIM_TO)
        else:
            logger.warning("writing a block to the disk cache failed: %s", exc)
        return False

    def _turn_off(self, why: str) -> None:
        if self.enabled:
            logger.warning("the disk cache (%s) is off: %s", self.dir, why)
        self.enabled = False

    # ----------------------------------------------------------------- reading
    def read(self, name: str, tokens: int, payload_bytes: int) -> memoryview | None:
        """One block's payload (a writable view of the bytes read), or None when it is missing
        or fails a check (then it is removed: a corrupt, truncated or foreign file is never
        served)."""
        if not self.enabled:
            return None
        path = self.path(name)
        try:
            with open(path, "rb") as f:
                data = bytearray(os.fstat(f.fileno()).st_size)
                del data[f.readinto(data) :]  # a file cut short while open
        except FileNotFoundError:
            if not self.dir.is_dir():
                self._turn_off("its directory is gone")
            return None
        except OSError as exc:
            logger.warning("reading disk cache block %s failed: %s", name, exc)
            return None
        problem = self._check(data, name, tokens, payload_bytes)
        if problem is not None:
            logger.warning("disk cache block %s skipped and removed: %s", path, problem)
            with self._lock:
                self.rejected += 1
                self.used -= len(data)
            path.unlink(missing_ok=True)
            return None
        try:
            os.utime(path)  # recently used: the last to be trimmed
        except OSError:
            pass
        with self._lock:
            self.bytes_read += len(data)
        return memoryview(data)[len(MAGIC) + _HEADER.size :]

    def _check(self, data: bytearray, name: str, tokens: int, payload_bytes: int) -> str | None:
        head = len(MAGIC) + _HEADER.size
        if len(data) < head or not data.startswith(MAGIC):
            return "not a radixserve KV block"
        fp, digest, n, size, checksum = _HEADER.unpack_from(data, len(MAGIC))
        if fp.hex() != self.fingerprint:
            return "written for another model or layout"
        if digest.hex() != name or n != tokens or size != payload_bytes:
            return "its header does not match its name"
        if len(data) != head + size:
            return f"truncated ({len(data)} of {head + size} bytes)"
        if zlib.crc32(memoryview(data)[head:]) != checksum:
            return "its checksum does not match"
        return None

    # -------------------------------------------------------------- capacity
    def trim(self, target: float) -> None:
        """Remove the least recently used files until the store holds at most ``target`` bytes
        (every process's files count: the directory is read, not this process's records)."""
        try:
            files = sorted((e.stat().st_mtime_ns, e.stat().st_size, e.path) for e in self._files())
        except FileNotFoundError:
            self._turn_off("its directory is gone")
            return
        total = sum(size for _, size, _ in files)
        for _, size, path in files:
            if total <= target:
                break
            Path(path).unlink(missing_ok=True)
            total -= size
        with self._lock:
            self.used = total

    def _scan_bytes(self) -> int:
        return sum(e.stat().st_size for e in self._files())

    def _files(self) -> list[os.DirEntry]:
        """Every block file of the store, every process's (a DirEntry caches its stat)."""
        return [entry for sub in os.scandir(self.dir) if sub.is_dir()
                for entry in os.scandir(sub.path) if entry.name.endswith(".kv")]

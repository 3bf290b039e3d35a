"""How the disk tier (engine/contracts/disk_cache.py) names its blocks and finds them.

A block is ``block_tokens(page_size)`` tokens of one path from position 0, named by the chained
hash of the whole prefix up to its end (``block_hashes``: 128-bit blake2b, the KV events' chain
with the store's fingerprint in its seed), so equal names mean equal prefixes in the same
namespace (``cache_salt`` and LoRA namespaces, which hold the adapter's content hash, hash
apart) on the same model, weight formats and layout (the fingerprint: ``fingerprint`` of
engine/worker/tier_io.py's ``identity``). Block ``<hash>`` is ``DIR/<fingerprint>/<hh>/<hash>.kv``,
``<hh>`` its name's first two digits; with sliding-window layers stored apart, its window file
(``window_name``) is one more such file. ``DiskView`` is what the scheduler needs: whether blocks
are there, a ``stat`` each, nothing read or written.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import stat
from collections.abc import Hashable, Iterable
from hashlib import blake2b
from pathlib import Path

import numpy as np

logger = logging.getLogger("radixserve.disk_cache")

DISK_BLOCK_TOKENS = 16  # the smallest block; a block is a whole number of pages


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


def window_name(name: str) -> str:
    """The name of block ``name``'s window file: the sliding-window layers' KV of its pages
    (written beside the block where a kept window covers it, engine/worker/tier_io.py), a file
    of the store like any block."""
    return blake2b(bytes.fromhex(name) + b"sliding-window", digest_size=16).hexdigest()


class DiskView:
    """Which blocks ``root/<fingerprint>`` holds, a stat each (the scheduler's lookups and
    saves): nothing read or written. ``enabled``: False once the directory is gone."""

    def __init__(self, root: str, fingerprint_hex: str) -> None:
        self.root = os.path.normpath(root)
        self.fingerprint = fingerprint_hex
        self.dir = Path(self.root) / fingerprint_hex
        self.enabled = True

    def path(self, name: str) -> Path:
        return self.dir / name[:2] / f"{name}.kv"

    def contains(self, name: str) -> bool:
        if not self.enabled:
            return False
        try:  # a link where the subdirectory or the file should be: not there
            return (stat.S_ISDIR(os.lstat(self.dir / name[:2]).st_mode)
                    and stat.S_ISREG(os.lstat(self.path(name)).st_mode))
        except OSError:
            return False

    def present(self, names: Iterable[str]) -> int:
        """How many of ``names``, from the first, are stored one after another."""
        return sum(1 for _ in itertools.takewhile(self.contains, names))

    def turn_off(self, why: str) -> None:
        """No more reads or writes, for the rest of this process (the directory is gone)."""
        if self.enabled:
            logger.warning("the disk cache (%s) is off: %s", self.dir, why)
        self.enabled = False

"""What the disk tier (engine/contracts/disk_cache.py) trusts: directories this server's user
owns and nobody else may write, files opened without following links, and a per-directory key
that tags every block, so that another local user can neither plant nor alter what is served.

The rules, checked with ``lstat`` (a link is never followed to find out):

- ``--disk-cache-dir`` and the store's ``<fingerprint>/`` directory are real directories (not
  symbolic links), owned by the serving uid, not writable by group or others; otherwise the
  server refuses to start, with a sentence naming the path and the fix.
- Files are created ``O_EXCL | O_NOFOLLOW`` with mode 0600 and opened ``O_NOFOLLOW``.
- The key (``<fingerprint>/key``: 32 random bytes, 0600) is made by the first server to need
  it: written under a private temporary name, then ``link``-ed into place, which fails for all
  but one of several servers starting at once; the others read the winner's. A key file that
  is not a regular 0600 file of the serving uid is refused like a directory.
"""

from __future__ import annotations

import errno
import os
import stat
from hashlib import blake2b

KEY_BYTES = 32
TAG_BYTES = 32
NOFOLLOW = os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


class Untrusted(ValueError):
    """A directory or key the server must not use; the message says which and how to fix it."""


def check_private_dir(path: str, what: str) -> None:
    """Refuse ``path`` unless it is a real directory owned by this uid that group and others
    cannot write (``what`` names it in the sentence: "--disk-cache-dir", "the disk cache's
    directory")."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise Untrusted(f"{what} {path} does not exist: create it (mode 0700) first") from None
    if stat.S_ISLNK(st.st_mode):
        raise Untrusted(f"{what} {path} is a symbolic link: give the directory it points to "
                        f"(another user could point a link elsewhere)")
    if not stat.S_ISDIR(st.st_mode):
        raise Untrusted(f"{what} {path} is not a directory")
    check_owner(path, st, what)


def check_owner(path: str, st: os.stat_result, what: str) -> None:
    """Refuse ``st`` (``path``'s) unless this uid owns it and group and others cannot write."""
    uid = os.getuid()
    if st.st_uid != uid:
        raise Untrusted(f"{what} {path} is owned by uid {st.st_uid}, not by this server's uid "
                        f"{uid}: use a directory of this user's (another user could plant "
                        f"blocks in it)")
    if st.st_mode & 0o022:
        raise Untrusted(f"{what} {path} is writable by group or others (mode "
                        f"{stat.S_IMODE(st.st_mode):04o}): run chmod go-w {path}, or better "
                        f"chmod 700 {path}")


def directory_key(directory: str) -> bytes:
    """The key of ``directory`` (a checked private directory): read, or made once (see the
    module's docstring) by whichever server gets there first."""
    path = os.path.join(directory, "key")
    try:
        return _read_key(path)
    except FileNotFoundError:
        pass
    tmp = os.path.join(directory, f".key.{os.getpid()}.{os.urandom(6).hex()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(os.urandom(KEY_BYTES))
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)  # a whole key or none; one server's only
        except FileExistsError:
            pass  # another server made it first: everyone uses that one
    finally:
        os.unlink(tmp)
    return _read_key(path)


def _read_key(path: str) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | NOFOLLOW)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        raise Untrusted(f"the disk cache's key {path} is a symbolic link: remove the directory "
                        f"{os.path.dirname(path)}, whose blocks anyone could have forged") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size != KEY_BYTES:
            raise Untrusted(f"the disk cache's key {path} is not a {KEY_BYTES}-byte file: "
                            f"remove it and a new one is made")
        check_owner(path, st, "the disk cache's key")
        if st.st_mode & 0o077:
            raise Untrusted(f"the disk cache's key {path} is readable by others (mode "
                            f"{stat.S_IMODE(st.st_mode):04o}): remove the directory "
                            f"{os.path.dirname(path)}, whose blocks anyone could have forged")
        return os.read(fd, KEY_BYTES)
    finally:
        os.close(fd)


def tag(key: bytes, *parts: bytes | memoryview) -> bytes:
    """A keyed blake2b of ``parts`` (a block's magic and header, then its payload): only a
    holder of the directory's key makes one that verifies."""
    mac = blake2b(key=key, digest_size=TAG_BYTES)
    for part in parts:
        mac.update(part)
    return mac.digest()


def open_nofollow(path: str, flags: int, mode: int = 0o600) -> int:
    """``os.open`` that refuses a symbolic link at ``path`` (ELOOP) instead of following it."""
    return os.open(path, flags | NOFOLLOW, mode)

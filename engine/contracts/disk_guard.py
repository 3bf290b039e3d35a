"""What the disk tier (engine/contracts/disk_cache.py) trusts: directories this server's user
owns and nobody else may write, no symbolic link followed at any level, and a per-directory key
that tags every block, so that another local user can neither plant nor alter what is served.

The rules, checked with ``lstat`` and ``O_NOFOLLOW`` (a link is never followed to find out):

- ``--disk-cache-dir`` and the store's ``<fingerprint>/`` directory are real directories (not
  symbolic links), owned by the serving uid, not writable by group or others; otherwise the
  server refuses to start, with a sentence naming the path and the fix.
- Every path below ``--disk-cache-dir`` is opened one level at a time, each level ``O_NOFOLLOW``
  (``opened_dir``): a link where a ``<fingerprint>/`` or ``<hh>/`` directory or a file should
  be is refused (``ELOOP``), never followed, by reads, writes, scans and trims alike.
- Files are created ``O_EXCL | O_NOFOLLOW`` with mode 0600.
- The key (``<fingerprint>/key``: 32 random bytes, 0600) is made by the first server to need
  it: written under a private temporary name, then ``link``-ed into place, which fails for all
  but one of several servers starting at once; the others read the winner's. A key file that
  is not a regular 0600 file of the serving uid is refused like a directory. A server notes
  which file it read (``DirectoryKey``): when the directory was removed or its key replaced
  and another server has made a new one, it reads the new one instead of taking that server's
  blocks for forgeries.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
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


class DirectoryKey:
    """The tag key of a store directory as this process last read it (``value``), and the file
    it came from (device, inode, size and times), so that a key replaced on disk is noticed."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.value, self._stamp = _read_or_make_key(directory)

    def changed(self) -> bool:
        """Whether ``key`` is another file than the one read (an ``lstat``; gone counts)."""
        try:
            return _stamp(os.lstat(os.path.join(self.directory, "key"))) != self._stamp
        except FileNotFoundError:
            return True

    def reload(self) -> bool:
        """Read the key again (made anew if it is gone): whether it is another key now. A key
        file that is not this user's private one: ``Untrusted``."""
        value, self._stamp = _read_or_make_key(self.directory)
        changed, self.value = value != self.value, value
        return changed


def _stamp(st: os.stat_result) -> tuple[int, ...]:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _read_or_make_key(directory: str) -> tuple[bytes, tuple[int, ...]]:
    """The key of ``directory`` (a checked private directory) and its file's stamp: read, or
    made once (see the module's docstring) by whichever server gets there first."""
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


def _read_key(path: str) -> tuple[bytes, tuple[int, ...]]:
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
        return os.read(fd, KEY_BYTES), _stamp(st)
    finally:
        os.close(fd)


def tag(key: bytes, *parts: bytes | memoryview) -> bytes:
    """A keyed blake2b of ``parts`` (a block's magic and header, then its payload): only a
    holder of the directory's key makes one that verifies."""
    mac = blake2b(key=key, digest_size=TAG_BYTES)
    for part in parts:
        mac.update(part)
    return mac.digest()


def open_nofollow(path: str, flags: int, mode: int = 0o600, dir_fd: int | None = None) -> int:
    """``os.open`` that refuses a symbolic link at ``path`` (ELOOP) instead of following it."""
    return os.open(path, flags | NOFOLLOW, mode, dir_fd=dir_fd)


def open_dir(path: str, dir_fd: int | None = None) -> int:
    """A directory's fd; a link (ELOOP) or anything else (ENOTDIR) at ``path`` is refused."""
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | NOFOLLOW, dir_fd=dir_fd)


@contextmanager
def opened_dir(root: str, *names: str) -> Iterator[int]:
    """``root/names...`` opened one level at a time, a link at none of them followed (OSError:
    ELOOP, ENOTDIR, or ENOENT when one is gone)."""
    fd = open_dir(root)
    try:
        for name in names:
            inner = open_dir(name, dir_fd=fd)
            os.close(fd)
            fd = inner
        yield fd
    finally:
        os.close(fd)


def create_private(directory: int, name: str, size: int) -> int:
    """A new private file ``name`` in ``directory``, ``size`` bytes long from the start (a
    scan counts it whole); its fd."""
    fd = open_nofollow(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600, dir_fd=directory)
    try:
        os.ftruncate(fd, size)
    except BaseException:
        os.close(fd)
        os.unlink(name, dir_fd=directory)
        raise
    return fd


def fill(fd: int, parts: Iterable[bytes | memoryview]) -> None:
    """Write ``parts`` from the file's start, then close it."""
    try:
        for part in parts:
            view = memoryview(part).cast("B")
            while view:
                view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


def write_whole(directory: int, name: str, data: bytes) -> None:
    """``name`` in ``directory`` written whole or not at all (a temporary renamed over it)."""
    tmp = f".{name}.{os.getpid()}.{os.urandom(6).hex()}.tmp"
    try:
        fill(create_private(directory, tmp, len(data)), (data,))
        os.replace(tmp, name, src_dir_fd=directory, dst_dir_fd=directory)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=directory)
        except FileNotFoundError:
            pass
        raise

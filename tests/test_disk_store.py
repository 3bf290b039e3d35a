"""The disk tier's store on its own (engine/contracts/disk_cache.py, disk_guard.py): private
files written whole, also when many writers write one block at once; every filesystem race (a
file removed between a listing and its use) skipped, never a reason to turn the store off; a
full disk that stops writing and removes nothing, and one at start that leaves the server
serving without the store until it can be set up; directories another user could write
refused at start; no link followed at any level; a block without this directory's tag never
served, and a key another server made since read instead of taken for forgeries. The capacity:
tests/test_disk_capacity.py."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import threading
import zlib
from pathlib import Path

import pytest

from engine.contracts import disk_cache, disk_guard
from engine.contracts.disk_cache import DiskStore

FP = "cd" * 16
BLOCK = 1000  # payload bytes of the tests' blocks


def block_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("*/*/*.kv"))


def names(count: int, first: int = 0) -> list[str]:
    return [f"{i:032x}" for i in range(first, first + count)]


class Clock:
    """``time.monotonic`` under the test's control (the store's back-off reads it)."""

    def __init__(self, monkeypatch) -> None:
        self.now = 1000.0
        monkeypatch.setattr(disk_cache.time, "monotonic", lambda: self.now)


class Listing(list):
    """What ``os.scandir`` returns, as a list (the store iterates it once)."""

    def __enter__(self) -> Listing:
        return self

    def __exit__(self, *exc) -> None:
        pass


def remove_after_listing(monkeypatch, victim: Path) -> None:
    """``os.scandir`` that lists ``victim`` and then removes it (another server's trim running
    between this one's listing and its ``stat``)."""
    real = os.scandir

    def racing(path):
        entries = Listing(real(path))
        if victim.exists() and any(e.name == victim.name for e in entries):
            victim.unlink()
        return entries

    monkeypatch.setattr(os, "scandir", racing)


def planted(tmp_path: Path, name: str, payload: bytes) -> bytes:
    """A whole, well-formed block with a valid CRC under ``name``, tagged with another
    directory's key (what another local user could write)."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(exist_ok=True)
    other = DiskStore(str(elsewhere), FP)
    assert other.write(name, 16, payload)
    return other.path(name).read_bytes()


def place(store: DiskStore, name: str, data: bytes) -> None:
    store.path(name).parent.mkdir(exist_ok=True)
    store.path(name).write_bytes(data)


# ------------------------------------------------------------------------ files
def test_store_files_are_private(tmp_path):
    """The store's directory is 0700 and its files 0600, written whole under their names."""
    store = DiskStore(str(tmp_path), FP, identity={"model": "x"})
    assert store.write("ef" * 16, 16, b"\x01" * 1000)
    assert (os.stat(store.dir).st_mode & 0o777) == 0o700
    path = store.path("ef" * 16)
    assert (os.stat(path).st_mode & 0o777) == 0o600
    assert (os.stat(path.parent).st_mode & 0o777) == 0o700
    for private in (store.dir / "key", store.dir / "manifest.json", tmp_path / "ledger"):
        assert (os.stat(private).st_mode & 0o777) == 0o600, private
    assert store.read("ef" * 16, 16, 1000) == b"\x01" * 1000
    assert store.read("ef" * 16, 16, 999) is None  # a header that does not match: skipped
    assert not path.exists()
    assert not list(store.dir.glob("*/.*.tmp"))


def test_writers_of_one_block_at_once_each_write_a_private_temporary(tmp_path, monkeypatch):
    """Eight servers write the same block at the same moment: each holds its temporary open
    until all eight do (they are threads of one process, so a name made from the process id
    alone would be taken by the first). Every write succeeds, and the block is whole."""
    stores = [DiskStore(str(tmp_path), FP) for _ in range(8)]
    payload = os.urandom(5000)
    all_writing = threading.Barrier(len(stores))
    passed = threading.local()
    real_write = os.write

    def arrive() -> None:
        if not getattr(passed, "barrier", False):
            passed.barrier = True
            all_writing.wait()

    def write_once_all_write(fd, data):
        if threading.current_thread().name.startswith("writer"):
            arrive()
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", write_once_all_write)
    written: dict[int, bool] = {}

    def writer(i: int) -> None:
        written[i] = stores[i].write("aa" * 16, 16, payload)
        arrive()  # a writer that failed before writing lets the others on

    threads = [threading.Thread(target=writer, args=(i,), name=f"writer-{i}")
               for i in range(len(stores))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    monkeypatch.undo()
    assert written == {i: True for i in range(len(stores))}
    assert all(s.read("aa" * 16, 16, 5000) == payload for s in stores)
    assert not list(stores[0].dir.glob("*/.*.tmp")) and len(block_files(tmp_path)) == 1
    stores[0].trim(float("inf"))  # eight reservations for one file: the count is set again
    assert stores[0].used == stores[0].path("aa" * 16).stat().st_size


def test_servers_starting_at_once_agree_on_one_key(tmp_path):
    stores: list[DiskStore] = []
    threads = [threading.Thread(target=lambda: stores.append(DiskStore(str(tmp_path), FP)))
               for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(stores) == 8 and len({s.key for s in stores}) == 1
    assert stores[0].write("aa" * 16, 16, b"k" * 100)
    assert all(s.read("aa" * 16, 16, 100) == b"k" * 100 for s in stores)
    assert [p.name for p in stores[0].dir.iterdir() if p.name.startswith(".")] == []


@pytest.mark.parametrize("forgery", ["another key", "edited, checksum fixed"])
def test_a_block_without_this_directorys_tag_is_never_served(tmp_path, forgery):
    """Another local user plants a block: a whole, well-formed file with a valid CRC-32 under
    the right name (written by a store of the same model in another directory, or a real
    block edited and its checksum recomputed). Its tag fails: never served, removed."""
    (tmp_path / "shared").mkdir()
    store = DiskStore(str(tmp_path / "shared"), FP)
    name, payload = "ab" * 16, os.urandom(BLOCK)
    if forgery == "another key":
        forged = planted(tmp_path, name, payload)
    else:
        assert store.write(name, 16, payload)
        forged = bytearray(store.path(name).read_bytes())
        forged[-BLOCK:] = b"\x00" * BLOCK
        crc_at = len(disk_cache.MAGIC) + disk_cache._HEADER.size - 4
        forged[crc_at : crc_at + 4] = zlib.crc32(forged[-BLOCK:]).to_bytes(4, "little")
        store.path(name).unlink()
    place(store, name, bytes(forged))
    assert store.contains(name)
    assert store.read(name, 16, BLOCK) is None
    assert store.rejected == 1 and not store.path(name).exists()
    assert store.enabled


# ------------------------------------------------------------------- a changed key
@pytest.mark.parametrize("first", ["reads", "writes"])
@pytest.mark.parametrize("change", ["directory removed", "key replaced"])
def test_a_server_holding_an_old_key_takes_up_the_new_one(tmp_path, change, first):
    """A server runs; its store's directory is removed (or its key replaced), and a second
    server starting makes a new key. The first, on its next read of the second's block (whose
    tag fails against its key) or its next write, reads the key file again and uses the new
    key: each then serves the other's blocks, none is removed. A planted block still is."""
    old = DiskStore(str(tmp_path), FP)
    assert old.write(names(1)[0], 16, b"o" * BLOCK)
    if change == "directory removed":
        shutil.rmtree(old.dir)
    else:
        (old.dir / "key").unlink()
    new = DiskStore(str(tmp_path), FP)
    assert new.key != old.key
    mine, theirs = names(1, 10)[0], names(1, 20)[0]
    if first == "reads":
        assert new.write(theirs, 16, b"n" * BLOCK)
        assert old.read(theirs, 16, BLOCK) == b"n" * BLOCK
        assert old.write(mine, 16, b"p" * BLOCK)
    else:
        assert old.write(mine, 16, b"p" * BLOCK)
        assert new.write(theirs, 16, b"n" * BLOCK)
        assert old.read(theirs, 16, BLOCK) == b"n" * BLOCK
    assert new.read(mine, 16, BLOCK) == b"p" * BLOCK
    assert old.key == new.key and old.rejected == new.rejected == 0
    assert old.enabled and new.enabled
    forged = names(1, 30)[0]
    place(old, forged, planted(tmp_path, forged, b"f" * BLOCK))
    assert old.read(forged, 16, BLOCK) is None and not old.path(forged).exists()
    assert old.rejected == 1 and old.key == new.key


# ----------------------------------------------------------------- links, any level
@pytest.mark.parametrize("level", ["<hh>", "the block"])
def test_a_link_below_the_directory_is_never_followed(tmp_path, level):
    """A valid block reachable only through a symbolic link (its ``<hh>`` directory or its
    file a link to one outside the store) is neither found, read, counted nor removed, and
    no write goes through the link."""
    root = tmp_path / "kv"
    root.mkdir(mode=0o700)
    store = DiskStore(str(root), FP)
    name = "ab" * 16
    assert store.write(name, 16, b"v" * BLOCK)
    outside = tmp_path / "outside"
    if level == "<hh>":
        store.path(name).parent.rename(outside)
        store.path(name).parent.symlink_to(outside, target_is_directory=True)
        target = outside / store.path(name).name
    else:
        outside.mkdir()
        target = outside / store.path(name).name
        store.path(name).rename(target)
        store.path(name).symlink_to(target)
    before = target.read_bytes()
    assert not store.contains(name)
    assert store.read(name, 16, BLOCK) is None
    store.trim(0)  # every file out: not the one behind the link
    assert target.read_bytes() == before and store.used == 0
    assert store.space.scan() == ([], [])
    if level == "<hh>":
        assert not store.write("ab" + "00" * 15, 16, b"w" * BLOCK)  # through the link: no
        assert sorted(p.name for p in outside.iterdir()) == [target.name]
    assert store.enabled


# ----------------------------------------------------------------------- races
def test_a_file_removed_between_listing_and_stat_is_skipped_by_a_trim(tmp_path, monkeypatch):
    store = DiskStore(str(tmp_path), FP)
    for name in names(5):
        assert store.write(name, 16, b"x" * BLOCK)
    remove_after_listing(monkeypatch, store.path(names(5)[2]))
    store.trim(0)  # another server's trim removed one file while this one listed them
    monkeypatch.undo()
    assert store.enabled and block_files(tmp_path) == [] and store.used == 0
    assert store.write("ee" * 16, 16, b"y" * BLOCK)
    assert store.read("ee" * 16, 16, BLOCK) == b"y" * BLOCK


def test_a_file_removed_between_listing_and_stat_at_start_up_is_skipped(tmp_path, monkeypatch):
    first = DiskStore(str(tmp_path), FP)
    for name in names(3):
        assert first.write(name, 16, b"x" * BLOCK)
    remove_after_listing(monkeypatch, first.path(names(3)[0]))
    second = DiskStore(str(tmp_path), FP)  # starting while another server trims
    monkeypatch.undo()
    assert second.enabled and second.used == 2 * first.path(names(3)[1]).stat().st_size
    assert second.read(names(3)[1], 16, BLOCK) == b"x" * BLOCK


def test_only_the_directory_itself_gone_turns_the_store_off(tmp_path):
    store = DiskStore(str(tmp_path), FP)
    assert store.write("03" * 16, 16, b"z" * 100)
    shutil.rmtree(store.path("03" * 16).parent)  # a subdirectory: made again
    assert store.read("03" * 16, 16, 100) is None and store.enabled
    assert store.write("03" * 16, 16, b"z" * 100)
    shutil.rmtree(store.dir)
    assert not store.write("04" * 16, 16, b"w" * 100)
    assert store.read("03" * 16, 16, 100) is None
    assert not store.enabled and not store.contains("03" * 16)


# ---------------------------------------------------------------------- a full disk
def full(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_stops_writing_keeps_every_block_and_says_so_once(tmp_path, monkeypatch,
                                                                       caplog):
    """Something else fills the disk: writes fail with ENOSPC. Every block already there (this
    server's and another's) stays and is served; writing stops (no write is even tried) with
    one warning, is tried again after the back-off, and goes on once there is room."""
    clock = Clock(monkeypatch)
    store = DiskStore(str(tmp_path), FP, capacity=10**6)
    neighbour = DiskStore(str(tmp_path), FP, capacity=10**6)
    for name in names(4):
        assert store.write(name, 16, b"m" * BLOCK)
    for name in names(4, 10):
        assert neighbour.write(name, 16, b"n" * BLOCK)
    before = block_files(tmp_path)
    real_write, tries = os.write, []

    def full_write(fd, data):
        tries.append(fd)
        full()

    monkeypatch.setattr(os, "write", full_write)
    with caplog.at_level(logging.WARNING, logger="radixserve.disk_cache"):
        for name in names(6, 20):
            assert not store.write(name, 16, b"f" * BLOCK)
        assert len(tries) == 1  # stopped after the first
        clock.now += disk_cache.FULL_RETRY_SECONDS[0] + 1
        assert not store.write("aa" * 16, 16, b"f" * BLOCK)  # tried again: still full
        assert len(tries) == 2
        clock.now += disk_cache.FULL_RETRY_SECONDS[0] + 1  # the wait has doubled
        assert not store.write("aa" * 16, 16, b"f" * BLOCK) and len(tries) == 2
    assert len([r for r in caplog.records if "full" in r.getMessage()]) == 1
    assert block_files(tmp_path) == before and store.enabled
    assert not list(store.dir.glob("*/.*.tmp"))  # no half-written file
    assert all(store.read(n, 16, BLOCK) == b"m" * BLOCK for n in names(4))
    assert all(store.read(n, 16, BLOCK) == b"n" * BLOCK for n in names(4, 10))
    monkeypatch.setattr(os, "write", real_write)
    clock.now += 2 * disk_cache.FULL_RETRY_SECONDS[0] + 1
    assert store.write("aa" * 16, 16, b"f" * BLOCK)
    assert store.used == sum(p.stat().st_size for p in block_files(tmp_path))


@pytest.mark.parametrize("missing", ["its directory", "its key", "the manifest"])
def test_a_full_disk_at_start_leaves_the_store_off_until_it_can_be_set_up(
        tmp_path, monkeypatch, caplog, missing):
    """The first server starts on a full disk: its store's directory, key or manifest cannot
    be made (every file or directory made fails with ENOSPC). It does not fail: the store is
    off (``ready`` False: nothing read or written), said once; it is set up again after the
    back-off, still full, and once there is room it is set up and writes."""
    clock = Clock(monkeypatch)
    if missing != "its directory":
        DiskStore(str(tmp_path), FP)  # the directory (and its key) made while there was room
        if missing == "its key":
            (tmp_path / FP / "key").unlink()
    real_open, real_mkdir = os.open, os.mkdir

    def no_new_files(path, flags, *args, **kwargs):
        if flags & os.O_CREAT:
            full()
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", no_new_files)
    monkeypatch.setattr(os, "mkdir", full)
    with caplog.at_level(logging.WARNING, logger="radixserve.disk_cache"):
        store = DiskStore(str(tmp_path), FP, capacity=10**6, identity={"model": "x"})
        assert store.enabled and not store.ready and not store.writing
        assert not store.write("aa" * 16, 16, b"a" * BLOCK)
        assert store.read("aa" * 16, 16, BLOCK) is None
        clock.now += disk_cache.FULL_RETRY_SECONDS[0] + 1
        assert store.writing and not store.write("aa" * 16, 16, b"a" * BLOCK)
        assert not store.ready and not store.writing  # tried again, still full: waits longer
        monkeypatch.setattr(os, "open", real_open)
        monkeypatch.setattr(os, "mkdir", real_mkdir)
    warnings = [r.getMessage() for r in caplog.records if "cannot be set up" in r.getMessage()]
    assert len(warnings) == 1 and "serving without it" in warnings[0]
    clock.now += 2 * disk_cache.FULL_RETRY_SECONDS[0] + 1
    assert store.write("aa" * 16, 16, b"a" * BLOCK)
    assert store.ready and store.read("aa" * 16, 16, BLOCK) == b"a" * BLOCK
    assert (store.dir / "key").is_file() and (store.dir / "manifest.json").is_file()


# ------------------------------------------------------------------- trust at start
def fake_owner(monkeypatch, path: Path, uid: int) -> None:
    """``lstat`` says another user owns ``path`` (the tests may run as root, who owns all)."""
    real = os.lstat

    def lstat(p, *args, **kwargs):
        st = real(p, *args, **kwargs)
        if os.fspath(p) == str(path):
            fields = list(st[:10])
            fields[4] = uid
            return os.stat_result(fields)
        return st

    monkeypatch.setattr(disk_guard.os, "lstat", lstat)


@pytest.mark.parametrize("which", ["DIR", "fingerprint"])
@pytest.mark.parametrize("problem,says", [
    ("another uid", "is owned by uid 4242, not by this server's uid"),
    ("group-writable", "is writable by group or others (mode 0770): run chmod go-w"),
    ("other-writable", "is writable by group or others (mode 1777): run chmod go-w"),
    ("symlink", "is a symbolic link"),
])
def test_a_directory_another_user_could_write_is_refused_naming_it(tmp_path, monkeypatch,
                                                                   which, problem, says):
    root = tmp_path / "kv"
    target = root if which == "DIR" else root / FP
    if which == "fingerprint":
        root.mkdir(mode=0o700)
    if problem == "symlink":
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        target.symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    else:
        target.mkdir(mode=0o700)
        if problem == "another uid":
            fake_owner(monkeypatch, target, 4242)
        else:
            os.chmod(target, 0o770 if problem == "group-writable" else 0o1777)
    with pytest.raises(ValueError, match=f"{target} {says}".replace("(", r"\(").replace(
            ")", r"\)")):
        DiskStore(str(root), FP)
    if which == "DIR":  # what the server checks at start (EngineConfig)
        with pytest.raises(ValueError, match=f"--disk-cache-dir {target}"):
            disk_cache.check_directory(str(root))


@pytest.mark.parametrize("problem", ["a link", "readable by others"])
def test_a_key_another_user_could_have_read_or_placed_is_refused(tmp_path, problem):
    store = DiskStore(str(tmp_path), FP)
    key = store.dir / "key"
    if problem == "a link":
        key.rename(tmp_path / "elsewhere")
        key.symlink_to(tmp_path / "elsewhere")
    else:
        os.chmod(key, 0o644)
    with pytest.raises(ValueError, match=f"the disk cache's key {key} is"):
        DiskStore(str(tmp_path), FP)


@pytest.mark.parametrize("problem,says", [("missing", "does not exist"),
                                          ("a file", "is not a directory"),
                                          ("read-only", "is not writable")])
def test_a_bad_directory_is_refused_with_a_sentence(tmp_path, monkeypatch, problem, says):
    path = tmp_path / "kv"
    if problem == "a file":
        path.write_text("")
    elif problem == "read-only":
        path.mkdir(mode=0o500)
        # root may write anywhere: the permission answer is the kernel's, asked through access
        monkeypatch.setattr(disk_cache.os, "access", lambda p, mode: False)
    with pytest.raises(ValueError, match=f"--disk-cache-dir {path} {says}"):
        disk_cache.check_directory(str(path))


def test_a_ledger_that_is_a_link_is_refused(tmp_path):
    """The directory's shared count and capacity (``DIR/ledger``) is never read or written
    through a link: a server refuses to start on one."""
    (tmp_path / "kv").mkdir(mode=0o700)
    (tmp_path / "elsewhere").write_bytes(bytes(16))
    (tmp_path / "kv" / "ledger").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ValueError, match="the disk cache's ledger .* is a symbolic link"):
        DiskStore(str(tmp_path / "kv"), FP)
    assert (tmp_path / "elsewhere").read_bytes() == bytes(16)

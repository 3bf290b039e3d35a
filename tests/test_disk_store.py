"""The disk tier's store on its own (engine/contracts/disk_cache.py, disk_guard.py,
disk_ledger.py): private files written whole; a capacity every process keeps together; every
filesystem race (a file removed between a listing and its use) skipped, never a reason to turn
the store off; a full disk that stops writing and removes nothing; directories another user
could write refused at start; a block without this directory's tag never served."""

from __future__ import annotations

import errno
import logging
import multiprocessing
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
        if any(e.path == str(victim) for e in entries):
            victim.unlink()
        return entries

    monkeypatch.setattr(os, "scandir", racing)


# ------------------------------------------------------------------------ files
def test_store_files_are_private(tmp_path):
    """The store's directory is 0700 and its files 0600, written whole under their names."""
    store = DiskStore(str(tmp_path), FP, identity={"model": "x"})
    assert store.write("ef" * 16, 16, b"\x01" * 1000)
    assert (os.stat(store.dir).st_mode & 0o777) == 0o700
    path = store.path("ef" * 16)
    assert (os.stat(path).st_mode & 0o777) == 0o600
    assert (os.stat(path.parent).st_mode & 0o777) == 0o700
    assert (os.stat(store.dir / "key").st_mode & 0o777) == 0o600
    assert store.read("ef" * 16, 16, 1000) == b"\x01" * 1000
    assert store.read("ef" * 16, 16, 999) is None  # a header that does not match: skipped
    assert not path.exists()
    assert not list(store.dir.glob("*/.*.tmp"))


def test_two_stores_write_one_block_and_read_it_whole(tmp_path):
    """Two servers writing the same block write the same bytes through private temporary
    names: the block is whole whichever rename lands last."""
    a, b = DiskStore(str(tmp_path), FP), DiskStore(str(tmp_path), FP)
    payload = os.urandom(5000)
    assert a.write("aa" * 16, 16, payload)
    b.path("aa" * 16).unlink()
    assert b.write("aa" * 16, 16, payload)
    assert a.read("aa" * 16, 16, 5000) == payload


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
        (tmp_path / "elsewhere").mkdir()
        other = DiskStore(str(tmp_path / "elsewhere"), FP)
        assert other.write(name, 16, payload)
        planted = other.path(name).read_bytes()
    else:
        assert store.write(name, 16, payload)
        planted = bytearray(store.path(name).read_bytes())
        planted[-BLOCK:] = b"\x00" * BLOCK
        crc_at = len(disk_cache.MAGIC) + disk_cache._HEADER.size - 4
        planted[crc_at : crc_at + 4] = zlib.crc32(planted[-BLOCK:]).to_bytes(4, "little")
        store.path(name).unlink()
    store.path(name).parent.mkdir(exist_ok=True)
    store.path(name).write_bytes(bytes(planted))
    assert store.contains(name)
    assert store.read(name, 16, BLOCK) is None
    assert store.rejected == 1 and not store.path(name).exists()
    assert store.enabled


# ----------------------------------------------------------------------- capacity
def test_the_store_stays_within_its_capacity_dropping_the_least_recently_used(tmp_path):
    """Past its capacity a write first removes the least recently used files (a read refreshes
    a file) down to 90%; another store on the same directory counts the same files."""
    size = len(disk_cache.MAGIC) + 60 + disk_guard.TAG_BYTES + BLOCK  # magic, header, tag
    store = DiskStore(str(tmp_path), FP, capacity=10 * size)
    written = names(10)
    for i, name in enumerate(written):
        assert store.write(name, 16, bytes([i]) * BLOCK)
        os.utime(store.path(name), ns=(i * 10**9, i * 10**9))  # written one second apart
    assert store.read(written[0], 16, BLOCK) == bytes([0]) * BLOCK  # now the most recent
    assert store.write("ff" * 16, 16, b"\xff" * BLOCK)  # over capacity: trims to 90%
    kept = {p.stem for p in block_files(tmp_path)}
    assert written[0] in kept and "ff" * 16 in kept
    assert written[1] not in kept and written[2] not in kept
    assert len(kept) <= 9
    other = DiskStore(str(tmp_path), FP, capacity=10 * size)
    assert other.used == store.used == sum(p.stat().st_size for p in block_files(tmp_path))


def test_a_killed_writers_temporaries_are_counted_then_removed_when_stale(tmp_path):
    store = DiskStore(str(tmp_path), FP, capacity=10**6)
    assert store.write("aa" * 16, 16, b"a" * BLOCK)
    fresh = store.path("aa" * 16).with_name(".bb.kv.1.x.tmp")
    stale = store.path("aa" * 16).with_name(".cc.kv.2.y.tmp")
    for tmp in (fresh, stale):
        tmp.write_bytes(b"t" * 10)
    old = int((disk_cache.time.time() - disk_cache.STALE_TMP_SECONDS - 5) * 1e9)
    os.utime(stale, ns=(old, old))
    store.trim(store.capacity)
    assert fresh.exists() and not stale.exists()
    block = store.path("aa" * 16).stat().st_size
    assert store.used == 2 * block  # a write in flight counts as a whole block


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

    def full(fd, data):
        tries.append(fd)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full)
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


# ------------------------------------------------------------ many processes, one directory
def write_and_trim(directory: str, capacity: int, seed: int, count: int, barrier,
                   results) -> None:
    """One server's share of the concurrent test. First ``count`` blocks whose names the
    others write too, some read back, a trim every tenth (files vanish under every listing);
    then, once all are there, blocks of its own worth three quarters of the capacity: only a
    count all of them share keeps the total under it. Puts (seed, store on, blocks read)."""
    store = DiskStore(directory, FP, capacity=capacity)
    payload = BLOCK - BLOCK % 16
    read = 0
    for i in range(count):
        name = f"{(i * 7 + seed * (i % 3)) % (3 * count):032x}"
        store.write(name, 16, name.encode()[:16] * (payload // 16))
        if i % 5 == 0:
            read += store.read(f"{(i // 2):032x}", 16, payload) is not None
        if i % 10 == 9:
            store.trim(capacity * 0.5)
    store.trim(0)
    barrier.wait()
    for i in range(capacity // (payload + 100) * 3 // 4):
        name = f"{seed + 1:02x}{i:030x}"
        store.write(name, 16, name.encode()[:16] * (payload // 16))
    results.put((seed, store.enabled, read))


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("processes", [2, 4])
def test_processes_sharing_a_directory_stay_on_and_within_the_bound(tmp_path, processes):
    payload = BLOCK - BLOCK % 16
    block = len(disk_cache.MAGIC) + 60 + disk_guard.TAG_BYTES + payload
    capacity = 40 * block
    DiskStore(str(tmp_path), FP)  # the key, made once (the test of many starts is above)
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(processes), ctx.Queue()
    workers = [ctx.Process(target=write_and_trim,
                           args=(str(tmp_path), capacity, seed, 300, barrier, results))
               for seed in range(processes)]
    for w in workers:
        w.start()
    ended = sorted(results.get(timeout=60) for _ in workers)
    for w in workers:
        w.join(10)
        assert w.exitcode == 0
    assert [enabled for _, enabled, _ in ended] == [True] * processes
    on_disk = sum(p.stat().st_size for p in tmp_path.glob(f"{FP}/*/*"))
    assert 0 < on_disk <= capacity
    store = DiskStore(str(tmp_path), FP, capacity=capacity)
    assert store.used == on_disk
    assert all(store.read(p.stem, 16, payload) is not None for p in block_files(tmp_path))

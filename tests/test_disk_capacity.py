"""The disk tier's capacity (engine/contracts/disk_capacity.py, disk_ledger.py): one per
``--disk-cache-dir``, the largest any server gave, never lowered by a server started with a
smaller number; every model's files counted together and trimmed least recently used first
across them; a block being written counted whole from its start; and processes sharing the
directory that keep the count at least what is on disk and within the capacity at every
moment."""

from __future__ import annotations

import fcntl
import multiprocessing
import os
from pathlib import Path

import pytest

from engine.contracts import disk_cache
from engine.contracts.disk_cache import DiskStore
from engine.contracts.disk_capacity import Capacity

FP, OTHER_FP = "cd" * 16, "ef" * 16
BLOCK = 1000  # payload bytes of the tests' blocks
SIZE = disk_cache._HEAD_BYTES + BLOCK  # a block's file: magic, header, tag, payload


def block_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("*/*/*.kv"))


def on_disk(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.glob("*/*/*") if p.is_file())


def names(count: int, first: int = 0) -> list[str]:
    return [f"{i:032x}" for i in range(first, first + count)]


def write_aging(store: DiskStore, blocks: list[str], first_second: int = 0) -> None:
    """``blocks`` written one second apart (their files' times), oldest first."""
    for i, name in enumerate(blocks, first_second):
        assert store.write(name, 16, bytes([i % 256]) * BLOCK)
        os.utime(store.path(name), ns=(i * 10**9, i * 10**9))


def test_the_store_stays_within_its_capacity_dropping_the_least_recently_used(tmp_path):
    """Past its capacity a write first removes the least recently used files (a read refreshes
    a file) down to 90%; another store on the same directory counts the same files."""
    store = DiskStore(str(tmp_path), FP, capacity=10 * SIZE)
    written = names(10)
    write_aging(store, written)
    assert store.read(written[0], 16, BLOCK) == bytes([0]) * BLOCK  # now the most recent
    assert store.write("ff" * 16, 16, b"\xff" * BLOCK)  # over capacity: trims to 90%
    kept = {p.stem for p in block_files(tmp_path)}
    assert written[0] in kept and "ff" * 16 in kept
    assert written[1] not in kept and written[2] not in kept
    assert len(kept) <= 9
    other = DiskStore(str(tmp_path), FP, capacity=10 * SIZE)
    assert other.used == store.used == on_disk(tmp_path)


@pytest.mark.parametrize("smaller", [10, 0])
def test_a_server_started_with_a_smaller_capacity_keeps_the_directorys(tmp_path, smaller):
    """One server fills the directory to its 100-block capacity; a replica started with
    ``--disk-cache-gb`` for 10 blocks (or 0, no limit of its own) writes one more: the
    directory's capacity stays 100 blocks and its files are not trimmed down to 10 (9 after
    the trim), only by as many as make room."""
    big = DiskStore(str(tmp_path), FP, capacity=100 * SIZE)
    write_aging(big, names(100))
    small = DiskStore(str(tmp_path), FP, capacity=smaller * SIZE)
    assert small.capacity == big.capacity == 100 * SIZE
    assert small.write("ff" * 16, 16, b"\xff" * BLOCK)
    assert 90 <= len(block_files(tmp_path)) <= 100
    assert on_disk(tmp_path) <= 100 * SIZE
    assert small.path("ff" * 16).exists() and not big.path(names(1)[0]).exists()


def test_the_largest_capacity_given_is_the_directorys(tmp_path):
    """A server with a larger limit raises the directory's capacity for every server of it;
    the first one's store then holds more than its own number."""
    first = DiskStore(str(tmp_path), FP, capacity=10 * SIZE)
    assert first.capacity == 10 * SIZE
    DiskStore(str(tmp_path), OTHER_FP, capacity=20 * SIZE)
    assert first.capacity == 20 * SIZE
    write_aging(first, names(20))
    assert len(block_files(tmp_path)) == 20 and first.used == 20 * SIZE


def test_every_model_in_a_directory_shares_one_capacity(tmp_path):
    """Two models (two fingerprints) in one directory, each server given 10 blocks: together
    they hold at most 10 blocks' bytes, and the least recently used go first whichever model's
    they are (the first model's oldest files make room for the second's)."""
    first = DiskStore(str(tmp_path), FP, capacity=10 * SIZE)
    second = DiskStore(str(tmp_path), OTHER_FP, capacity=10 * SIZE)
    write_aging(first, names(10))
    write_aging(second, names(10, 100), first_second=10)
    assert on_disk(tmp_path) <= 10 * SIZE
    assert first.used == second.used == on_disk(tmp_path)
    kept = {(p.parent.parent.name, p.stem) for p in block_files(tmp_path)}
    assert all((OTHER_FP, n) in kept for n in names(5, 105))  # the newest stay
    assert not any((FP, n) in kept for n in names(10))  # the oldest, the first model's, went
    assert first.write(names(1, 500)[0], 16, b"n" * BLOCK)
    assert on_disk(tmp_path) <= 10 * SIZE


def test_a_block_being_written_is_counted_whole_from_its_start(tmp_path, monkeypatch):
    """While a block's bytes are being written, its temporary already has the block's size:
    a trim by another server counts it whole (so the count never falls below what is on
    disk), and a killed writer's temporary is removed once stale."""
    store = DiskStore(str(tmp_path), FP, capacity=10**6)
    assert store.write("aa" * 16, 16, b"a" * BLOCK)
    seen = []
    real_fill = disk_cache.fill

    def fill_after_a_trim(fd, parts):
        store.trim(float("inf"))  # another server's trim, while this block is being written
        seen.append((store.space.scan()[1], store.used))
        real_fill(fd, parts)

    monkeypatch.setattr(disk_cache, "fill", fill_after_a_trim)
    assert store.write("bb" * 16, 16, b"b" * BLOCK)
    monkeypatch.undo()
    ((temporaries, used),) = seen
    assert [t.size for t in temporaries] == [SIZE] and used == 2 * SIZE
    killed = store.path("cc" * 16).parent
    killed.mkdir()
    stale = killed / f".{'cc' * 16}.kv.1.x.tmp"
    stale.write_bytes(b"t" * SIZE)
    store.trim(float("inf"))
    assert stale.exists() and store.used == 3 * SIZE  # maybe a write in flight: counted
    old = int((disk_cache.time.time() - 601) * 1e9)
    os.utime(stale, ns=(old, old))
    store.trim(float("inf"))
    assert not stale.exists() and store.used == 2 * SIZE


def lock_held(ledger: str) -> str:
    """How the ledger is locked now, seen from another open file: exclusive, shared or free."""
    fd = os.open(ledger, os.O_RDONLY)
    try:
        for mode, state in ((fcntl.LOCK_EX, "free"), (fcntl.LOCK_SH, "shared")):
            try:
                fcntl.flock(fd, mode | fcntl.LOCK_NB)
                return state
            except BlockingIOError:
                continue
        return "exclusive"
    finally:
        os.close(fd)  # releases whatever this took


def test_files_change_under_the_ledgers_lock_and_are_renamed_under_its_shared_one(
        tmp_path, monkeypatch):
    """Every file the count covers is made (with its reservation) and removed (with its bytes
    off the count: a trim's, a rejected block's) under the ledger's exclusive lock, and a
    written block is renamed into place under its shared one, which no trim holds: a trim's
    scan never sees a file its count lacks, nor misses a block mid-rename (a listing during a
    rename may show neither name)."""
    store = DiskStore(str(tmp_path), FP, capacity=3 * SIZE)
    ledger, seen = str(tmp_path / "ledger"), []
    real_replace, real_unlink, real_create = os.replace, os.unlink, disk_cache.create_private

    def replace(src, dst, **kwargs):
        seen.append(("rename", lock_held(ledger)))
        return real_replace(src, dst, **kwargs)

    def unlink(path, **kwargs):
        if kwargs.get("dir_fd") is not None:
            seen.append(("remove", lock_held(ledger)))
        return real_unlink(path, **kwargs)

    def create(directory, name, size):
        seen.append(("make", lock_held(ledger)))
        return real_create(directory, name, size)

    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(os, "unlink", unlink)
    monkeypatch.setattr(disk_cache, "create_private", create)
    write_aging(store, names(4))  # the fourth trims two files out
    kept = block_files(tmp_path)
    kept[0].write_bytes(kept[0].read_bytes()[:-1] + b"\x00")  # a flipped byte
    assert store.read(kept[0].stem, 16, BLOCK) is None
    monkeypatch.undo()
    assert [kind for kind, _ in seen].count("make") == 4
    assert [kind for kind, _ in seen].count("remove") == 3
    assert set(seen) == {("make", "exclusive"), ("rename", "shared"), ("remove", "exclusive")}
    assert store.used == on_disk(tmp_path)


# ------------------------------------------------------------ many processes, one directory
PAYLOAD = BLOCK - BLOCK % 16  # what the processes write: their block's name, repeated


def write_and_trim(directory: str, fingerprint: str, capacity: int, seed: int, count: int,
                   barrier, results) -> None:
    """One server's share of the concurrent test. First ``count`` blocks whose names the
    others of its model write too, some read back, a trim every tenth (files vanish under
    every listing); then, once all are there, blocks of its own worth three quarters of the
    capacity: only a count all of them share keeps the total under it. Puts (seed, store on,
    blocks read)."""
    store = DiskStore(directory, fingerprint, capacity=capacity)
    read = 0
    for i in range(count):
        name = f"{(i * 7 + seed * (i % 3)) % (3 * count):032x}"
        store.write(name, 16, name.encode()[:16] * (PAYLOAD // 16))
        if i % 5 == 0:
            read += store.read(f"{(i // 2):032x}", 16, PAYLOAD) is not None
        if i % 10 == 9:
            store.trim(capacity * 0.5)
    barrier.wait()
    for i in range(capacity // SIZE * 3 // 4):
        name = f"{seed + 1:02x}{i:030x}"
        store.write(name, 16, name.encode()[:16] * (PAYLOAD // 16))
    results.put((seed, store.enabled, read))


def check_the_count(space: Capacity, capacity: int) -> None:
    """Under the ledger's lock, no file is made, renamed or removed: the files there (blocks
    and temporaries) hold at most what the shared count says, and that is within the bound."""
    with space.ledger.locked() as fd:
        used, recorded = space.ledger.read(fd)
        blocks, temporaries = space.scan()
    there = sum(f.size for f in blocks + temporaries)
    assert recorded == capacity and there <= used <= capacity, (there, used)


@pytest.mark.e2e
@pytest.mark.parametrize("processes", [2, 4])
def test_processes_sharing_a_directory_keep_the_count_and_the_bound(tmp_path, processes):
    """Servers of two models write, read and trim one directory at once (every filesystem
    race their normal case) while this process checks, again and again under the ledger's
    lock, that the count covers every file there and stays within the capacity; at the end
    every store is on, within the bound, and every file there is served."""
    capacity = 40 * SIZE
    space = Capacity(str(tmp_path))
    for fingerprint in (FP, OTHER_FP):  # the keys and the capacity, made once
        DiskStore(str(tmp_path), fingerprint, capacity=capacity)
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(processes), ctx.Queue()
    workers = [ctx.Process(target=write_and_trim,
                           args=(str(tmp_path), (FP, OTHER_FP)[seed % 2], capacity, seed, 300,
                                 barrier, results))
               for seed in range(processes)]
    for w in workers:
        w.start()
    checks = 0
    while any(w.is_alive() for w in workers):
        check_the_count(space, capacity)
        checks += 1
    ended = sorted(results.get(timeout=120) for _ in workers)
    for w in workers:
        w.join(30)
        assert w.exitcode == 0
    check_the_count(space, capacity)
    assert checks > 0 and [enabled for _, enabled, _ in ended] == [True] * processes
    files = block_files(tmp_path)
    assert 0 < on_disk(tmp_path) <= capacity and not list(tmp_path.glob("*/*/.*.tmp"))
    assert (SIZE - BLOCK + PAYLOAD) * len(files) == on_disk(tmp_path)
    for fingerprint in (FP, OTHER_FP):
        store = DiskStore(str(tmp_path), fingerprint, capacity=capacity)
        assert all(store.read(p.stem, 16, PAYLOAD) is not None
                   for p in files if p.parent.parent.name == fingerprint)
    assert store.used == on_disk(tmp_path)

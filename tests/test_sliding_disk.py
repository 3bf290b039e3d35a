"""The disk tier (``--disk-cache-dir``) with sliding-window layers in pages of their own
(``--sliding-kv-ratio``), served in-process on the small Gemma-3-shaped model of
tests/test_sliding_kv.py (a 16-token window), at page sizes 1 and 16.

A block holds the full layer's KV, and its window file (engine/contracts/disk_blocks.py's
``window_name``) the sliding layers' KV of its pages where a kept window covered it. A disk
match ends only where the window before its end is read too: prompts evicted from the device
to disk, and read back by a restarted engine, hit up to their last whole block and decode
transformers' greedy tokens, then continue as a next turn; with a window file missing, the
match ends where the windows are (or nowhere) and the scheduler computes the rest. Beside a
host tier, a match read from host-only nodes continues with a disk load. A windowed
directory is another store than a full-KV engine's. The accounting of both pools
(the orphaned loads' sliding pages included) holds after every step, and nothing leaks.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine.contracts.disk_blocks import block_hashes, fingerprint, window_name
from engine.contracts.sampling_params import SamplingParams
from tests.test_disk_fingerprint import served_identity
from tests.test_scheduler import Harness, hf_greedy
from tests.test_sliding_kv import WindowHarness, gemma_dir, hf_gemma  # noqa: F401

GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
LENGTHS = (70, 101, 133, 150)  # several windows each, none a whole number of blocks


def harness(model: str, directory: Path, page_size: int, **options) -> WindowHarness:
    options = {"num_pages": 320 // page_size, "sliding_kv_ratio": 0.75,
               "chunked_prefill_size": 24, "max_prefill_tokens": 64, **options}
    return WindowHarness(model, page_size=page_size, disk_cache_dir=str(directory), **options)


def close(h: Harness) -> None:
    """What a stopping worker does: write what is queued."""
    h.worker.io.close()


def flush(h: Harness) -> None:
    """Write what is queued, and serve on with a fresh I/O thread."""
    from engine.worker.tier_io import open_tier_io

    close(h)
    h.worker.io = open_tier_io(h.config, h.worker.runner)


def long_prompts(seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 90, n).tolist() for n in LENGTHS]


def saved_once(model: str, directory: Path):
    """A prompt served once at page size 16 and written to ``directory``: the prompt, the
    store, and the name of its last block's window file."""
    prompt = long_prompts(23)[2]
    first = harness(model, directory, 16)
    first.add("a", prompt, GREEDY)
    first.run()
    close(first)
    store = first.sched.disk.store
    return prompt, store, window_name(block_hashes(store.fingerprint, None, prompt, 16)[-1])


def free_at_the_end(h: Harness) -> None:
    tree = h.sched.tree
    tree.reset()
    for alloc in (tree.allocator, tree.sliding.allocator):
        assert alloc.num_free_pages == alloc.num_pages


@pytest.mark.parametrize("page_size", [1, 16])
def test_windows_go_to_disk_and_a_restart_reads_them(gemma_dir, hf_gemma, tmp_path,  # noqa: F811
                                                     page_size):
    """Four long prompts through a device pool that holds about two: the first, resent, is
    read back from disk. A restarted engine on the same directory reads each prompt back up
    to its last whole block below its last token (the window before it from window files),
    decodes transformers' tokens, and the first one's next turn hits its whole history."""
    cold = long_prompts(21)
    first = harness(gemma_dir, tmp_path, page_size)
    for i, p in enumerate(cold):
        first.add(f"a{i}", p, GREEDY)
        first.run()
    first.add("again", cold[0], GREEDY)
    first.run()
    close(first)
    expected = [hf_greedy(hf_gemma, p, 20) for p in cold]
    assert first.finals["again"][0].cached_tokens_disk > 0
    assert first.outputs["again"][0] == expected[0]
    store = first.sched.disk.store
    windows = [n for n in (block_hashes(store.fingerprint, None, p, 16)[-1] for p in cold)
               if store.contains(window_name(n))]
    assert len(windows) == len(cold)  # each prompt's last block has its window file
    # window files are files of the store: the shared count (and so the capacity) has them
    files = list(tmp_path.glob("*/*/*.kv"))
    assert first.worker.io.store.used == sum(f.stat().st_size for f in files)
    assert {store.path(window_name(n)) for n in windows} <= set(files)
    free_at_the_end(first)

    second = harness(gemma_dir, tmp_path, page_size)
    for i, p in enumerate(cold):
        second.add(f"b{i}", p, GREEDY)
        second.run()
        final = second.finals[f"b{i}"][0]
        assert final.cached_tokens == final.cached_tokens_disk == (len(p) - 1) // 16 * 16, i
        assert second.outputs[f"b{i}"][0] == expected[i], i
        if i == 0:
            turn = p + expected[0] + [5, 6, 7]
            second.add("turn", turn, GREEDY)
            second.run()
            assert second.finals["turn"][0].cached_tokens == len(p) + 19
            assert second.outputs["turn"][0] == hf_greedy(hf_gemma, turn, 20)
    stats = second.sched.stats()
    assert stats["disk_blocks_loaded"] > 0 and stats["disk_load_failures"] == 0
    close(second)
    free_at_the_end(second)


@pytest.mark.parametrize("page_size", [1, 16])
def test_a_disk_match_never_ends_where_its_window_is_missing(gemma_dir, hf_gemma, tmp_path,  # noqa: F811
                                                             page_size):
    """Window files are written where the tree keeps windows (prompts' and sequences' ends),
    not at every chunk's end. A prompt and, before it, its first 100 tokens as a prompt of
    their own: with the window file of the long one's last block removed, a restarted
    engine's match ends where the short one's window is (its last whole block, at 96), and
    the scheduler computes from there; with every window file removed, nothing is read from
    disk (the blocks of full KV alone would leave the sliding layers nothing to read)."""
    prompt = long_prompts(22)[3]
    expected = hf_greedy(hf_gemma, prompt, 20)
    first = harness(gemma_dir, tmp_path, page_size)
    for rid, p in (("short", prompt[:100]), ("a", prompt)):
        first.add(rid, p, GREEDY)
        first.run()
    close(first)
    store = first.sched.disk.store
    names = block_hashes(store.fingerprint, None, prompt, 16)
    assert [store.contains(window_name(n)) for n in names] == [k in (5, 8) for k in range(9)]
    store.path(window_name(names[-1])).unlink()
    second = harness(gemma_dir, tmp_path, page_size)
    found = second.sched.disk.lookup(prompt, None, 0, len(prompt) - 1)
    assert found == names[:6]
    second.add("b", prompt, GREEDY)
    second.run()
    close(second)
    assert second.finals["b"][0].cached_tokens_disk == 96
    assert second.outputs["b"][0] == expected
    for name in names:
        store.path(window_name(name)).unlink(missing_ok=True)
    third = harness(gemma_dir, tmp_path, page_size)
    assert third.sched.disk.lookup(prompt, None, 0, len(prompt) - 1) == []
    third.add("c", prompt, GREEDY)
    third.run()
    close(third)
    assert third.finals["c"][0].cached_tokens == 0
    assert third.outputs["c"][0] == expected
    free_at_the_end(third)


@pytest.mark.parametrize("when", ["before", "during"])
def test_a_load_whose_window_file_fails_is_admitted_again(gemma_dir, hf_gemma, tmp_path,  # noqa: F811
                                                          when):
    """A window file removed between the lookup and the load (or a request aborted while its
    load runs): the load ends early, caches nothing, and the request is admitted again and
    computes (its tokens unchanged); the pages it held, sliding ones included, come back."""
    prompt, store, last = saved_once(gemma_dir, tmp_path)
    victim = store.path(last)
    second = harness(gemma_dir, tmp_path, 16)
    second.add("b", prompt, GREEDY)
    second.step()  # admitted: the lookup found every block and window, the load is on its way
    assert second.sched.loads.waiting
    if when == "before":
        victim.unlink()
    else:
        second.sched.abort("b")
        assert second.sched.loads.orphan_windows
    second.run()
    close(second)
    assert not second.sched.loads.orphans and not second.sched.loads.orphan_windows
    if when == "before":
        assert second.outputs["b"][0] == hf_greedy(hf_gemma, prompt, 20)
        assert second.sched.stats()["disk_load_failures"] == 1
        assert second.finals["b"][0].cached_tokens_disk < (len(prompt) - 1) // 16 * 16
    else:
        assert second.finals["b"][0].finish_reason == "abort"
    free_at_the_end(second)


def test_a_windowed_directory_is_not_read_by_a_full_kv_engine(gemma_dir, tmp_path):  # noqa: F811
    """Blocks written with the sliding layers apart hold the full layer only: the identity
    names which layers are apart, so a full-KV engine on the same directory (and the other
    way round) looks in a store of its own and reads none of them."""
    small = {"chunked_prefill_size": 16}
    windowed = served_identity(gemma_dir, sliding_kv_ratio=0.5, **small)
    full = served_identity(gemma_dir, **small)
    assert windowed["sliding_layers"] == [0, 1] and full["sliding_layers"] is None
    assert fingerprint(windowed) != fingerprint(full)
    # the share of sliding pages is how much is kept, not what a block holds
    assert fingerprint(served_identity(gemma_dir, sliding_kv_ratio=1.0, **small)) == (
        fingerprint(windowed))
    prompt = long_prompts(24)[1]
    first = harness(gemma_dir, tmp_path, 16)
    first.add("a", prompt, GREEDY)
    first.run()
    close(first)
    other = Harness(gemma_dir, page_size=16, num_pages=20, disk_cache_dir=str(tmp_path),
                    chunked_prefill_size=24, max_prefill_tokens=64)
    assert other.sched.disk.store.fingerprint != first.sched.disk.store.fingerprint
    assert other.sched.disk.lookup(prompt, None, 0, len(prompt) - 1) == []
    other.add("b", prompt, GREEDY)
    other.run()
    close(other)
    assert other.finals["b"][0].cached_tokens_disk == 0
    assert other.outputs["b"][0] == first.outputs["a"][0]


@pytest.mark.parametrize(("page_size", "ratio"), [(1, 0.3), (16, 0.5)])
def test_a_prompt_longer_than_the_sliding_pool_comes_back_from_disk(
        gemma_dir, hf_gemma, tmp_path, page_size, ratio):  # noqa: F811
    """A disk load takes sliding pages for the window before its end only, not for every
    loaded page: a 200-token prompt comes back to a restarted engine through a sliding pool
    smaller than it, hitting every whole block below its last token."""
    prompt = np.random.default_rng(25).integers(3, 90, 200).tolist()
    first = harness(gemma_dir, tmp_path, page_size, sliding_kv_ratio=ratio)
    assert first.sched.tree.sliding.allocator.num_pages * page_size < 200
    first.add("a", prompt, GREEDY)
    first.run()
    close(first)
    second = harness(gemma_dir, tmp_path, page_size, sliding_kv_ratio=ratio)
    second.add("b", prompt, GREEDY)
    second.run()
    close(second)
    assert second.finals["b"][0].cached_tokens_disk == 192
    assert second.outputs["b"][0] == first.outputs["a"][0] == hf_greedy(hf_gemma, prompt, 20)
    free_at_the_end(second)


def test_host_and_disk_tiers_together(gemma_dir, hf_gemma, tmp_path):  # noqa: F811
    """Prompts that share prefixes through a device pool that holds about two, a host tier
    that holds a few more and the disk: matches reach through host-only nodes and loads of
    disk blocks after them (the host part's window and the disk load's each get sliding
    pages); every output equals transformers', every pool is free at the end."""
    from tests.test_sliding_host import host_cache_gb

    rng = np.random.default_rng(26)
    heads = [rng.integers(3, 90, 64).tolist() for _ in range(3)]
    batch = [head + rng.integers(3, 90, int(rng.integers(30, 60))).tolist()
             for head in heads for _ in range(2)]
    h = harness(gemma_dir, tmp_path, 16, num_pages=20,
                host_cache_gb=host_cache_gb(gemma_dir, 24, 16))
    for wave, order in (("a", range(6)), ("b", range(5, -1, -1))):  # resent newest first
        for i in order:
            h.add(f"{wave}{i}", batch[i], GREEDY)
            h.run()
    close(h)
    for i, p in enumerate(batch):
        expected = hf_greedy(hf_gemma, p, 20)
        assert h.outputs[f"a{i}"][0] == h.outputs[f"b{i}"][0] == expected, i
    finals = [h.finals[f"b{i}"][0] for i in range(len(batch))]
    assert sum(f.cached_tokens_disk for f in finals) > 0
    assert sum(f.cached_tokens_host for f in finals) > 0
    tree = h.sched.tree
    tree.reset()
    for alloc in (tree.allocator, tree.sliding.allocator, tree.host.allocator, tree.host.swa):
        assert alloc.num_free_pages == alloc.num_pages


@pytest.mark.parametrize("page_size", [1, 16])
def test_a_host_match_continued_by_a_disk_load(gemma_dir, hf_gemma, tmp_path,  # noqa: F811
                                               page_size):
    """A prompt whose first turn is in the host tier only (with the window kept where it
    ended) and whose continuation the disk holds: the match loads the host part with its
    window, the disk load follows it with the window before its own end, and the tokens are
    transformers'."""
    from tests.test_sliding_host import host_cache_gb

    rng = np.random.default_rng(27)
    turn = rng.integers(3, 90, 96).tolist()
    longer = turn + rng.integers(3, 90, 70).tolist()
    h = harness(gemma_dir, tmp_path, page_size,
                host_cache_gb=host_cache_gb(gemma_dir, 512 // page_size, page_size))
    for rid, p in (("a", turn), ("b", longer)):
        h.add(rid, p, GREEDY)
        h.run()
    flush(h)
    tree = h.sched.tree
    tree.evict(tree.allocator.num_pages)  # every node to the host tier (write-back)
    head = tree._roots[None]
    while head.end < len(turn):  # the path's node that ends where the first turn ended
        (head,) = head.children.values()
    assert not head.pages and head.host_pages and head.end == len(turn)
    for tail in list(head.children.values()):
        tree._drop_host_node(tail)  # the continuation is on disk only
    h.add("again", longer, GREEDY)
    h.run()
    final = h.finals["again"][0]
    assert final.cached_tokens_host == len(turn)
    assert final.cached_tokens_disk == (len(longer) - 1) // 16 * 16 - len(turn)
    assert h.outputs["again"][0] == h.outputs["b"][0] == hf_greedy(hf_gemma, longer, 20)
    tree.reset()
    for alloc in (tree.allocator, tree.sliding.allocator, tree.host.allocator, tree.host.swa):
        assert alloc.num_free_pages == alloc.num_pages


def test_a_window_file_that_cannot_be_read_is_not_loaded_forever(gemma_dir, hf_gemma,  # noqa: F811
                                                                  tmp_path, monkeypatch):
    """A window file that is there but fails every read (an I/O error: the store keeps it) ends
    its load early each time: the request is admitted again at most once more with that load,
    then computes past it, its output transformers' (it does not load, fail and retry forever)."""
    import errno

    from engine.contracts.disk_cache import DiskStore

    prompt, _, bad = saved_once(gemma_dir, tmp_path)
    read_in = DiskStore._read_in

    def failing(self, directory, name, tokens, payload_bytes):
        if name == bad:
            raise OSError(errno.EIO, "Input/output error")
        return read_in(self, directory, name, tokens, payload_bytes)

    monkeypatch.setattr(DiskStore, "_read_in", failing)
    second = harness(gemma_dir, tmp_path, 16)
    second.add("b", prompt, GREEDY)
    second.run(max_steps=200)
    close(second)
    assert second.outputs["b"][0] == hf_greedy(hf_gemma, prompt, 20)
    assert second.sched.stats()["disk_load_failures"] == 1
    free_at_the_end(second)
